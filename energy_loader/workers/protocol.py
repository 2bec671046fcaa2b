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

    ``slot``: the partition that made it, :data:`END_SLOT` at the epoch's end (``sample`` None) or
    :data:`FAILED_SLOT` (``sample``: the exception). ``snapshots``: those taken since the previous
    item, or None; ``made``: the values' digest, None unchecked.
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
    """What the workers of one rank run: partitions per logical worker, and ``restores`` (None: all
    fresh). ``verify`` (``verify_restore``): check restores and digest items for proofs."""

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
