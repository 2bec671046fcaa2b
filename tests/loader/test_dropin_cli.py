"""``inspect`` and ``replay`` on the states a drop-in loader saved: files the library wrote
itself (per-rank files) and a training checkpoint holding ``loader.state_dict()``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import energy_loader as el

from ..helpers import run_command, run_commands
from .dropin_helpers import build_shuffled_loader

_run = run_command


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """A run saved after 2 of its 6 batches, and the batches that came after."""
    folder = tmp_path_factory.mktemp("dropin")
    loader = build_shuffled_loader()
    iterator = iter(loader)
    next(iterator), next(iterator)
    el.save_state_rank_file(loader, folder / "files")
    torch.save({"step": 2, "data": loader.state_dict()}, folder / "checkpoint.pt")
    rest = [batch["index"].tolist() for batch in iterator]
    return folder, rest


def test_inspect_describes_a_drop_in_state(saved: tuple[Path, list[Any]]) -> None:
    folder, _ = saved
    text, as_json = run_commands(
        ("inspect", str(folder / "checkpoint.pt")), ("inspect", "--json", str(folder / "files"))
    )
    assert text.returncode == 0, text.stderr
    assert "epoch 0, 2 of 6 batches handed out" in text.stdout
    assert "BatchSampler(RandomSampler)" in text.stdout
    summary = json.loads(as_json.stdout)
    assert (summary["epoch"], summary["batches_handed_out"]) == (0, 2)
    assert summary["fraction_through"] == pytest.approx(2 / 6)


def test_replay_prints_the_indices_and_samples_the_run_yielded_next(
    saved: tuple[Path, list[Any]],
) -> None:
    folder, rest = saved
    result = _run(
        "replay",
        "--pipeline",
        "tests.loader.dropin_helpers:build_shuffled_loader",
        str(folder / "files"),
        "--steps",
        "1:3",
        "--json",
        "--samples",
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["key"] for row in rows] == rest[1:3]
    assert [row["sample"]["index"] for row in rows] == rest[1:3]  # the batches, collated


def test_peek_keys_changes_nothing_and_agrees_with_the_run() -> None:
    loader = build_shuffled_loader()
    iterator = iter(loader)
    next(iterator)
    torch.manual_seed(5)
    expected_draw = torch.rand(2)
    torch.manual_seed(5)
    peeked = loader.peek_keys(3)
    assert torch.equal(torch.rand(2), expected_draw)  # the global RNG is as it was
    assert peeked == [next(iterator)["index"].tolist() for _ in range(3)]
    assert loader.peek_keys(10) == [batch["index"].tolist() for batch in iterator]


def test_replay_of_a_distributed_sampler_job_serves_any_rank_from_rank_0s_checkpoint(
    tmp_path: Path,
) -> None:
    """Lightning keeps rank 0's state: replaying rank 1 from it gives rank 1's next batches."""
    from torch.utils.data import DistributedSampler

    from energy_loader.cli.replay import replay_dropin

    from .dropin_helpers import Dicts

    def make(rank: int) -> Any:
        sampler = DistributedSampler(range(40), num_replicas=2, rank=rank, seed=3)
        return el.SavableDataLoader(Dicts(40), batch_size=4, sampler=sampler)

    saving = make(0)
    iterator = iter(saving)
    next(iterator), next(iterator)
    torch.save({"loader": saving.state_dict()}, tmp_path / "checkpoint.pt")
    expected = [batch["index"].tolist() for batch in list(make(1))[2:4]]
    rows = replay_dropin(make(1), [tmp_path / "checkpoint.pt"], 1, 0, 2)
    assert [row["key"] for row in rows] == expected


def _main(command: str, *args: str) -> tuple[int, str, str]:
    """``python -m energy_loader COMMAND ARGS`` in this process: exit code, stdout, stderr."""
    (result,) = run_commands((command, *args))
    return result.returncode, result.stdout, result.stderr


def _as_lists(batch: dict[str, Any]) -> dict[str, Any]:
    return {name: value.tolist() for name, value in batch.items()}


def test_replay_samples_are_the_trained_augmentations_on_every_call(tmp_path: Path) -> None:
    """Training ran 2 worker processes, ``__getitem__`` drawing from python's, numpy's and
    torch's RNGs: the replayed batches are the ones training got after the save, twice."""
    from .dropin_helpers import Augmenting

    torch.manual_seed(0)
    loader = el.SavableDataLoader(Augmenting(23), batch_size=4, shuffle=True, num_workers=2)
    iterator = iter(loader)
    next(iterator), next(iterator)
    torch.save({"loader": loader.state_dict()}, tmp_path / "checkpoint.pt")
    trained = [_as_lists(batch) for batch in iterator]
    args = ("--pipeline", "tests.loader.dropin_helpers:build_augmenting_loader")
    for _ in range(2):
        code, out, err = _main(
            "replay",
            *args,
            str(tmp_path / "checkpoint.pt"),
            "--steps",
            "1:4",
            "--samples",
            "--json",
        )
        assert code == 0, err
        rows = [json.loads(line) for line in out.splitlines()]
        assert [row["sample"] for row in rows] == trained[1:4]
        assert [row["key"] for row in rows] == [batch["index"] for batch in trained[1:4]]


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """Two ranks of a DistributedSampler job (explicit num_replicas/rank, in this process),
    saved by rank 0 after 2 batches; each rank's batches after the save."""
    from .dropin_helpers import build_rank_loader

    folder = tmp_path_factory.mktemp("distributed")
    after = []
    for rank in range(2):
        torch.manual_seed(0)  # the same job seed on both ranks, as one script run twice
        loader = build_rank_loader(rank, 2)
        iterator = iter(loader)
        next(iterator), next(iterator)
        if rank == 0:
            torch.save({"loader": loader.state_dict()}, folder / "checkpoint.pt")
            # What dcp.save of the 2-rank job writes: every rank saves {"rank_any": JSON}
            # under "loader", DCP keeps one (tests/distributed_helpers.py writes it for real).
            import torch.distributed.checkpoint as dcp  # heavy: see tests/conftest.py's RUN_LAST

            dcp.save({"loader": loader.state_dict()}, checkpoint_id=folder / "dcp", no_dist=True)
        after.append([_as_lists(batch) for batch in iterator])
    return folder / "checkpoint.pt", after


