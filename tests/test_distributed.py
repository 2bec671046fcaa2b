"""energy_loader.distributed and WorkerConfig's process-group constructors.

The multi-process tests start real gloo groups on 127.0.0.1 (tests/distributed_helpers.py):
every rank runs a SavableDataLoader with worker processes. The rest run in this process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import energy_loader as el
from energy_loader import distributed as eld
from energy_loader.state.rank_file import read_rank_file
from energy_loader.testing.resume import compare_events, record_events
from tests import distributed_helpers as dh
from tests.helpers import process_alive, reference_pipeline
from tests.loader.dropin_helpers import assert_same, dealt_rest, distributed_order

LENGTH = 64  # samples in the pipelines of tests/distributed_helpers.make_loader


def _read(path: Path) -> object:
    return json.loads(path.read_text())


# -- WorkerConfig from the environment ------------------------------------------------------------


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_from_env_reads_torchrun_variables(torchrun_env: pytest.MonkeyPatch) -> None:
    assert el.WorkerConfig.from_env(num_workers=2) == el.WorkerConfig(num_workers=2)
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}.items():
        torchrun_env.setenv(name, value)
    torchrun_env.setenv("LOCAL_WORLD_SIZE", "4")
    config = el.WorkerConfig.from_env(num_workers=2, seed=9)
    assert (config.rank, config.world_size, config.num_workers, config.seed) == (5, 8, 2, 9)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1"}, "WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "RANK is not"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK must be an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK must be in range"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "LOCAL_RANK=1 cannot exceed"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3"),
        (
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"},
            "below LOCAL_WORLD_SIZE",
        ),
    ],
)
def test_from_env_rejects_a_broken_environment(
    torchrun_env: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        torchrun_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        el.WorkerConfig.from_env()


def test_from_process_group_needs_an_initialised_group() -> None:
    with pytest.raises(ValueError, match="init_process_group"):
        el.WorkerConfig.from_process_group(num_workers=1)


def test_data_parallel_group_must_be_a_group() -> None:
    with pytest.raises(TypeError, match="ProcessGroup"):
        el.WorkerConfig(data_parallel_group="dp")


# -- single process: the global API degenerates to one rank ---------------------------------------


def _loader(**config: int) -> el.SavableDataLoader:
    worker_config = el.WorkerConfig(num_workers=0, **config)
    return el.SavableDataLoader(reference_pipeline(length=24), worker_config=worker_config)


def test_single_process_gather_and_restore_round_trip() -> None:
    full, _ = record_events(_loader(), 2)
    loader = _loader()
    head, ended = record_events(loader, 2, stop=4)
    states = eld.save_state_global(loader, 0)
    assert states is not None and len(states) == 1
    for src_rank in (None, 0):
        restored = _loader()
        eld.restore_state_global(restored, json.loads(json.dumps(states)), src_rank=src_rank)
        tail, _ = record_events(restored, 2 - ended)
        assert compare_events(full, head + tail) is None


def test_full_list_restores_own_entry_without_a_process_group() -> None:
    states = [_loader(rank=rank, world_size=2).save_state_rank() for rank in range(2)]
    target = _loader(rank=1, world_size=2)
    eld.restore_state_global(target, states)
    with pytest.raises(ValueError, match="no process group is initialised"):
        eld.restore_state_global(target, states, src_rank=0)
    with pytest.raises(ValueError, match="no process group is initialised"):
        eld.save_state_global(target, 0)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda loader: eld.save_state_global(loader, 1), ValueError, "not in this loader's"),
        (lambda loader: eld.save_state_global(loader, True), TypeError, "an int"),
        (lambda loader: eld.save_state_global(loader, -2), ValueError, ">= 0"),
        (lambda loader: eld.save_state_global("x", 0), TypeError, "SavableDataLoader"),
        (lambda loader: eld.restore_state_global(loader, None), TypeError, "list of every"),
        (lambda loader: eld.restore_state_global(loader, [{}]), el.StateFormatError, "world_size"),
        (lambda loader: eld.restore_state_global(loader, [], src_rank=3), ValueError, "not in"),
    ],
)
def test_bad_arguments_name_the_fix(call, error, message) -> None:
    with pytest.raises(error, match=message):
        call(_loader())


def test_wrong_length_is_a_state_mismatch() -> None:
    loader = _loader()
    state = loader.save_state_rank()
    with pytest.raises(el.StateMismatchError, match="holds 2 rank states but they were saved"):
        eld.restore_state_global(loader, [state, state])


# -- the per-rank paths: DCP keys and files ------------------------------------------------------


def test_rank_keys_and_paths_name_rank_and_world_size(tmp_path: Path) -> None:
    config = el.WorkerConfig(rank=3, world_size=16)
    assert eld.rank_state_key(config) == "loader_rank_00003_of_00016"
    assert eld.rank_state_path(tmp_path, config, "data").name == "data_rank_00003_of_00016.pt"
    with pytest.raises(ValueError, match="prefix"):
        eld.rank_state_key(config, "a/b")
    with pytest.raises(TypeError, match="WorkerConfig"):
        eld.rank_state_key(3)


def test_rank_file_round_trip_and_errors(tmp_path: Path) -> None:
    full, _ = record_events(_loader(), 1)
    loader = _loader()
    head, _ = record_events(loader, 1, stop=3)
    path = eld.save_state_rank_file(loader, tmp_path / "step_3")
    assert read_rank_file(path)["format"] == "energy_loader.rank_state"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    restored = _loader()
    eld.restore_state_rank_file(restored, path.parent)
    tail, _ = record_events(restored, 1)
    assert compare_events(full, head + tail) is None

    with pytest.raises(el.StateMismatchError, match="num_partitions=1"):
        eld.restore_state_rank_file(_loader(rank=0, world_size=2), path.parent)
    with pytest.raises(FileNotFoundError, match="save_state_rank_file"):
        eld.restore_state_rank_file(_loader(), tmp_path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(el.StateFormatError, match="truncated"):
        eld.restore_state_rank_file(_loader(), path.parent)


def _dropin(rank: int, world_size: int) -> el.SavableDataLoader:
    """A drop-in loader (a plain torch Dataset) simulating rank ``rank`` of ``world_size``."""
    config = el.WorkerConfig(rank=rank, world_size=world_size, num_workers=0)
    return el.SavableDataLoader(TensorDataset(torch.arange(12)), batch_size=2, worker_config=config)


def test_rank_files_of_a_dropin_loader_restore_on_the_same_world_size(tmp_path: Path) -> None:
    for rank in range(2):
        loader = _dropin(rank, 2)
        iterator = iter(loader)
        next(iterator)
        eld.save_state_rank_file(loader, tmp_path)
    restored = _dropin(1, 2)
    assert eld.read_rank_state_files(restored, tmp_path)[0]["rank"] == 1
    eld.restore_state_rank_file(restored, tmp_path)
    assert_same(list(restored), list(iterator))
    with pytest.raises(
        el.StateMismatchError,
        match=r"2 rank state\(s\) were saved, this job has world size 1: a drop-in loader "
        "restores on the same world size",
    ):
        eld.restore_state_rank_file(_dropin(0, 1), tmp_path)
    with pytest.raises(el.StateMismatchError, match="saved by a drop-in loader"):
        eld.restore_state_rank_file(_loader(rank=0, world_size=2), tmp_path)


def test_rank_state_files_find_one_save_and_say_what_they_expected(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    for rank in (1, 0):
        eld.save_state_rank_file(_loader(rank=rank, world_size=2), folder, "data")
    names = ["data_rank_00000_of_00002.pt", "data_rank_00001_of_00002.pt"]
    assert [p.name for p in eld.rank_state_files(folder, "data")] == names
    assert [p.name for p in eld.rank_state_files(folder, None)] == names  # the one prefix
    restored = _loader(rank=1, world_size=2)
    states = eld.read_rank_state_files(restored, folder, None)
    assert [s.rank for s in states] == [1]  # the same layout reads the rank's own file only
    with pytest.raises(FileNotFoundError, match=r"expected files named loader_rank_NNNNN_of"):
        eld.rank_state_files(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"PREFIX_rank_NNNNN_of_NNNNN\.pt .* it is empty"):
        eld.rank_state_files(tmp_path / "empty", None)
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        eld.rank_state_files(folder / names[0])
    eld.save_state_rank_file(_loader(), folder, "other")
    with pytest.raises(ValueError, match=r"several prefixes \['data', 'other'\]"):
        eld.rank_state_files(folder, None)
    (folder / names[1]).unlink()
    with pytest.raises(el.StateMismatchError, match=r"not those of ranks \[1\]"):
        eld.rank_state_files(folder, "data")


# -- real multi-process groups ---------------------------------------------------------------------


def _assert_disjoint_epochs(workdir: Path, world_size: int) -> None:
    """Across ranks, every epoch visits every sample exactly once."""
    per_rank = [_read(workdir / f"epochs_rank{rank}.json") for rank in range(world_size)]
    for epoch in range(len(per_rank[0])):
        seen = [index for epochs in per_rank for index in epochs[epoch]]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was seen twice"
        assert sorted(seen) == list(range(LENGTH)), f"epoch {epoch}: samples missing"


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("world_size", "num_workers", "stop"), [(2, 2, 5), (4, 1, 2)])
def test_gather_then_fresh_processes_restore_exactly(
    tmp_path: Path, world_size: int, num_workers: int, stop: int, no_leftover_processes: None
) -> None:
    dh.launch(
        dh.record_and_save, world_size, tmp_path, timeout=60,
        num_workers=num_workers, stop=stop, epochs=2,
    )  # fmt: skip
    states = _read(tmp_path / "states.json")
    assert [s["rank"] for s in states] == list(range(world_size))
    assert {s["world_size"] for s in states} == {world_size}

    dh.launch(
        dh.restore_and_continue, world_size, tmp_path, timeout=60,
        num_workers=num_workers, epochs=2,
    )  # fmt: skip
    for rank in range(world_size):
        report = _read(tmp_path / f"continuations_rank{rank}.json")
        assert report == {"full_list": None, "scatter": None, "rank_file": None}, rank
    _assert_disjoint_epochs(tmp_path, world_size)


@pytest.mark.timeout(120)
def test_data_parallel_groups_share_samples_within_a_replica(
    tmp_path: Path, no_leftover_processes: None
) -> None:
    dh.launch(dh.data_parallel_replicas, 4, tmp_path, timeout=90, stop=2)
    import torch

    keys = [torch.load(tmp_path / f"keys_rank{rank}.pt") for rank in range(4)]
    assert keys[0] == keys[1] and keys[2] == keys[3], "tensor-parallel peers differ"
    replica_a = {k for batch in keys[0] for k in batch}
    replica_b = {k for batch in keys[2] for k in batch}
    assert not replica_a & replica_b
    assert len(replica_a | replica_b) == LENGTH
    for rank in range(4):
        checks = _read(tmp_path / f"replica_rank{rank}.json")
        dp_rank = rank // 2
        assert checks["config"] == [dp_rank, 2]
        assert checks["ranks"] == [rank % 2, rank % 2 + 2]
        assert checks["two_dim_mesh"][0] == "ValueError"
        assert checks["not_member"][0] == ("ok" if rank in (0, 2) else "ValueError")
        assert checks["wrong_rank"][0] == "ValueError"
        assert checks["dst_outside_group"][0] == "ValueError"
        assert checks["gathered"] == ([0, 1] if dp_rank == 0 else None)
        assert checks["continuation"] is None


EXPECTED_BAD = {
    "full_list_too_long": "StateMismatchError",
    "scatter_too_short": "StateMismatchError",
    "full_list_other_layout": "StateMismatchError",
    "scatter_other_layout": "StateMismatchError",
    "other_layout_adopted": "ok",
    "full_list_swapped": "StateMismatchError",
    "full_list_one_rank_bad": "StateMismatchError",
    "scatter_one_rank_bad": "StateMismatchError",
    "scatter_not_a_list": "TypeError",
    "src_outside_group": "ValueError",
    "dst_outside_group": "ValueError",
    "dst_negative": "ValueError",
    "dst_not_int": "TypeError",
    # The position is computed from what was delivered, which the main process holds: a
    # worker that died since cannot take it away, so both ranks save (and no rank hangs).
    "dead_worker": "ok",
}


@pytest.mark.timeout(120)
def test_bad_input_raises_on_every_rank_and_nobody_hangs(
    tmp_path: Path, no_leftover_processes: None
) -> None:
    dh.launch(dh.bad_inputs, 2, tmp_path, timeout=90)
    reports = [_read(tmp_path / f"bad_rank{rank}.json") for rank in range(2)]
    for rank, report in enumerate(reports):
        got = {name: report[name][0] for name in EXPECTED_BAD}
        assert got == EXPECTED_BAD, (rank, report)
        assert report["good_after_bad"][0] == "None", report["good_after_bad"]
    # Both ranks name the rank whose state did not fit, and say why.
    for report in reports:
        assert "data-parallel rank(s) [1]" in report["full_list_one_rank_bad"][1]
        assert "ShuffleBufferDataset.size: saved 99, now 8" in report["full_list_one_rank_bad"][1]
        assert "holds 1 rank states" in report["scatter_too_short"][1]
        assert "num_partitions=4" in report["scatter_other_layout"][1]


@pytest.mark.timeout(120)
def test_dcp_round_trip_with_one_loader_key(tmp_path: Path, no_leftover_processes: None) -> None:
    dh.launch(dh.dcp_round_trip, 2, tmp_path, timeout=90, steps=3, more=4)
    for rank in range(2):
        report = _read(tmp_path / f"dcp_rank{rank}.json")
        assert report == {"key": "loader", "continuation": None, "same_params": True}


# A rank that hangs at exit runs into this (torchrun would wait for ever); a job that ends well
# takes 2-5 s on two cores.
TEARDOWN_TIMEOUT = 60


def _end_as_the_tutorial_ends(workdir: Path) -> None:
    """One tutorial-shaped 2-rank job (dh.tutorial_teardown): every rank exits 0 in time, and
    the loader workers it left running at ``destroy_process_group()`` are gone with it."""
    dh.launch(dh.tutorial_teardown, 2, workdir, timeout=TEARDOWN_TIMEOUT, torchrun_env=True,
              steps=4, every=2)  # fmt: skip
    pids = [pid for rank in range(2) for pid in _read(workdir / f"workers_rank{rank}.json")]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
        time.sleep(0.05)
    lingering = [pid for pid in pids if process_alive(pid)]
    for pid in lingering:
        os.kill(pid, signal.SIGKILL)
    assert not lingering, f"loader workers {lingering} outlived their rank"


@pytest.mark.timeout(2 * TEARDOWN_TIMEOUT)
def test_a_job_ended_as_the_torchrun_tutorial_ends_exits(
    tmp_path: Path, no_leftover_processes: None
) -> None:
    _end_as_the_tutorial_ends(tmp_path)


# A hang at exit comes and goes with timing: torch's, with the DDP model kept alive at
# destroy_process_group(), hung 4 and 5 of 20 of these jobs (with and without the loader).
# Twenty runs, ~25 s.
@pytest.mark.slow
@pytest.mark.timeout(20 * TEARDOWN_TIMEOUT)
def test_twenty_jobs_ended_as_the_torchrun_tutorial_ends_all_exit(
    tmp_path: Path, no_leftover_processes: None
) -> None:
    for run in range(20):
        _end_as_the_tutorial_ends(tmp_path / f"run{run}")


def _job_stream(streams: list[list[Any]]) -> list[Any]:
    """Interleave the ranks' streams step by step: G[s * world_size + r] = streams[r][s]."""
    return [stream[step] for step in range(len(streams[0])) for stream in streams]


