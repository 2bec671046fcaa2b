"""What crosses the process boundary between the loader and its workers, as named types.

The main process hands each worker a :class:`RunPlan` (which partitions it runs, from which
states) and :class:`CheckpointSettings` (when it snapshots) with the dataset torch pickles into
the worker; each worker answers with a :class:`WorkerItem` per item it makes plus an end
marker per epoch, in bundles (:mod:`energy_loader.workers.bundling`). Nothing here runs.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import attrs

from ..state.rank_state import PartitionState, WorkerSlots

if TYPE_CHECKING:
    from ..dataset import SavableDataset
    from ..transport import WorkerTransport
    from ..worker import WorkerConfig

__all__ = ["FAILED_SLOT", "CheckpointSettings", "RunPlan", "RunnerOwner", "WorkerItem"]

# The slot of a failure item: its sample is the ExceptionWrapper of the pipeline's error.
FAILED_SLOT = -2
# The slot of an end marker: the worker ended its epoch.
END_SLOT = -1


@attrs.frozen
class CheckpointSettings:
    """When workers checkpoint, and how many items may be in flight per worker."""

    every_n: int
    every_sec: float | None
    capacity: int
    in_flight: int
    gc_every_n: int | None
    gc_freeze: bool


class WorkerItem(NamedTuple):
    """One item travelling from a worker to the main process.

    ``worker`` is the logical worker that made it and ``number`` counts the worker's items
    over its life; ``is_end`` marks the end of the worker's epoch (``sample`` is then ``None`` and
    ``slot`` is :data:`END_SLOT`); otherwise ``slot`` is the worker's slot (partition) that made
    it, or :data:`FAILED_SLOT` when ``sample`` is the pipeline's exception. ``snapshots`` are
    the worker's snapshots taken since its previous item, ``((index, Snapshot), ...)`` or
    ``None``. ``made`` is the digest of the sample's values as the worker made it
    (:func:`~energy_loader.state.digests.content_digest`, part of the proof a save records),
    ``None`` where the loader does not check its restores.
    """

    worker: int
    number: int
    is_end: bool
    sample: Any
    slot: int
    snapshots: Any
    made: str | None = None


@attrs.frozen
class RunPlan:
    """What the workers of one rank run: partitions per logical worker, and restores.

    ``workers[w]`` lists the partitions logical worker ``w`` runs, whose turn is next and
    whether it already ended the current epoch; ``restores`` maps a partition to the state it
    continues from (``None``: every partition starts fresh). ``verify``: whether a restored
    partition checks its proof (the last item it replays is the one the saving loader handed
    out, with the same values), and whether the items' values are digested for the proof of
    a later save; the loader's ``verify_restore``.
    """

    num_partitions: int
    workers: tuple[WorkerSlots, ...]
    restores: dict[int, PartitionState] | None = None
    verify: bool = True


class RunnerOwner(Protocol):
    """What a :class:`~energy_loader.workers.runner.Runner` reads of the dataset torch's
    workers iterate (:class:`~energy_loader.workers.side.WorkerSideDataset`)."""

    pipeline: SavableDataset
    config: WorkerConfig
    settings: CheckpointSettings
    plan: RunPlan
    offset: int
    savable: bool
    channels: list[Connection] | None
    transport: WorkerTransport | None
