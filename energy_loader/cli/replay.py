"""``python -m energy_loader replay``: the restore keys (or samples) of any steps of a saved job,
made in this process from the saved states (docs/observability.md, "replay").
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..distributed import rank_state_files, read_rank_state_files
from ..errors import StateFormatError, StateMismatchError, first_line
from ..loader.dropin.build import runs_dropin
from ..loader.dropin.map_style import index_sampler_of
from ..loader.dropin.restore import DropInRestore
from ..loader.dropin.state import DROPIN_STATE_FORMAT
from ..loader.dropin.stream import distributed_part
from ..loader.savable_loader import SavableDataLoader
from ..state.rank_file import read_rank_file
from ..state.rank_state import RankState
from .inspect import history_lines, one_line, read_path
from .pipelines import build_loader, check_rank, load_builder

_HELP = """Print the restore keys (or samples) of steps A to B of one rank of a saved job.

Step 0 is the first item the rank yields after the saved position. The pipeline is rebuilt
by calling FUNCTION from MODULE: with rank=R and world_size=W (the --rank asked and the saved
job's number of ranks) if it has parameters of those names, else with no arguments; it returns
the pipeline (a SavableDataset) or a SavableDataLoader. No process group is made: a drop-in
loader's DistributedSampler should be built as DistributedSampler(dataset,
num_replicas=world_size, rank=rank); one built for another rank is set to rank R of W. --rank
must be a rank of the saved job. For a SavableDataLoader over a plain torch dataset (the
drop-in), the keys are the dataset indices of each batch, up to the end of the saved epoch,
and --samples makes each batch as the workers made it (the same per-sample seeds, so random
augmentation in __getitem__ is the trained one, and the collate_fn). The state is restored and
only the items up to step B are made, in this process; nothing is iterated from the start of
the epoch. The result equals what the training run yielded (or will yield) after saving."""

_EPILOG = """examples:
  python -m energy_loader replay --pipeline train:build_pipeline ckpt/step-500.pt
  python -m energy_loader replay --pipeline train:build_pipeline ckpt/loader-states/ --rank 3
  python -m energy_loader replay --pipeline train:build_pipeline states.json --rank 1 \\
      --steps 10:20 --samples --json"""


def _is_dcp(path: Path) -> bool:
    return (path / ".metadata").is_file()


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` (B excluded), ``":B"`` (from 0) or ``"A"`` (just step A) as ``(A, B)``."""
    try:
        if ":" in text:
            first, last = text.split(":", 1)
            start, stop = int(first or 0), int(last)
        else:
            start = int(text)
            stop = start + 1
    except ValueError:
        raise ValueError(f"--steps must look like A:B, :B or A (got {text!r})") from None
    if start < 0 or stop <= start:
        raise ValueError(f"--steps needs 0 <= A < B (got {text!r})")
    return start, stop


def read_states(paths: list[Path]) -> list[dict[str, Any]]:
    """Every rank state in the state files or DCP folders ``paths``, one per rank."""
    by_rank: dict[int, dict[str, Any]] = {}
    for path in paths:
        if path.is_dir() and not _is_dcp(path):
            raise ValueError(
                f"{path} is a folder: give a folder of per-rank files alone, or state files only"
            )
        for _, state in read_path(path):
            by_rank.setdefault(int(state["rank"]), state)
    return [by_rank[rank] for rank in sorted(by_rank)]


def loader_and_states(
    built: Any, paths: list[Path], rank: int, seed: int | None, prefix: str | None = None
) -> tuple[Any, list[RankState]]:
    """The replay loader for ``rank`` and the saved states in ``paths`` it restores from."""
    if len(paths) == 1 and paths[0].is_dir() and not _is_dcp(paths[0]):
        files = rank_state_files(paths[0], prefix)
        check_rank(rank, len(files))
        loader = build_loader(built, read_rank_file(files[rank]), rank, seed)
        return loader, read_rank_state_files(loader, paths[0], prefix)
    states = read_states(paths)
    loader = build_loader(built, states[0], rank, seed)
    return loader, [RankState.from_plain(state) for state in states]


