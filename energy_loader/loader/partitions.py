"""Logical partitions: a job's data stream that does not depend on its ranks and workers.

A loader runs its pipeline as ``P`` independent *logical partitions*. Partition ``p`` is one
copy of the pipeline whose context reports shard ``p`` of ``P``: its sources read slice ``p``,
its random components seed from ``p``, and its per-sample seeds and restore keys are the same
whichever rank or worker runs it. The job's stream is::

    G[k] = item k // P of partition k % P          (while every partition has items)

and at step ``s`` rank ``r`` of ``R`` receives ``G[B + s * R + r]``, where ``B`` is the global
position the current run started from (0 at the start of every epoch). Torch hands a rank's
steps to its ``W`` workers round-robin, so worker ``w`` of rank ``r`` runs the partitions

    (B + r + w * R + i * R * W) % P        for i in range(P // (R * W))

and takes them round-robin, one item at a time. With ``B = 0`` and the default
``P = R * max(1, W)`` that is one partition per worker: ``r + w * R``.

When some partitions end their epoch before others, a worker skips its ended partitions and a
rank skips its ended workers (torch's round-robin), so the tail of an epoch comes in an order
that depends on the layout; every item still comes exactly once.

Restoring onto another layout (``R'``, ``W'`` dividing the same ``P``) restores every
partition's own state and starts from ``B`` = the items the job consumed in the current epoch
(the sum over the saved ranks), so ``G`` continues exactly where the job stood when every rank
had completed the same number of steps.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..state.rank_state import WorkerSlots

__all__ = [
    "PartitionLayout",
    "resolve_num_partitions",
]


def resolve_num_partitions(num_partitions: Any, world_size: int, num_workers: int) -> int:
    """``P`` for a loader: the given number, or ``world_size * max(1, num_workers)``.

    Raises ``TypeError``/``ValueError`` for a number that is not a positive integer or that
    this layout does not divide, naming the layouts that would work.
    """
    copies = world_size * max(1, num_workers)
    if num_partitions is None:
        return copies
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
        raise TypeError(
            "`num_partitions` must be a positive integer or None "
            f"(got {type(num_partitions).__name__}: {num_partitions!r})"
        )
    if num_partitions < 1:
        raise ValueError(f"`num_partitions` must be positive (got {num_partitions})")
    if num_partitions % copies:
        raise ValueError(
            f"num_partitions={num_partitions} cannot be split evenly over world_size="
            f"{world_size} x max(1, num_workers={num_workers}) = {copies} pipeline copies; "
            f"{_working_layouts(num_partitions, world_size)}"
        )
    return num_partitions


def _working_layouts(partitions: int, world_size: int) -> str:
    """What would work instead: worker counts for this world size, or world sizes."""
    if partitions % world_size == 0:
        per_rank = partitions // world_size
        workers = [w for w in range(1, per_rank + 1) if per_rank % w == 0]
        return (
            f"with world_size={world_size} use num_workers in {workers} (0 runs the "
            f"partitions in the main process), or num_partitions a multiple of "
            f"world_size x max(1, num_workers)"
        )
    sizes = [r for r in range(1, partitions + 1) if partitions % r == 0]
    return (
        f"{partitions} partitions need a world size in {sizes}; or use num_partitions a "
        f"multiple of {world_size} x max(1, num_workers)"
    )


@attrs.frozen
class PartitionLayout:
    """Which partitions each rank and worker of one layout runs, from a global position.

    ``start`` is the global position ``B`` modulo ``P`` the assignment starts from: 0 at every
    epoch start, the job's position after a restore onto another layout.
    """

    num_partitions: int
    world_size: int
    num_workers: int
    start: int = 0

    @property
    def copies(self) -> int:
        """How many pipeline runners the job has: ``world_size * max(1, num_workers)``."""
        return self.world_size * max(1, self.num_workers)

    @property
    def per_worker(self) -> int:
        """Partitions each runner takes round-robin."""
        return self.num_partitions // self.copies

    def worker_partitions(self, rank: int, worker: int) -> tuple[int, ...]:
        """The partitions worker ``worker`` of rank ``rank`` runs, in round-robin order."""
        step = self.copies
        first = self.start + rank + worker * self.world_size
        return tuple((first + i * step) % self.num_partitions for i in range(self.per_worker))

    def worker_slots(self, rank: int) -> tuple[WorkerSlots, ...]:
        """Every worker of rank ``rank`` with its partitions, first turn, not ended."""
        return tuple(
            WorkerSlots(self.worker_partitions(rank, w)) for w in range(max(1, self.num_workers))
        )

    def rank_partitions(self, rank: int) -> tuple[int, ...]:
        """Every partition rank ``rank`` runs, in the order its steps reach them."""
        per_rank = self.num_partitions // self.world_size
        first = self.start + rank
        return tuple((first + i * self.world_size) % self.num_partitions for i in range(per_rank))
