"""The engine protocol: what a :class:`~energy_loader.SavableDataLoader` hands its work to.

One loader class, one engine per kind of dataset, picked once at construction:
:class:`~energy_loader.loader.pipeline_engine.PipelineEngine` (a savable pipeline, run as
logical partitions), :class:`~energy_loader.loader.dropin.map_style.MapEngine` (a map-style
dataset with torch's arguments) and :class:`~energy_loader.loader.dropin.iterable.IterableEngine`
(an iterable dataset). Every carrier of states (``restore_state_rank``, ``load_state_dict``,
gather and scatter, per-rank files, DCP, trainers) takes one path through an engine::

    decode(states) -> records     plain data in, format and version checked
    check_one_save(records, ...)  the states of one save of one job (where several meet)
    plan(records) -> plan         pure: raises for a state that does not fit, changes nothing
    apply(plan)                   the loader continues from there at the next iter()

:mod:`energy_loader.distributed` knows this protocol and nothing of the loader classes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from ..state.rank_folder import RankFolder
from ..worker import WorkerConfig


class Engine(Protocol):
    """The work behind one loader (see the module docstring)."""

    worker_config: WorkerConfig

    # -- running ---------------------------------------------------------------------------

    def iterate(self) -> Iterator[Any]:
        """What ``iter(loader)`` returns."""
        ...

    def record_skip(self, items: int) -> None:
        """Put on record (in the saved state) that the last ``items`` items handed out were
        skipped (``loader.skip``)."""
        ...

    def current_epoch(self) -> int:
        """``loader.epoch``: one rule for every engine (docs/loader.md). A method, not a
        property: a pipeline engine restored at an epoch's last item may start its workers to
        learn whether the epoch has an item left."""
        ...

    def rank_length(self) -> int:
        """``len(loader)``: items (or batches) of this rank per epoch."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def config(self) -> dict[str, Any]: ...

    def close(self) -> None:
        """Stop the workers, keeping the position."""
        ...

    def shutdown(self) -> None:
        """Stop the workers now (garbage collection, failures)."""
        ...

    def reset(self) -> None:
        """Forget all progress: the next ``iter()`` starts epoch 0."""
        ...

    # -- saving ----------------------------------------------------------------------------

    def save(self, held_back: int) -> dict[str, Any]:
        """This rank's position as plain data (``save_state_rank``)."""
        ...

    def leaves(self, held_back: int) -> dict[str, Any]:
        """This rank's position as ``state_dict()``'s leaves (one JSON string each)."""
        ...

    def leaves_of_ranks(self, states: Sequence[Any]) -> dict[str, Any]:
        """Every rank's plain state as one checkpoint of leaves for the whole job."""
        ...

    # -- restoring: decode -> check -> plan -> apply ---------------------------------------

    def decode(self, states: Sequence[Any]) -> list[Any]:
        """Plain states (one save's, some or all ranks) as records; ``StateFormatError``
        naming the entry that is not a state."""
        ...

    def decode_leaves(self, leaves: dict[str, Any]) -> list[Any] | None:
        """The records this rank restores from, out of ``state_dict()`` leaves (decoding only
        what it runs); None when ``leaves`` is a plain state instead."""
        ...

    def check_one_save(self, states: Sequence[Any], *, across: bool) -> None:
        """``StateMismatchError`` unless plain ``states`` can be the states of one save of one
        job (``across``: some will continue other ranks' samples)."""
        ...

    def saved_ranks_needed(self, first: Any, rank: int) -> list[int]:
        """The saved ranks whose states rank ``rank`` restores from, on another world size
        (``first``: the lowest saved rank's record)."""
        ...

    def read_rank_files(self, folder: RankFolder) -> list[Any]:
        """The records this rank restores from, read from a folder of per-rank files (only
        the bytes it needs)."""
        ...

    def plan(self, records: list[Any]) -> Any:
        """Check ``records`` against this engine and plan the restore; changes nothing."""
        ...

    def apply(self, plan: Any) -> None:
        """Continue from ``plan`` at the next ``iter()``."""
        ...


class EngineOwner(Protocol):
    """A loader, as :mod:`energy_loader.distributed` and the integrations see it."""

    saves_state: bool

    @property
    def engine(self) -> Engine: ...