def replay(
    loader: Any,
    states: list[dict[str, Any]] | list[RankState],
    start: int,
    stop: int,
    *,
    samples: bool = False,
) -> list[dict[str, Any]]:
    """Steps ``start`` to ``stop`` (excluded) after the saved ``states``: key, and sample."""
    from ..loader.peek import future_items
    from ..rng import kept_rng_state

    decoded = [s if isinstance(s, RankState) else RankState.from_plain(s) for s in states]
    with kept_rng_state():
        items = future_items(loader.planner, loader.checkpoint_settings, decoded)
        window = itertools.islice(items, start, stop)
        rows = [{"step": step, "key": key} for step, (key, _) in enumerate(window, start)]
        if samples:
            for row in rows:
                row["sample"] = loader.restore_sample(row["key"])
    return rows


def saved_world_size(state: dict[str, Any]) -> int:
    """The number of ranks of the job that saved ``state`` (a drop-in's: its ``num_replicas``)."""
    if state.get("format") == DROPIN_STATE_FORMAT:
        config = state.get("config")
        if isinstance(config, dict) and isinstance(config.get("num_replicas"), int):
            return int(config["num_replicas"])
    return int(state["world_size"])


def _saved_job_size(paths: list[Path], prefix: str | None) -> int:
    """The saved job's number of ranks: a folder's count of rank files, else the first state's."""
    if len(paths) == 1 and paths[0].is_dir() and not _is_dcp(paths[0]):
        return len(rank_state_files(paths[0], prefix))
    return saved_world_size(read_path(paths[0], prefix)[0][1])


def call_builder(spec: str, rank: int, world_size: int) -> Any:
    """Call the ``--pipeline`` function, with ``rank=`` and ``world_size=`` if it takes them."""
    function: Callable[..., Any] = load_builder(spec)
    try:
        parameters: Mapping[str, Any] = inspect.signature(function).parameters
    except (TypeError, ValueError):
        parameters = {}
    takes_layout = "rank" in parameters and "world_size" in parameters
    try:
        return function(rank=rank, world_size=world_size) if takes_layout else function()
    except (RuntimeError, ValueError) as error:
        if "process group" not in str(error) or takes_layout:
            raise
        raise ValueError(
            f"{spec} needs a torch.distributed process group ({first_line(error)}); replay runs "
            "without one: give the function `rank` and `world_size` parameters (replay passes "
            "the rank asked and the saved job's world size) and build "
            "DistributedSampler(dataset, num_replicas=world_size, rank=rank)"
        ) from error


def dropin_state_for(
    loader: SavableDataLoader, paths: list[Path], rank: int, prefix: str | None = None
) -> dict[str, Any]:
    """The saved drop-in state ``rank`` replays from, ``loader``'s sampler set to ``rank``."""
    engine = loader.engine
    if not isinstance(engine, DropInRestore):
        raise TypeError("dropin_state_for needs a loader over a plain dataset (a drop-in)")
    found = [state for path in paths for _, state in read_path(path, prefix)]
    states = {int(s["rank"]): s for s in found if s.get("format") == DROPIN_STATE_FORMAT}
    if not states:
        raise StateFormatError(
            "no drop-in loader state in the files given, but the --pipeline function returned "
            "a drop-in loader (over a plain dataset)"
        )
    world_size = saved_world_size(next(iter(states.values())))
    check_rank(rank, world_size)
    state = states.get(rank)
    if state is None:  # a DistributedSampler job's state serves every rank
        state = next(iter(states.values()))
        if not engine.restores_any_rank(state):
            raise ValueError(
                f"--rank {rank}: the files hold the states of ranks {sorted(states)} only"
            )
    sampler = distributed_part(index_sampler_of(loader))
    if engine.restores_any_rank(state):
        if sampler is None:
            raise StateMismatchError(
                "the state was saved under a DistributedSampler; the --pipeline function's "
                "loader has none: build it as training did"
            )
        if (sampler.num_replicas, sampler.rank) != (world_size, rank):
            loader.set_distributed_rank(rank, world_size)
    return state


