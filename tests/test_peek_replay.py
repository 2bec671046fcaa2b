"""peek_keys and ``replay`` agree exactly with what real runs yield after a save.

Two ranks are simulated in one process (explicit ``WorkerConfig(rank=r, world_size=2)``), with
0 and 2 real worker processes each. The run saves every rank's state at step ``SAVE`` and
records what each rank yields for ``AFTER`` more steps (across the end of the epoch).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.cli.pipelines import build_loader
from energy_loader.cli.replay import loader_and_states, parse_steps, replay

from .helpers import run_commands
from .observe_pipelines import LENGTH, build

SAVE, AFTER, SEED, RANKS = 7, 24, 5, 2


def _plain(key: Any) -> Any:
    return json.loads(json.dumps(key))


def _loaders(workers: int) -> list[el.SavableDataLoader]:
    return [
        el.SavableDataLoader(
            build(),
            worker_config=el.WorkerConfig(
                rank=rank, world_size=RANKS, num_workers=workers, seed=SEED
            ),
            checkpoint_every_n_samples=3,
        )
        for rank in range(RANKS)
    ]


def _take(loader: el.SavableDataLoader, iterator: Any, count: int) -> tuple[list[Any], Any]:
    """``count`` keys, starting the next epoch when one ends (as a training loop would)."""
    keys = []
    while len(keys) < count:
        try:
            keys.append(el.restore_key_of(next(iterator)))
        except StopIteration:
            iterator = iter(loader)
    return keys, iterator


@pytest.fixture(scope="module", params=[0, 2], ids=["0-workers", "2-workers"])
def saved_run(request, tmp_path_factory):
    """States saved at step SAVE of a 2-rank run, the AFTER keys each rank yielded next."""
    workers = request.param
    out = tmp_path_factory.mktemp(f"run{workers}")
    with _logging_to(out / "log"):
        loaders = _loaders(workers)
    iterators = [iter(loader) for loader in loaders]
    for rank, loader in enumerate(loaders):
        _, iterators[rank] = _take(loader, iterators[rank], SAVE)
    states = [loader.save_state_rank() for loader in loaders]
    for loader in loaders:  # the same position, as per-rank files in one folder
        el.save_state_rank_file(loader, out / "ranks")
    # ... and as the DCP folder the 2 ranks write: each its own slot leaves under "loader"
    merged = {key: leaf for loader in loaders for key, leaf in loader.state_dict().items()}
    import torch.distributed.checkpoint as dcp  # heavy: see tests/conftest.py's RUN_LAST

    dcp.save({"loader": merged}, checkpoint_id=out / "dcp", no_dist=True)
    streams = []
    for rank, loader in enumerate(loaders):
        keys, _ = _take(loader, iterators[rank], AFTER)
        streams.append([_plain(k) for k in keys])
        loader._shutdown_workers()
    path = out / "states.json"
    path.write_text(json.dumps(states))
    logged: dict[str, list[Any]] = {}  # per partition file, each key once, in logged order
    for file in sorted((out / "log").glob("*.jsonl")):
        keys = logged.setdefault(file.name, [])
        for line in file.read_text().splitlines():
            key = json.loads(line)["key"]
            if key not in keys:
                keys.append(key)
    return workers, states, streams, path, out / "log", logged, out / "ranks"


# The commands on the 2-worker run: slow (a fresh interpreter each, ~4 s on 2 cores). They
# run here on the 0-worker run, and the functions they call replay and inspect the 2-worker
# run's states, files and DCP folder in process (the tests without a command line).
COMMANDS_ON_EACH_RUN = pytest.mark.parametrize(
    "saved_run",
    [0, pytest.param(2, marks=pytest.mark.slow)],
    indirect=True,
    ids=["0-workers", "2-workers"],
)


def _dcp_folder(saved_run: Any) -> Path:
    return saved_run[6].parent / "dcp"


@contextlib.contextmanager
def _logging_to(log_dir: Path) -> Iterator[None]:
    """build() wraps the pipeline in LogSampleDataset(log_dir=log_dir) inside this block."""
    os.environ["ENERGY_LOADER_TEST_LOG_DIR"] = str(log_dir)
    try:
        yield
    finally:
        del os.environ["ENERGY_LOADER_TEST_LOG_DIR"]


def _replay_loader(saved_run: Any, rank: int) -> el.SavableDataLoader:
    """A loader over the same (logged) pipeline as the run, for replay."""
    with _logging_to(saved_run[4]):
        return build_loader(build(), saved_run[1][0], rank, SEED)


@given(rank=st.integers(0, RANKS - 1), start=st.integers(0, AFTER - 1), size=st.integers(1, 8))
def test_replay_equals_the_run_for_any_window(saved_run, rank: int, start: int, size: int):
    _, states, streams, _, _, _, _ = saved_run
    stop = min(AFTER, start + size)
    loader = _replay_loader(saved_run, rank)
    rows = replay(loader, states, start, stop)
    assert [r["step"] for r in rows] == list(range(start, stop))
    assert [_plain(r["key"]) for r in rows] == streams[rank][start:stop]


def test_restore_state_global_on_each_rank_yields_the_same(saved_run) -> None:
    workers, states, streams, _, log_dir, _, _ = saved_run
    with _logging_to(log_dir):
        loaders = _loaders(workers)
    for rank, loader in enumerate(loaders):
        loader.restore_state_global(states)
        keys, _ = _take(loader, iter(loader), AFTER)
        assert [_plain(k) for k in keys] == streams[rank]
        loader._shutdown_workers()


def test_replay_agrees_with_the_sample_log(saved_run) -> None:
    # The log holds what the partitions produced, in each partition's order: every replayed
    # batch is there, and within a partition the replayed ones come in logged order.
    _, states, streams, _, _, logged, _ = saved_run
    for rank in range(RANKS):
        loader = _replay_loader(saved_run, rank)
        replayed = [_plain(r["key"]) for r in replay(loader, states, 0, AFTER)]
        assert replayed == streams[rank]
        for keys in logged.values():
            mine = [k for k in replayed if k in keys]
            positions = [keys.index(k) for k in mine]
            assert positions == sorted(positions)
        assert all(any(k in keys for keys in logged.values()) for k in replayed)


@COMMANDS_ON_EACH_RUN
def test_replay_command_line(saved_run) -> None:
    _, states, streams, path, log_dir, _, _ = saved_run
    pipeline = ("--pipeline", "tests.observe_pipelines:build")
    result, text, inspect = run_commands(
        ("replay", *pipeline, str(path), "--rank", "1", "--steps", "3:9", "--json",
         "--seed", str(SEED), "--samples"),
        ("replay", *pipeline, str(path), "--steps", "2", "--seed", str(SEED)),
        ("inspect", str(path), "--json", *pipeline),
        ENERGY_LOADER_TEST_LOG_DIR=str(log_dir),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["key"] for r in rows] == streams[1][3:9]
    assert all("sample" in r for r in rows)
    assert text.returncode == 0 and text.stdout.startswith("step 2: ")
    assert inspect.returncode == 0, inspect.stderr
    summaries = [json.loads(line) for line in inspect.stdout.splitlines()]
    assert [s["rank"] for s in summaries] == [0, 1]
    per_rank = LENGTH // RANKS // 3
    assert summaries[0]["epoch_length"] == per_rank
    assert summaries[0]["fraction_through"] == pytest.approx(SAVE / per_rank)
    assert summaries[1]["global_position"] == states[1]["start"] + RANKS * SAVE
    assert {"partition", "position", "skip", "done"} <= set(summaries[0]["partitions"][0])


def _command(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    (result,) = run_commands(args, ENERGY_LOADER_TEST_LOG_DIR=str(log_dir))
    return result


@COMMANDS_ON_EACH_RUN
def test_replay_on_a_folder_of_rank_files_reads_only_the_rank_it_replays(saved_run) -> None:
    _, _, streams, _, log_dir, _, folder = saved_run
    for rank in range(RANKS):
        with _logging_to(log_dir):
            loader, states = loader_and_states(build(), [folder], rank, SEED)
        assert [s.rank for s in states] == [rank]
        assert [_plain(r["key"]) for r in replay(loader, states, 0, AFTER)] == streams[rank]
    result = _command(
        "replay", "--pipeline", "tests.observe_pipelines:build", str(folder),
        "--rank", "1", "--steps", "3:9", "--json", "--seed", str(SEED), log_dir=log_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["key"] for line in result.stdout.splitlines()] == streams[1][3:9]


@COMMANDS_ON_EACH_RUN
def test_inspect_on_a_folder_of_rank_files_shows_every_rank(saved_run) -> None:
    _, states, _, _, log_dir, _, folder = saved_run
    result, text = run_commands(
        ("inspect", str(folder), "--json"),
        ("inspect", str(folder)),
        ENERGY_LOADER_TEST_LOG_DIR=str(log_dir),
    )
    assert result.returncode == 0, result.stderr
    summaries = [json.loads(line) for line in result.stdout.splitlines()]
    assert [s["where"] for s in summaries] == [
        "loader_rank_00000_of_00002.pt",
        "loader_rank_00001_of_00002.pt",
    ]
    assert [s["rank"] for s in summaries] == [0, 1]
    assert [s["delivered"] for s in summaries] == [SAVE, SAVE]
    assert [s["epoch"] for s in summaries] == [s["epoch"] for s in states]
    assert text.returncode == 0, text.stderr
    assert "loader_rank_00001_of_00002.pt:\nformat energy_loader.rank_state" in text.stdout
    assert "rank 1 of 2," in text.stdout


def test_inspect_and_replay_read_a_dcp_folder_without_a_process_group(saved_run) -> None:
    from energy_loader.cli.inspect import read_path, summarize_rank_state

    _, states, streams, _, log_dir, _, _ = saved_run
    folder = _dcp_folder(saved_run)
    summaries = [summarize_rank_state(state) for _, state in read_path(folder)]
    assert [s["rank"] for s in summaries] == [0, 1]
    assert [s["delivered"] for s in summaries] == [SAVE, SAVE]
    assert [s["epoch"] for s in summaries] == [s["epoch"] for s in states]
    for rank in range(RANKS):
        with _logging_to(log_dir):
            loader, read = loader_and_states(build(), [folder], rank, SEED)
        assert [_plain(r["key"]) for r in replay(loader, read, 0, AFTER)] == streams[rank]


def test_a_folder_without_rank_files_is_one_line_naming_the_files_expected(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("not a state")
    for result in run_commands(
        ("inspect", str(tmp_path)),
        ("replay", "--pipeline", "tests.observe_pipelines:build", str(tmp_path)),
        ENERGY_LOADER_TEST_LOG_DIR=str(tmp_path / "log"),
    ):
        assert result.returncode == 2
        (line,) = result.stderr.strip().splitlines()
        assert f"{tmp_path} is a folder without per-rank state files" in line
        assert "PREFIX_rank_NNNNN_of_NNNNN.pt" in line and "notes.txt" in line


@pytest.mark.parametrize("workers", [0, 2])
def test_peek_keys_then_iteration_and_a_restore_yield_those_keys(workers: int) -> None:
    loader = el.SavableDataLoader(build(), num_workers=workers, checkpoint_every_n_samples=2)
    iterator = iter(loader)
    for taken in (0, 5, 13):
        _, iterator = _take(loader, iterator, taken)
        random.seed(3)
        peeked = loader.peek_keys(25)  # 25 > the 40 - 18 left: runs into the next epoch
        assert random.random() == random.Random(3).random()  # global RNG untouched
        state = loader.save_state_rank()
        keys, iterator = _take(loader, iterator, 25)
        assert keys == peeked
        fresh = el.SavableDataLoader(build(), num_workers=workers, checkpoint_every_n_samples=2)
        fresh.restore_state_rank(state)
        assert _take(fresh, iter(fresh), 25)[0] == peeked
        fresh._shutdown_workers()
    loader._shutdown_workers()


def test_bad_arguments() -> None:
    loader = el.SavableDataLoader(build())
    assert loader.peek_keys(0) == []
    with pytest.raises(ValueError, match="`n`"):
        loader.peek_keys(-1)
    with pytest.raises(TypeError, match="SavableDataLoader"):
        el.BasicDataLoader(build()).peek_keys(2)
    assert parse_steps("3:7") == (3, 7) and parse_steps("4") == (4, 5)
    for bad in ("7:3", "x", "-1:2"):
        with pytest.raises(ValueError, match="--steps"):
            parse_steps(bad)
    with pytest.raises(ValueError, match="--rank"):
        build_loader(build(), loader.save_state_rank(), 3, None)
    with pytest.raises(TypeError, match="SavableDataset"):
        build_loader(42, loader.save_state_rank(), 0, None)
