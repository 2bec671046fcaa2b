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

from collections.abc import Sequence
from typing import Any

import attrs

from ..errors import StateMismatchError
from ..state.rank_state import PartitionState, RankState, WorkerSlots

__all__ = [
    "PartitionLayout",
    "RestorePlan",
    "plan_restore",
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


@attrs.frozen
class RestorePlan:
    """How one rank continues from saved states: its workers' partitions and their states.

    ``offset`` rotates torch's round-robin so that the worker due next comes first (only when
    restoring onto the layout that saved the state; elsewhere the partition assignment itself
    starts from the job's position and ``offset`` is 0).
    """

    workers: tuple[WorkerSlots, ...]
    restores: dict[int, PartitionState]
    epoch: int
    in_epoch: bool
    epoch_ended: bool
    delivered: int
    start: int
    next_worker: int
    offset: int


def _describe(numbers: Any) -> str:
    numbers = sorted(numbers)
    return str(numbers) if len(numbers) <= 12 else f"{numbers[:12]} ... ({len(numbers)} in all)"


def _check_common(states: Sequence[RankState], num_partitions: int) -> RankState:
    """The saved states agree with each other and with ``num_partitions``; returns the first."""
    if not states:
        raise StateMismatchError("no rank state to restore from")
    first = states[0]
    for state in states:
        if state.num_partitions != num_partitions:
            raise StateMismatchError(
                f"the state was saved with num_partitions={state.num_partitions} "
                f"(world_size={state.world_size} x {max(1, state.num_workers)} workers x "
                f"{state.num_partitions // (state.world_size * max(1, state.num_workers))} per "
                f"worker); this loader runs num_partitions={num_partitions}. Pass "
                f"num_partitions={state.num_partitions} to the loader to continue that stream"
            )
        for name in ("world_size", "num_workers", "epoch"):
            if getattr(state, name) != getattr(first, name):
                raise StateMismatchError(
                    f"the rank states disagree: rank {first.rank} has {name}="
                    f"{getattr(first, name)}, rank {state.rank} has {getattr(state, name)}; "
                    "pass the states of one save of one job"
                )
    ranks = [state.rank for state in states]
    if len(set(ranks)) != len(ranks):
        raise StateMismatchError(f"the rank states list a rank twice: ranks {ranks}")
    return first


def plan_restore(
    states: Sequence[RankState],
    *,
    rank: int,
    world_size: int,
    num_workers: int,
    num_partitions: int,
    scale: int = 1,
) -> RestorePlan:
    """Plan rank ``rank`` of the layout ``(world_size, num_workers)`` from saved rank states.

    ``states`` are some or all ranks' states of one save. On the layout that saved them a
    rank needs only its own state and continues exactly, the tail of an epoch included. On
    another layout the job's position ``B`` is the saved assignment's start plus
    ``world_size x`` the items the lowest given rank delivered (every rank's count, in the
    lockstep of synchronous data-parallel training), and the rank takes the partitions its
    steps reach from ``B`` on. Replay counts are multiplied by
    ``scale`` (a smaller batch size). Raises ``StateMismatchError`` naming what differs or
    which partitions no given state holds.
    """
    first = _check_common(states, num_partitions)
    own = next((s for s in states if s.rank == rank), None)
    same_layout = first.world_size == world_size and first.num_workers == num_workers
    if own is not None and same_layout and not own.epoch_ended:
        restores = {p.partition: attrs.evolve(p, skip=p.skip * scale) for p in own.partitions}
        return RestorePlan(
            workers=own.workers,
            restores=restores,
            epoch=own.epoch,
            in_epoch=own.in_epoch,
            epoch_ended=False,
            delivered=own.delivered,
            start=own.start,
            next_worker=own.next_worker,
            offset=0 if num_workers == 0 else own.next_worker,
        )
    basis = min(states, key=lambda s: s.rank)
    ended = (
        own.epoch_ended if own is not None and same_layout else all(s.epoch_ended for s in states)
    )
    available: dict[int, tuple[PartitionState, bool]] = {}
    for state in states:
        for entry in state.partitions:
            available[entry.partition] = (entry, state.epoch_ended)
    if ended:
        # A new epoch starts from the canonical assignment, unless this rank does not hold
        # those partitions (a rank-level rotation from an earlier restore onto another world
        # size): then its ranks keep the partitions they run, and only workers are reset.
        position = 0
        canonical = PartitionLayout(num_partitions, world_size, num_workers).rank_partitions(rank)
        if first.world_size == world_size and any(p not in available for p in canonical):
            position = basis.start % world_size
    else:
        # The ranks of a synchronous job deliver in lockstep: every rank's count is the
        # lowest rank's, whichever states (all, or the ones a rank file restore read) are given.
        position = basis.start + first.world_size * basis.delivered
    layout = PartitionLayout(num_partitions, world_size, num_workers, position % num_partitions)
    needed = layout.rank_partitions(rank)
    missing = [p for p in needed if p not in available]
    if missing:
        holders = sorted({s.rank for s in states})
        raise StateMismatchError(
            f"rank {rank} of world_size={world_size} x num_workers={num_workers} runs partitions "
            f"{_describe(needed)} from global position {position}, but the given state(s) of "
            f"rank(s) {holders} (saved on world_size={first.world_size} x num_workers="
            f"{first.num_workers}) hold only partitions {_describe(available)}; missing "
            f"{_describe(missing)}. Restoring onto another layout needs every rank's state: "
            "restore_state_global(states), restore_state_rank_file, or a "
            "torch.distributed.checkpoint load into a fresh loader"
        )
    restores = {}
    for p in needed:
        entry, rank_ended = available[p]
        done = False if ended else (entry.done or rank_ended)
        restores[p] = attrs.evolve(entry, skip=entry.skip * scale, done=done)
    return RestorePlan(
        workers=layout.worker_slots(rank),
        restores=restores,
        epoch=first.epoch,
        in_epoch=any(s.in_epoch for s in states) and not ended,
        epoch_ended=ended,
        delivered=0,
        start=layout.start,
        next_worker=0,
        offset=0,
    )