@pytest.mark.timeout(240)
def test_saved_on_two_ranks_restores_on_three(tmp_path: Path, no_leftover_processes: None) -> None:
    # 2 ranks x 1 worker (3 partitions each) save; 3 ranks x 2 workers (1 each) restore, P = 6.
    steps, more = 5, 10
    dh.launch(dh.elastic_save, 2, tmp_path, timeout=90, steps=steps, more=more)
    saved = _job_stream(
        [torch.load(tmp_path / f"elastic_saved{r}.pt", weights_only=True) for r in range(2)]
    )
    assert len({tuple(map(tuple, key)) for key in saved}) == len(saved)
    for via in ("files", "dcp"):
        dh.launch(dh.elastic_restore, 3, tmp_path, timeout=90, steps=6, via=via)
        resumed = _job_stream(
            [torch.load(tmp_path / f"elastic_{via}{r}.pt", weights_only=True) for r in range(3)]
        )
        assert resumed == saved[2 * steps : 2 * steps + len(resumed)], via


@pytest.mark.timeout(150)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dropin_loader_resumes_every_rank_through_every_path(
    tmp_path: Path, num_workers: int, no_leftover_processes: None
) -> None:
    """A torch Dataset under a DistributedSampler on 2 ranks, saved mid-epoch 0 through the
    gather, per-rank files and DCP, restored by fresh processes in each way: every rank's
    batches (indices and augmentations) through 2 epochs are the uninterrupted run's."""
    stop = 3
    dh.launch(dh.dropin_save, 2, tmp_path, timeout=60, num_workers=num_workers, stop=stop)
    assert sorted(p.name for p in (tmp_path / "dropin_files").iterdir()) == [
        "loader_rank_00000_of_00002.pt",
        "loader_rank_00001_of_00002.pt",
    ]
    dh.launch(dh.dropin_restore, 2, tmp_path, timeout=60, num_workers=num_workers)
    epoch_indices: list[list[int]] = [[], []]
    for rank in range(2):
        run = torch.load(tmp_path / f"dropin_run_rank{rank}.pt", weights_only=False)
        tails = torch.load(tmp_path / f"dropin_tails_rank{rank}.pt", weights_only=False)
        full, head = run["full"], run["head"]
        assert [epoch for epoch, _ in full] == [0] * 7 + [1] * 7
        assert len(head) == stop
        for way in dh.DROPIN_WAYS:
            assert head + tails[way] == full, (rank, way)
        for epoch, batch in full:
            epoch_indices[epoch] += batch["index"]
    for indices_of_epoch in epoch_indices:  # the ranks read disjoint halves of every epoch
        assert sorted(indices_of_epoch) == list(range(dh.DROPIN_LENGTH))


