"""``python -m energy_loader inspect PATH``: print the loader states saved in a file or folder as
readable trees (docs/observability.md). An unreadable path is one line, exit 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..distributed import rank_state_files
from ..errors import EnergyLoaderError, StateFormatError, first_line
from ..loader.dropin.entries import is_rank_entries, states_of_entries
from ..loader.dropin.state import (
    DROPIN_STATE_FORMAT,
    describe_dropin_state,
    summarize_dropin_state,
)
from ..state.changes import describe
from ..state.checkpoint import CHECKPOINT_FORMAT, load_checkpoint
from ..state.rank_file import is_rank_file, read_rank_file
from ..state.rank_state import (
    RANK_STATE_FORMAT,
    RankState,
    is_partition_entries,
    states_from_entries,
)

_HELP = """usage: python -m energy_loader inspect PATH [--json] [--pipeline MODULE:FUNCTION]
                                       [--prefix PREFIX]

Print every loader state saved in PATH: a checkpoint file (energy_loader's own, or any
torch.save file) or a JSON file holding a rank state, the list of all ranks' states, or
the partition entries of loader.state_dict(); a folder of per-rank files
(PREFIX_rank_00000_of_00008.pt ..., what save_state_rank_file writes), all of them; or a
torch.distributed.checkpoint folder (dcp.save's, read without a process group). For
each rank it shows the layout (ranks, workers, logical partitions), the epoch and
position, the seed, where each partition stands and the pipeline; for the drop-in loader over a
plain torch dataset, the epoch, the batches handed out of the epoch's, the job seed and the
dataset and sampling it must be restored with. Nothing in the file is executed.
Exit code 2 if PATH holds no readable loader state.

  --json                      one JSON object per state found: layout, partitions, epoch,
                              items delivered, global position, per-partition positions
  --pipeline MODULE:FUNCTION  rebuild the pipeline (FUNCTION returns it, or a loader) to
                              also show how far through the epoch each rank is
  --prefix PREFIX             in a folder, the prefix the rank files were saved with
                              (default: the one prefix its rank files have)"""


def _read(path: Path) -> Any:
    if not path.is_file():
        what = "neither a file nor a folder" if path.exists() else "no such file or folder"
        raise FileNotFoundError(f"{path}: {what}")
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except ValueError as error:
            raise StateFormatError(
                f"{path}: a file of {path.stat().st_size:,} bytes named .json that is not "
                f"JSON ({first_line(error)})"
            ) from error
    if is_rank_file(path):
        return read_rank_file(path)
    try:
        record = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:
        raise StateFormatError(
            f"{path}: a file of {path.stat().st_size:,} bytes that is not a readable state "
            "file (not written by torch.save or JSON, truncated, or it holds pickled objects, "
            "which are never loaded)"
        ) from error
    if isinstance(record, dict) and record.get("format") == CHECKPOINT_FORMAT:
        return load_checkpoint(path)
    return record


def read_path(path: Path, prefix: str | None = None) -> list[tuple[str, Any]]:
    """Every loader state (plain, unchecked) in a state file, rank-file or DCP folder, and where."""
    if path.is_dir() and (path / ".metadata").is_file():
        return _states_of_dcp(path)
    if path.is_dir():
        found: list[tuple[str, Any]] = []
        for file in rank_state_files(path, prefix):
            for where, state in _states_of(file):
                found.append((file.name if where == _TOP else f"{file.name} {where}", state))
        return found
    return _states_of(path)


def _states_of(path: Path) -> list[tuple[str, Any]]:
    found = list(_find_states(_read(path)))
    if not found:
        raise StateFormatError(
            f"{path}: a readable file of {path.stat().st_size:,} bytes, but no energy_loader "
            "loader state inside"
        )
    return found


def _states_of_dcp(path: Path) -> list[tuple[str, Any]]:
    """The loader states of a ``torch.distributed.checkpoint`` folder (no process group)."""
    from ..dcp import read_loader_entries

    try:
        entries = read_loader_entries(path)
    except Exception as error:
        raise StateFormatError(
            f"{path}: a torch.distributed.checkpoint folder whose loader entries could not be "
            f"read ({type(error).__name__}: {first_line(error)})"
        ) from error
    found = list(_find_states(entries))
    if not found:
        raise StateFormatError(
            f"{path}: a torch.distributed.checkpoint folder, but no energy_loader loader state "
            "inside (the loader goes in as dcp.save({'loader': loader, ...}))"
        )
    return found


_TOP = "(top level)"


def _find_states(value: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    if is_partition_entries(value):  # what loader.state_dict() returns: partition leaves
        for state in states_from_entries(value):
            yield f"{where or _TOP} rank {state.rank}", state.to_plain()
        return
    if is_rank_entries(value):  # a drop-in loader's state_dict(): one leaf per rank
        for plain in states_of_entries(value):
            yield f"{where or _TOP} rank {plain['rank']}", plain
        return
    if isinstance(value, dict):
        if value.get("format") in (RANK_STATE_FORMAT, DROPIN_STATE_FORMAT):
            yield where or _TOP, value
            return
        for name, item in value.items():
            yield from _find_states(item, f"{where}.{name}" if where else str(name))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _find_states(item, f"{where}[{index}]")


def _position(checkpoint: dict[str, Any]) -> str:
    """The innermost stateful stage's epoch/phase and the source position."""
    node, parts = checkpoint, []
    while isinstance(node, dict):
        if "position" in node:
            parts.append(f"source position {node['position']}")
        if "indices" in node or "keys" in node:
            parts.append(f"buffer {len(node.get('indices', node.get('keys', [])))} keys")
        if "inner" not in node:
            break
        node = node["inner"]
    head = f"epoch {checkpoint.get('epoch', '?')} ({checkpoint.get('phase', '?')})"
    return ", ".join([head, *parts])


def _config_chain(config: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    node: object = config
    while isinstance(node, dict):
        fields = ", ".join(
            f"{k}={v}" for k, v in node.items() if k not in ("type", "inner", "inners")
        )
        lines.append(f"{node.get('type', '?')}({fields})")
        if "inners" in node:
            lines.append(f"  ... and {len(node['inners'])} inner pipelines")
            break
        node = node.get("inner")
    return lines


def describe_rank_state(state: Any) -> str:
    """A multi-line description of one rank state (validated first), a pipeline's or a drop-in's."""
    if state.get("format") == DROPIN_STATE_FORMAT:
        return "\n".join([describe_dropin_state(state), *history_lines(state.get("history"))])
    decoded = RankState.from_plain(state)
    per_worker = decoded.num_partitions // (decoded.world_size * max(1, decoded.num_workers))
    if decoded.epoch_ended:
        where = f"epoch {decoded.epoch} ended; the next iteration starts epoch {decoded.epoch + 1}"
    elif not decoded.in_epoch:
        where = f"epoch {decoded.epoch} not started"
    else:
        where = (
            f"epoch {decoded.epoch}, {decoded.delivered:,} items handed out by rank "
            f"{decoded.rank} in this epoch; global position "
            f"{decoded.start + decoded.world_size * decoded.delivered:,} (if the ranks ran in "
            "lockstep)"
        )
    lines = [
        f"format {RANK_STATE_FORMAT} version {state['version']}",
        f"rank {decoded.rank} of {decoded.world_size}, {decoded.num_workers} workers, "
        f"{decoded.num_partitions} logical partitions ({per_worker} per worker)",
        where,
        f"seed: {decoded.seed}",
        f"next worker: {decoded.next_worker}",
        "workers (a restore places each partition at its worker's rolling checkpoint, the newest "
        "one before the last item handed out, then replays the items after it):",
    ]
    entries = decoded.partition_states()
    for index, worker in enumerate(decoded.workers):
        status = ", done with this epoch" if worker.done else ""
        turn = f", next {worker.partitions[worker.next]}" if len(worker.partitions) > 1 else ""
        lines.append(f"  [{index}] partitions {list(worker.partitions)}{turn}{status}")
        for partition in worker.partitions:
            entry = entries[partition]
            ended = ", ended its epoch" if entry.done else ""
            proofs = (("its key", entry.last), ("its values", entry.made))
            checked = " and ".join(text for text, kept in proofs if kept)
            against = f" (the last checked against the item handed out: {checked})"
            proof = against if entry.skip and checked else ""
            lines.append(
                f"      partition {partition}: rolling checkpoint at "
                f"{_position(entry.checkpoint)}; then replay {entry.skip} items{proof}{ended}"
            )
    lines.append("pipeline (outermost first):")
    lines += [f"  {line}" for line in _config_chain(decoded.config)]
    return "\n".join(lines + history_lines(decoded.history))


def history_lines(history: Any) -> list[str]:
    """A state's history of skips and changes made on purpose, as ``inspect`` and ``replay``
    print it (nothing when it has none)."""
    if not history:
        return []
    heading = (
        "history (skipped or changed on purpose, oldest first; steps count this rank's items):"
    )
    return [heading, *(f"  {describe(entry)}" for entry in history)]


# The fields of a RankState that --json shows as they are, before global_position.
_SUMMARY_FIELDS = (
    "rank", "world_size", "num_workers", "num_partitions", "seed", "epoch", "in_epoch",
    "epoch_ended", "delivered",
)  # fmt: skip


def summarize_rank_state(state: Any, length: int | None = None) -> dict[str, Any]:
    """One rank state as a small JSON-able summary; ``length``: the rank's items per epoch."""
    if state.get("format") == DROPIN_STATE_FORMAT:
        return summarize_dropin_state(state) | {"history": state.get("history", [])}
    decoded = RankState.from_plain(state)
    summary: dict[str, Any] = {name: getattr(decoded, name) for name in _SUMMARY_FIELDS}
    summary["history"] = list(decoded.history)
    summary["global_position"] = decoded.start + decoded.world_size * decoded.delivered
    summary["next_worker"] = decoded.next_worker
    summary["workers"] = [w.to_plain() for w in decoded.workers]
    summary["partitions"] = [
        {"partition": p.partition, "position": _position(p.checkpoint)}
        | {name: getattr(p, name) for name in ("skip", "done", "last", "made")}
        for p in decoded.partitions
    ]
    if length:
        summary["epoch_length"] = length
        summary["fraction_through"] = 1.0 if decoded.epoch_ended else decoded.delivered / length
    return summary


def _rank_length(spec: str, state: dict[str, Any]) -> int | None:
    """Items per epoch of the state's rank, from the user's pipeline (None: unknown, a drop-in)."""
    from .pipelines import build_loader, load_builder

    if state.get("format") == DROPIN_STATE_FORMAT:
        return None
    loader = build_loader(load_builder(spec)(), state, int(state["rank"]), None)
    try:
        return len(loader)
    except TypeError:
        return None


def main(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(_HELP)
        return 0 if argv else 2
    as_json, pipeline, prefix, paths, rest = False, None, None, [], list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--json":
            as_json = True
        elif arg == "--pipeline" and rest:
            pipeline = rest.pop(0)
        elif arg == "--prefix" and rest:
            prefix = rest.pop(0)
        elif arg.startswith("-"):
            print(f"inspect: unknown option {arg!r}\n\n{_HELP}", file=sys.stderr)
            return 2
        else:
            paths.append(arg)
    if len(paths) != 1:
        print(_HELP)
        return 2
    path = Path(paths[0])
    try:
        found = read_path(path, prefix)
        lengths = [None if pipeline is None else _rank_length(pipeline, s) for _, s in found]
        blocks = [
            json.dumps({"where": where, **summarize_rank_state(state, length)})
            if as_json
            else f"{where}:\n{describe_rank_state(state)}{_through(state, length)}"
            for (where, state), length in zip(found, lengths)
        ]
    except Exception as error:
        print(f"inspect: {one_line(error, path)}", file=sys.stderr)
        return 2
    print("\n".join(blocks) if as_json else f"{path}\n\n" + "\n\n".join(blocks))
    return 0


def one_line(error: BaseException, path: Path | None = None) -> str:
    """``error`` as one line for a command's exit message, naming ``path`` once if given."""
    message = first_line(error)
    if not isinstance(error, (EnergyLoaderError, FileNotFoundError)):
        message = f"{type(error).__name__}: {message}"
    return message if path is None or str(path) in message else f"{path}: {message}"


def _through(state: dict[str, Any], length: int | None) -> str:
    if not length or state.get("format") == DROPIN_STATE_FORMAT:
        return ""
    fraction = summarize_rank_state(state, length)["fraction_through"]
    return f"\n{100 * fraction:.1f}% through epoch {state['epoch']} ({length:,} items per rank)"
