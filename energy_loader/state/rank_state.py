"""The saved state of one rank's loader: attrs classes and their plain-data codec.

Layout (format version 1)::

    {
      "format": "energy_loader.rank_state",
      "version": 1,
      "rank": 0, "world_size": 1, "num_workers": 2,
      "config": {...},            # the pipeline's config(), for mismatch messages
      "epoch_ended": false,       # the loader reported the end of the current epoch
      "next_worker": 1,           # the worker whose sample the user receives next
      "workers": [                # one per worker (one entry when num_workers == 0)
        {"checkpoint": {...},     # pipeline state at one of the worker's rolling checkpoints
         "skip": 3,               # samples to replay from it without yielding them
         "done": false},          # this worker already ended the current epoch
        ...
      ]
    }

Everything is plain data: ``json.dumps`` and ``torch.load(weights_only=True)`` accept it. Any
change to this shape bumps :data:`RANK_STATE_VERSION` and is a breaking changelog entry.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..errors import StateFormatError
from .plain import StateReader, check_plain

__all__ = ["RANK_STATE_FORMAT", "RANK_STATE_VERSION", "RankState", "WorkerState"]

RANK_STATE_FORMAT = "energy_loader.rank_state"
RANK_STATE_VERSION = 1


@attrs.frozen
class WorkerState:
    """Where one worker stands: a pipeline checkpoint plus samples to replay from it."""

    checkpoint: dict[str, Any]
    skip: int = 0
    done: bool = False

    def to_plain(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "skip": self.skip, "done": self.done}

    @classmethod
    def from_reader(cls, reader: StateReader) -> WorkerState:
        checkpoint = reader.raw("checkpoint")
        StateReader(checkpoint, f"{reader.path}.checkpoint")
        return cls(checkpoint=checkpoint, skip=reader.int("skip"), done=reader.bool("done"))


@attrs.frozen
class RankState:
    """The whole saved state of one rank's :class:`~energy_loader.SavableDataLoader`."""

    rank: int
    world_size: int
    num_workers: int
    config: dict[str, Any]
    epoch_ended: bool
    next_worker: int
    workers: tuple[WorkerState, ...]

    def to_plain(self) -> dict[str, Any]:
        """The state as plain data with its format name and version."""
        return {
            "format": RANK_STATE_FORMAT,
            "version": RANK_STATE_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "config": self.config,
            "epoch_ended": self.epoch_ended,
            "next_worker": self.next_worker,
            "workers": [w.to_plain() for w in self.workers],
        }

    @classmethod
    def from_plain(cls, data: Any) -> RankState:
        """Decode and validate; raises ``StateFormatError`` naming the first bad field."""
        reader = StateReader(data, "state")
        if reader.has("format") and reader.raw("format") != RANK_STATE_FORMAT:
            raise StateFormatError(
                f"state.format is {reader.raw('format')!r}; expected {RANK_STATE_FORMAT!r} "
                "(is this a loader state from energy_loader.save_state_rank()?)"
            )
        if not reader.has("format"):
            raise StateFormatError(
                "state has no 'format' field: not a loader state from "
                "SavableDataLoader.save_state_rank()"
            )
        version = reader.int("version")
        if version != RANK_STATE_VERSION:
            raise StateFormatError(
                f"state.version is {version}; this energy_loader reads version "
                f"{RANK_STATE_VERSION} (a state from a newer or older release?)"
            )
        num_workers = reader.int("num_workers")
        world_size = reader.int("world_size", minimum=1)
        rank = reader.int("rank")
        if rank >= world_size:
            raise StateFormatError(f"state.rank {rank} is not below state.world_size {world_size}")
        workers = [
            WorkerState.from_reader(StateReader(w, f"state.workers[{i}]"))
            for i, w in enumerate(reader.list("workers"))
        ]
        if len(workers) != max(1, num_workers):
            raise StateFormatError(
                f"state.workers has {len(workers)} entries; num_workers={num_workers} needs "
                f"{max(1, num_workers)}"
            )
        next_worker = reader.int("next_worker")
        if next_worker >= len(workers):
            raise StateFormatError(
                f"state.next_worker {next_worker} is not below the {len(workers)} workers"
            )
        config = reader.raw("config")
        StateReader(config, "state.config")
        check_plain(data, "state")
        return cls(
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            config=config,
            epoch_ended=reader.bool("epoch_ended"),
            next_worker=next_worker,
            workers=tuple(workers),
        )