@pytest.mark.timeout(180)
def test_reads_per_rank_stay_flat_when_eight_ranks_resume_on_eight_and_six(
    tmp_path: Path, no_leftover_processes: None
) -> None:
    """8 ranks save (24 partitions, no workers); fresh processes restore on 8 and on 6 ranks
    through DCP and per-rank files. Each continues the job's stream exactly; a DCP rank reads
    the .metadata and its own slots only, so after the resize it reads within 2x of a
    same-layout restore (counted by the storage reader); a file restore reads the rank's own
    file and another's header, or after the resize the headers and its own slots of a few
    files: within 2x of what a rank of 6 reads restoring a 6-rank save (counted by the files'
    reader)."""
    partitions, length, steps = 24, 960, 4
    dh.launch(
        dh.scale_save,
        8,
        tmp_path,
        timeout=90,
        partitions=partitions,
        length=length,
        steps=5,
        more=steps,
    )
    saved = _job_stream(
        [torch.load(tmp_path / f"scale_saved{r}.pt", weights_only=True) for r in range(8)]
    )
    reads: dict[int, dict[str, list[int]]] = {}
    for world_size in (8, 6):
        dh.launch(
            dh.scale_restore,
            world_size,
            tmp_path,
            timeout=90,
            partitions=partitions,
            length=length,
            steps=steps,
            ways=("dcp", "files"),
        )
        reports = [_read(tmp_path / f"scale_restore_rank{r}.json") for r in range(world_size)]
        reads[world_size] = {way: [r[way]["read"] for r in reports] for way in ("dcp", "files")}
        for way in ("dcp", "files"):
            resumed = _job_stream(
                [
                    torch.load(tmp_path / f"scale_{way}{r}.pt", weights_only=True)
                    for r in range(world_size)
                ]
            )
            assert resumed == saved[: len(resumed)], (world_size, way)
    # The same job saved and restored on 6 ranks: what a rank of 6 reads on its own layout.
    six = tmp_path / "six"
    six.mkdir()
    run = {"partitions": partitions, "length": length}
    dh.launch(dh.scale_save, 6, six, timeout=90, **run, steps=5, more=steps)
    dh.launch(dh.scale_restore, 6, six, timeout=90, **run, steps=steps, ways=("files",))
    own_six = [_read(six / f"scale_restore_rank{r}.json")["files"]["read"] for r in range(6)]
    file_size = (tmp_path / "files" / "loader_rank_00000_of_00008.pt").stat().st_size
    assert max(reads[8]["dcp"]) <= 2 * min(reads[8]["dcp"]), reads
    assert max(reads[6]["dcp"]) <= 2 * min(reads[8]["dcp"]), reads
    # Its own file, and one other rank's header (~0.3 KB: the witness of one save), no more.
    assert max(reads[8]["files"]) <= file_size + 512, reads
    # After the resize: the headers and its own slots' bytes of the files holding them, within
    # 2x of what a rank of that layout reads from its own file.
    assert max(reads[6]["files"]) <= 2 * min(own_six), (reads, own_six)