def test_inspect_and_replay_read_a_dcp_folder(distributed_run: tuple[Path, list[Any]]) -> None:
    checkpoint, after = distributed_run
    folder = checkpoint.parent / "dcp"
    code, out, err = _main("inspect", str(folder))
    assert code == 0, err
    assert "loader rank 0:" in out and "epoch 0, 2 of 7 batches handed out" in out
    code, out, err = _main(
        "replay", "--pipeline", "tests.loader.dropin_helpers:build_rank_loader", str(folder),
        "--rank", "1", "--steps", "0:3", "--samples", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert [json.loads(line)["sample"] for line in out.splitlines()] == after[1][:3]


@pytest.mark.parametrize(
    "builder", ["build_rank_loader", "build_rank_0_loader"], ids=["rank-parameters", "rank-0"]
)
def test_replay_rank_r_replays_rank_rs_batches(
    distributed_run: tuple[Path, list[Any]], builder: str
) -> None:
    """A builder given rank/world_size builds rank R's sampler; one built for rank 0 is set
    to rank R by replay: rank 1's samples are rank 1's, not rank 0's."""
    checkpoint, after = distributed_run
    for rank in range(2):
        code, out, err = _main(
            "replay", "--pipeline", f"tests.loader.dropin_helpers:{builder}", str(checkpoint),
            "--rank", str(rank), "--steps", "0:3", "--samples", "--json",
        )  # fmt: skip
        assert code == 0, err
        assert [json.loads(line)["sample"] for line in out.splitlines()] == after[rank][:3]


def test_replay_refuses_a_rank_the_job_did_not_have_and_a_builder_needing_a_group(
    distributed_run: tuple[Path, list[Any]],
) -> None:
    checkpoint, _ = distributed_run
    code, out, err = _main(
        "replay", "--pipeline", "tests.loader.dropin_helpers:build_rank_loader", str(checkpoint),
        "--rank", "7",
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert "--rank 7: the checkpoint was saved by a job of 2 rank(s), ranks 0 to 1" in err
    code, out, err = _main(
        "replay", "--pipeline", "tests.loader.dropin_helpers:build_loader_of_the_process_group",
        str(checkpoint), "--rank", "1",
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert "needs a torch.distributed process group" in err
    assert "give the function `rank` and `world_size` parameters" in err


def test_replay_samples_of_a_loader_without_per_sample_seeds_warn(
    saved: tuple[Path, list[Any]],
) -> None:
    folder, rest = saved
    code, out, err = _main(
        "replay", "--pipeline", "tests.loader.dropin_helpers:build_unseeded_loader",
        str(folder / "checkpoint.pt"), "--steps", "0:1", "--samples", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert "seed_per_sample=False" in err and "the samples may differ" in err
    assert json.loads(out)["key"] == rest[0]


def test_inspect_shows_the_job_seed(saved: tuple[Path, list[Any]]) -> None:
    folder, _ = saved
    state = torch.load(folder / "checkpoint.pt", weights_only=True)["data"]
    seed = json.loads(next(iter(state.values())))["job"]["seed"]
    code, out, err = _main("inspect", str(folder / "checkpoint.pt"))
    assert code == 0, err
    assert f"job seed: {seed} " in out


def test_inspect_of_a_dcp_folder_without_a_loader_says_so(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp  # heavy: see tests/conftest.py's RUN_LAST

    dcp.save({"model": {"weight": torch.zeros(3)}}, checkpoint_id=tmp_path, no_dist=True)
    code, out, err = _main("inspect", str(tmp_path))
    assert (code, out) == (2, "")
    assert "a torch.distributed.checkpoint folder, but no energy_loader loader state" in err


@pytest.fixture(scope="module")
def dcp_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank gloo job (tests/distributed_helpers.py dropin_save) stopped after 3
    batches a rank, saved through ``dcp.save({"loader": loader})`` into ``dropin_dcp``."""
    from tests import distributed_helpers as dh

    workdir = tmp_path_factory.mktemp("dcp_job")
    dh.launch(dh.dropin_save, 2, workdir, timeout=90, num_workers=0, stop=3)
    return workdir


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_inspect_and_replay_read_a_dcp_checkpoint_of_a_real_2_rank_job(
    dcp_job: Path,
) -> None:
    folder = dcp_job / "dropin_dcp"
    code, out, err = _main("inspect", str(folder))
    assert code == 0, err
    assert "loader rank " in out and "epoch 0, 3 of 7 batches handed out" in out
    assert "DistributedSampler" in out and "job seed: " in out
    for rank in range(2):
        run = torch.load(dcp_job / f"dropin_run_rank{rank}.pt", weights_only=True)
        trained = [batch for _, batch in run["full"][3:6]]
        code, out, err = _main(
            "replay", "--pipeline", "tests.loader.dropin_helpers:build_rank_loader", str(folder),
            "--rank", str(rank), "--steps", "0:3", "--samples", "--json",
        )  # fmt: skip
        assert code == 0, err
        assert [json.loads(line)["sample"] for line in out.splitlines()] == trained
