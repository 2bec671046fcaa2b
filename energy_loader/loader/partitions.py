"""Logical partitions: a job's data stream that does not depend on its ranks and workers.

A loader runs its pipeline as ``P`` independent *logical partitions*. Partition ``p`` is one
copy of the pipeline whose context reports shard ``p`` of ``P``: its sources read slice ``p``,
its random components seed from ``p``, and its per-sample seeds and restore keys are the same
whichever rank or worker runs it. The job's stream is::

    G[k] = item k // P of partition k % P          (while every partition has items)

and at step ``s`` rank ``r`` of ``R`` receives ``G[B + s * R + r]``, where ``B`` is the global
position the current run started from (0 at the start of every epoch). So rank ``r`` visits
its ``Q = P / R`` partitions in the order ``(B + r + j * R) % P`` for ``j = 0, 1, ..., Q - 1``,
one item each, again and again. Its ``W`` workers split that order: worker ``w`` runs positions
``j = w, w + W, w + 2W, ...`` and takes them round-robin, one item at a time, and the main
process takes each item from the worker that owns the next position (:func:`next_worker`).
When ``W`` divides ``Q`` that is torch's round-robin over workers; with ``B = 0`` and the
default ``P = R * max(1, W)`` it is one partition per worker: ``r + w * R``. A worker count
that does not divide ``Q`` still gives the same stream (the workers then carry unequal
shares); workers beyond ``Q`` idle.

When some partitions end their epoch before others, a worker skips its ended partitions and a
rank skips its ended workers, so the tail of an epoch comes in an order that depends on the
layout; every item still comes exactly once.

Restoring onto another layout (any ``R'`` dividing the same ``P``, any ``W'``) restores every
partition's own state and starts from ``B`` = the items the job consumed in the current epoch
(the sum over the saved ranks), so ``G`` continues exactly where the job stood when every rank
had completed the same number of steps. A loader given no ``num_partitions`` adopts the saved
``P`` when it restores, so changing ``num_workers`` needs no planning ahead; changing the world
size needs a ``P`` that the new world size divides, chosen when the job starts.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..state.rank_state import WorkerSlots


def resolve_num_partitions(num_partitions: Any, world_size: int, num_workers: int) -> int:
    """``P`` for a loader: the given number, or ``world_size * max(1, num_workers)``; it must be a
    positive multiple of ``world_size`` (errors name the world sizes that would work)."""
    if num_partitions is None:
        return world_size * max(1, num_workers)
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
        raise TypeError(
            "`num_partitions` must be a positive integer or None "
            f"(got {type(num_partitions).__name__}: {num_partitions!r})"
        )
    if num_partitions < 1:
        raise ValueError(f"`num_partitions` must be positive (got {num_partitions})")
    if num_partitions % world_size:
        raise ValueError(
            f"num_partitions={num_partitions} cannot be split evenly over world_size="
            f"{world_size} ranks: {num_partitions} partitions run on a world size in "
            f"{world_sizes_for(num_partitions)}, or use num_partitions a multiple of "
            f"{world_size}"
        )
    return num_partitions


def world_sizes_for(num_partitions: int) -> str:
    """The world sizes ``num_partitions`` partitions can run on, for messages."""
    sizes = [r for r in range(1, num_partitions + 1) if num_partitions % r == 0]
    return str(sizes) if len(sizes) <= 12 else f"{sizes[:12]} ... (divisors of {num_partitions})"


def idle_workers_warning(num_partitions: int, world_size: int, num_workers: int) -> str | None:
    """The warning for a layout with more workers per rank than partitions, else ``None``."""
    per_rank = num_partitions // world_size
    if num_workers <= per_rank:
        return None
    return (
        f"num_workers={num_workers} but each rank runs only {per_rank} logical partition(s) "
        f"(num_partitions={num_partitions} over world_size={world_size}): "
        f"{num_workers - per_rank} worker(s) per rank will idle. The data stream is unchanged; "
        f"use num_workers <= {per_rank}, or choose more partitions for the next run"
    )


def next_worker(worker: int, slot: int, per_rank: int, num_workers: int) -> int:
    """The worker whose item follows item ``slot`` of worker ``worker`` in its rank's stream: worker
    ``w``'s slot ``s`` is position ``w + s * W`` of the rank's ``Q`` partitions, so the next is ``(w
    + s * W + 1) % Q % W``; when ``W`` divides ``Q``, torch's ``(w + 1) % W``."""
    workers = max(1, num_workers)
    return (worker + slot * workers + 1) % per_rank % workers


@attrs.frozen
class PartitionLayout:
    """Which partitions each rank and worker of one layout runs, from a global position ``start``
    (``B mod P``: 0 at every epoch start, the job's position after a restore onto another layout).
    """

    num_partitions: int
    world_size: int
    num_workers: int
    start: int = 0

    @property
    def per_rank(self) -> int:
        """Partitions each rank runs: ``P / world_size``."""
        return self.num_partitions // self.world_size

    def worker_partitions(self, rank: int, worker: int) -> tuple[int, ...]:
        """The partitions worker ``worker`` of rank ``rank`` runs, in round-robin order: every
        ``W``-th of the rank's, from its ``worker``-th (none for a worker beyond ``P /
        world_size``, which idles)."""
        return self.rank_partitions(rank)[worker :: max(1, self.num_workers)]

    def worker_slots(self, rank: int) -> tuple[WorkerSlots, ...]:
        """Every worker of rank ``rank`` with its partitions, first turn, not ended."""
        return tuple(
            WorkerSlots(self.worker_partitions(rank, w)) for w in range(max(1, self.num_workers))
        )

    def rank_partitions(self, rank: int) -> tuple[int, ...]:
        """Every partition rank ``rank`` runs, in the order its steps reach them."""
        first = self.start + rank
        step = self.world_size
        return tuple((first + i * step) % self.num_partitions for i in range(self.per_rank))