RESIZED_LENGTH = 29  # divisible by neither 2 nor 3: every layout pads


@pytest.fixture(scope="module")
def dropin_saved_on_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank drop-in job saved after 2 batches of 3 of epoch 0 every way, and its
    uninterrupted run (tests/distributed_helpers.dropin_save)."""
    workdir = tmp_path_factory.mktemp("dropin_resized")
    dh.launch(dh.dropin_save, 2, workdir, timeout=60, num_workers=0, stop=2, length=RESIZED_LENGTH)
    return workdir


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world_size", "batch_size"), [(1, 3), (3, 3), (3, 2)])
def test_a_dropin_job_saved_on_two_ranks_resumes_on_another_number(
    dropin_saved_on_two_ranks: Path, world_size: int, batch_size: int, no_leftover_processes: None
) -> None:
    """Saved by 2 gloo ranks mid-epoch 0, restored by fresh processes on 1 or 3 ranks through
    the gather, the scatter, per-rank files and DCP: each new rank takes the rule's indices
    (the rest of the epoch's permutation dealt as DistributedSampler deals), the old and new
    ranks together take the epoch once but for the padding, every sample's augmentation is
    the uninterrupted 2-rank run's, and epoch 1 is a fresh job's on the new layout."""
    workdir, stop, old_batch = dropin_saved_on_two_ranks, 2, 3
    dh.launch(
        dh.dropin_restore, world_size, workdir, timeout=60, num_workers=0,
        length=RESIZED_LENGTH, batch_size=batch_size,
    )  # fmt: skip
    runs = [torch.load(workdir / f"dropin_run_rank{r}.pt", weights_only=False) for r in range(2)]
    tails = [
        torch.load(workdir / f"dropin_tails_rank{r}.pt", weights_only=False)
        for r in range(world_size)
    ]
    augmented = {  # index -> what the uninterrupted run's __getitem__ drew, epoch 0
        index: (python, numpy, torch_values)
        for run in runs
        for epoch, batch in run["full"]
        if epoch == 0
        for index, python, numpy, torch_values in zip(
            batch["index"], batch["python"], batch["numpy"], batch["torch"], strict=True
        )
    }
    head = [i for run in runs for _, batch in run["head"] for i in batch["index"]]
    order = distributed_order(RESIZED_LENGTH, 0, seed=5)
    assert sorted(head) == sorted(order[: stop * old_batch * 2])
    for way in dh.DROPIN_WAYS:
        rest: list[int] = []
        for rank, tail in enumerate(tails):
            epoch_0 = [b for epoch, b in tail[way] if epoch == 0]
            mine = [i for batch in epoch_0 for i in batch["index"]]
            assert mine == dealt_rest(order, len(head), world_size, rank), (way, rank)
            for batch in epoch_0:
                for index, *drawn in zip(batch["index"], batch["python"], batch["numpy"],
                                         batch["torch"], strict=True):  # fmt: skip
                    assert tuple(drawn) == augmented[index], (way, rank, index)
            assert [b for e, b in tail[way] if e == 1] == [b for e, b in tail["fresh"] if e == 1]
            rest += mine
        assert sorted(set(head + rest)) == list(range(RESIZED_LENGTH)), way
        padding = len(head) + len(rest) - RESIZED_LENGTH
        assert 0 <= padding < world_size, way  # DistributedSampler's padding, nothing more


# -- one job seed per job, whatever each rank's seeding ------------------------------------------


def _augmentations(batches: list[Any], into: dict[tuple[int, int], Any]) -> int:
    """Record (epoch, index) -> what ``__getitem__`` drew; a sample seen twice (the sampler's
    padding) must have drawn the same. Returns how many samples were recorded."""
    count = 0
    for epoch, batch in batches:
        for index, *drawn in zip(batch["index"], batch["python"], batch["numpy"],
                                 batch["torch"], strict=True):  # fmt: skip
            assert into.setdefault((epoch, index), tuple(drawn)) == tuple(drawn), (epoch, index)
            count += 1
    return count


@pytest.fixture(scope="module")
def dropin_seeded_on_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2-rank drop-in jobs seeded per rank and not at all, saved after 2 batches of epoch 0
    every way (tests/distributed_helpers.dropin_seeded_save), and a second run's files."""
    workdir = tmp_path_factory.mktemp("dropin_seeded")
    dh.launch(dh.dropin_seeded_save, 2, workdir, timeout=60, stop=2, length=RESIZED_LENGTH)
    return workdir


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [3, 1])
def test_per_rank_or_no_seeding_gives_every_sample_its_augmentation_back_on_another_world_size(
    dropin_seeded_on_two_ranks: Path, world_size: int, no_leftover_processes: None
) -> None:
    """2 gloo ranks seeded ``torch.manual_seed(1000 + rank)`` (and python's, numpy's), or not
    seeded at all (each from the OS), save mid-epoch 0 and run on uninterrupted; fresh
    processes restore on 3 and 1 ranks through the gathered list, per-rank files and DCP. The
    oracle is the uninterrupted 2-rank run: every sample the restored job makes, in epoch 0's
    rest and in epoch 1, drew what that run's ``__getitem__`` drew for the same index and
    epoch, whichever rank makes it now (one job seed per job, agreed at the first iter())."""
    workdir = dropin_seeded_on_two_ranks
    dh.launch(dh.dropin_seeded_restore, world_size, workdir, timeout=60, length=RESIZED_LENGTH)
    for seeding in dh.SEEDINGS:
        folder = workdir / seeding
        oracle: dict[tuple[int, int], Any] = {}
        for rank in range(2):
            _augmentations(torch.load(folder / f"run_rank{rank}.pt", weights_only=False), oracle)
        tails = [
            torch.load(folder / f"tails_{world_size}_rank{r}.pt", weights_only=False)
            for r in range(world_size)
        ]
        for way in dh.SEEDED_WAYS:
            restored: dict[tuple[int, int], Any] = {}
            made = sum(_augmentations(tail[way], restored) for tail in tails)
            assert made >= RESIZED_LENGTH, (seeding, way)  # epoch 1 whole, and epoch 0's rest
            assert {e for e, _ in restored} == {0, 1}, (seeding, way)
            differ = sorted(key for key, drawn in restored.items() if oracle[key] != drawn)
            assert not differ, (seeding, way, f"{len(differ)} of {len(restored)} differ")