def replay_dropin(
    loader: SavableDataLoader,
    paths: list[Path],
    rank: int,
    start: int,
    stop: int,
    prefix: str | None = None,
    *,
    samples: bool = False,
) -> list[dict[str, Any]]:
    """Steps ``start`` to ``stop`` after a drop-in's saved position: batch indices (and batches)."""
    state = dropin_state_for(loader, paths, rank, prefix)
    if samples:
        made = loader.peek_batches(stop, state)
        return [
            {"step": step, "key": unit, "sample": batch}
            for step, (unit, batch) in enumerate(made)
            if step >= start
        ]
    units = loader.peek_keys(stop, state)
    return [{"step": step, "key": unit} for step, unit in enumerate(units) if step >= start]


def _plain(value: Any) -> Any:
    """Samples as JSON: tensors and arrays as nested lists, bytes as their length."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    return repr(value)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m energy_loader replay",
        description=_HELP,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--pipeline", required=True, metavar="MODULE:FUNCTION", help="builds the pipeline"
    )
    parser.add_argument(
        "checkpoint",
        nargs="+",
        type=Path,
        metavar="CHECKPOINT",
        help="a checkpoint file, a per-rank file (several may be given), a JSON of all "
        "ranks' states, a folder of per-rank files (save_state_rank_file's), alone, or a "
        "torch.distributed.checkpoint folder (read without a process group)",
    )
    parser.add_argument(
        "--prefix",
        help="in a folder, the prefix the rank files were saved with (default: the one "
        "prefix its rank files have)",
    )
    parser.add_argument("--rank", type=int, default=0, help="the rank to replay (default 0)")
    parser.add_argument(
        "--steps", default="0:10", help="A:B, steps A to B-1 after the save (default 0:10)"
    )
    parser.add_argument("--samples", action="store_true", help="print the samples too")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--seed",
        type=int,
        help="the job's WorkerConfig seed, when FUNCTION returns a pipeline (default 0)",
    )
    args = parser.parse_args(argv)
    try:
        start, stop = parse_steps(args.steps)
        for path in args.checkpoint:
            if not path.exists():
                raise FileNotFoundError(f"{path}: no such file or folder")
        world_size = _saved_job_size(args.checkpoint, args.prefix)
        check_rank(args.rank, world_size)
        built = call_builder(args.pipeline, args.rank, world_size)
        if runs_dropin(built):
            if args.samples and not built.seed_per_sample:
                print(
                    "replay: the loader has seed_per_sample=False, so random numbers drawn in "
                    "__getitem__ were not seeded in training: the samples may differ",
                    file=sys.stderr,
                )
            rows = replay_dropin(
                built, args.checkpoint, args.rank, start, stop, args.prefix, samples=args.samples
            )
        else:
            loader, states = loader_and_states(
                built, args.checkpoint, args.rank, args.seed, args.prefix
            )
            rows = replay(loader, states, start, stop, samples=args.samples)
        saved = [state for path in args.checkpoint for _, state in read_path(path, args.prefix)]
        own = [state for state in saved if state.get("rank") == args.rank] or saved
    except Exception as error:
        print(f"replay: {one_line(error)}", file=sys.stderr)
        return 2
    if not args.json:  # what was skipped or changed before the save (inspect --json has it)
        for line in history_lines(own[0].get("history")):
            print(line)
    for row in rows:
        if args.json:
            print(json.dumps(row, default=_plain))
        elif args.samples:
            print(f"step {row['step']}: {row['key']}\n  {row['sample']!r}")
        else:
            print(f"step {row['step']}: {row['key']}")
    if len(rows) < stop - start:
        print(f"replay: the pipeline ended after {len(rows)} of the steps asked", file=sys.stderr)
    return 0
