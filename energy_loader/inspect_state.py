"""``python -m energy_loader inspect PATH``: print a saved loader state as a readable tree.

Reads a checkpoint file written by :func:`energy_loader.state.save_checkpoint` (or a
:class:`~energy_loader.state.CheckpointDirectory`), a ``torch.save`` file, or a JSON file, and
prints every loader state found inside (a rank state, the list ``save_state_global`` returns,
or the partition leaves of ``loader.state_dict()``): format version, layout and partitions,
epoch and position, each partition's position, and the pipeline config. Anything unreadable
is a one-line error and exit code 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import StateFormatError
from .state.checkpoint import CHECKPOINT_FORMAT, load_checkpoint
from .state.rank_state import (
    PARTITION_KEY_PREFIX,
    RANK_STATE_FORMAT,
    RankState,
    states_from_entries,
)

__all__ = ["describe_rank_state", "main"]

_HELP = """usage: python -m energy_loader inspect PATH

Print every loader state saved in PATH: a checkpoint file (energy_loader's own, or any
torch.save file) or a JSON file holding a rank state, the list of all ranks' states, or
the partition entries of loader.state_dict(). For each rank it shows the layout (ranks,
workers, logical partitions), the epoch and position, where each partition stands and
the pipeline. Nothing in the file is executed. Exit code 2 if the file holds no
readable loader state."""


def _read(path: Path) -> Any:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    try:
        record = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise
    except Exception as error:
        raise StateFormatError(
            "not a readable state file (not written by torch.save or JSON, truncated, or it "
            "holds pickled objects, which are never loaded)"
        ) from error
    if isinstance(record, dict) and record.get("format") == CHECKPOINT_FORMAT:
        return load_checkpoint(path)
    return record


def _find_states(value: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    if (
        isinstance(value, dict)
        and value
        and all(isinstance(k, str) and k.startswith(PARTITION_KEY_PREFIX) for k in value)
    ):  # what loader.state_dict() returns: partition leaves
        for state in states_from_entries(value):
            yield f"{where or '(top level)'} rank {state.rank}", state.to_plain()
        return
    if isinstance(value, dict):
        if value.get("format") == RANK_STATE_FORMAT:
            yield where or "(top level)", value
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
    """A multi-line description of one rank state (validated first)."""
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
        f"next worker: {decoded.next_worker}",
        "workers:",
    ]
    entries = decoded.partition_states()
    for index, worker in enumerate(decoded.workers):
        status = ", done with this epoch" if worker.done else ""
        turn = f", next {worker.partitions[worker.next]}" if len(worker.partitions) > 1 else ""
        lines.append(f"  [{index}] partitions {list(worker.partitions)}{turn}{status}")
        for partition in worker.partitions:
            entry = entries[partition]
            ended = ", ended its epoch" if entry.done else ""
            lines.append(
                f"      partition {partition}: {_position(entry.checkpoint)}; replay "
                f"{entry.skip} items{ended}"
            )
    lines.append("pipeline (outermost first):")
    lines += [f"  {line}" for line in _config_chain(decoded.config)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(_HELP)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    path = Path(argv[0])
    try:
        found = list(_find_states(_read(path)))
        if not found:
            raise StateFormatError("no energy_loader loader state inside")
        blocks = [f"{where}:\n{describe_rank_state(state)}" for where, state in found]
    except FileNotFoundError:
        print(f"inspect: {path}: no such file", file=sys.stderr)
        return 2
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"inspect: {path}: {type(error).__name__}: {message}", file=sys.stderr)
        return 2
    print(f"{path}\n\n" + "\n\n".join(blocks))
    return 0