def _simulated_dropin(rank: int, world_size: int) -> el.SavableDataLoader:
    """dh.dropin_loader's setup as rank ``rank`` of ``world_size``, without a process group."""
    from torch.utils.data import DistributedSampler

    from tests.loader.dropin_helpers import Augmenting

    dataset = Augmenting(RESIZED_LENGTH)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=5)
    config = el.WorkerConfig(rank=rank, world_size=world_size)
    return el.SavableDataLoader(dataset, batch_size=3, sampler=sampler, worker_config=config)


def test_a_rank_file_of_another_run_mixed_into_a_folder_is_refused(
    dropin_seeded_on_two_ranks: Path, tmp_path: Path
) -> None:
    """Rank 0's file of one run and rank 1's of another run of the same job (same script,
    same seeds, saved at the same step): a folder of both is refused on the world size that
    saved them and on another, and so is the gathered list of both states; each run's own
    folder restores."""
    first = dropin_seeded_on_two_ranks / "per_rank" / "files"
    again = dropin_seeded_on_two_ranks / "per_rank_again" / "files"
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for source, name in ((first, "loader_rank_00000_of_00002.pt"),
                         (again, "loader_rank_00001_of_00002.pt")):  # fmt: skip
        (mixed / name).write_bytes((source / name).read_bytes())
    for world_size in (2, 3):
        for rank in range(world_size):
            loader = _simulated_dropin(rank, world_size)
            with pytest.raises(el.StateMismatchError, match="another run's"):
                eld.restore_state_rank_file(loader, mixed)
            eld.restore_state_rank_file(loader, again)  # one run's folder: fine
    states = [read_rank_file(mixed / f"loader_rank_0000{r}_of_00002.pt") for r in range(2)]
    with pytest.raises(el.StateMismatchError, match="another run's"):
        eld.restore_state_global(_simulated_dropin(0, 2), states)
    # Each gloo rank restored its own state with restore_state_rank, rank 1 the other run's:
    # every rank refuses at the first iter(), where the ranks agree on the job.
    for rank in range(2):
        outcome = _read(dropin_seeded_on_two_ranks / f"mixed_iter_rank{rank}.json")
        assert isinstance(outcome, list)
        kind, message = outcome
        assert kind == "StateMismatchError" and "different jobs or runs" in message, message


PREEMPTIONS = 30


# ~6 s: slow (the kill loop of the drop-in across rank counts). The default run restores a
# drop-in job saved on two ranks on one and three (test_a_dropin_job_saved_on_two_ranks_...).
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_dropin_job_killed_again_and_again_on_other_rank_counts_trains_each_epoch_once(
    tmp_path: Path, no_leftover_processes: None
) -> None:
    """A drop-in job is SIGKILLed PREEMPTIONS times at a seeded random step and phase of a
    step (tests/distributed_helpers.preemptible_dropin_job), each time restarted from its last
    committed checkpoint (per-rank files or DCP, by turns at random) on 1, 2 or 3 ranks, never
    the number it ran on. What was trained -- each job's logged steps up to the step the next
    job restored -- is every epoch's samples once, repeats within DistributedSampler's padding
    only (fewer than the world size per job that trained in the epoch)."""
    rng = random.Random(11)
    world, committed, kills = 2, 0, 0
    jobs: list[tuple[int, int, int, int]] = []  # (job, world size, steps from, steps to)
    while True:
        codes = dh.launch(
            dh.preemptible_dropin_job, world, tmp_path, timeout=60, preemptible=True,
            job=len(jobs), via=rng.choice(("files", "dcp")),
            kill_step=None if kills == PREEMPTIONS else committed + rng.randint(1, 4),
            kill_phase=rng.choice(dh.KILL_PHASES), kill_rank=rng.randrange(world),
        )  # fmt: skip
        start = committed
        committed = _read(tmp_path / "commit.json")["step"]  # type: ignore[index]
        jobs.append((len(jobs), world, start, committed))
        if -signal.SIGKILL not in codes:
            break
        kills += 1
        world = rng.choice([other for other in (1, 2, 3) if other != world])
    assert kills == PREEMPTIONS, "the run ended before every preemption happened"
    trained: dict[int, list[int]] = {}  # epoch -> indices
    padding_allowed: dict[int, int] = {}
    steps: list[int] = []
    for job, world, start, end in jobs:
        logs = [
            [json.loads(line) for line in path.read_text().splitlines()]
            for path in (tmp_path / f"log_job{job:03d}_rank{rank}.jsonl" for rank in range(world))
        ]
        counted = [[line for line in log if start < line["step"] <= end] for log in logs]
        assert len({len(lines) for lines in counted}) == 1, f"job {job}: ranks out of lockstep"
        epochs_trained = set()
        for lines in zip(*counted, strict=True):
            assert len({(line["step"], line["epoch"]) for line in lines}) == 1, lines
            steps.append(lines[0]["step"])
            epochs_trained.add(lines[0]["epoch"])
            trained.setdefault(lines[0]["epoch"], []).extend(
                index for line in lines for index in line["indices"]
            )
        for epoch in epochs_trained:
            padding_allowed[epoch] = padding_allowed.get(epoch, 0) + world - 1
    assert steps == list(range(1, len(steps) + 1)), "a step lost or trained twice"
    assert sorted(trained) == list(range(dh.PREEMPTED_EPOCHS))
    for epoch, indices in trained.items():
        assert sorted(set(indices)) == list(range(dh.PREEMPTED_LENGTH)), f"epoch {epoch}"
        assert len(indices) - dh.PREEMPTED_LENGTH <= padding_allowed[epoch], f"epoch {epoch}"
