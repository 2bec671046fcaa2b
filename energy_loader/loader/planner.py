"""Save and restore planning for one rank: pure (no processes, no queues, no files).

A save is a :class:`~energy_loader.state.rank_state.RankState` built from what the main process
knows (:mod:`energy_loader.loader.progress`) and where each worker stands
(:mod:`energy_loader.state.positions`); a restore is a :class:`RestorePlan` computed from some
or all ranks' saved states by :meth:`Planner.plan`, once :mod:`.checks` found that they fit
this pipeline and are of one save. The loader, ``peek``/``replay`` and
:mod:`energy_loader.distributed` all plan through a :class:`Planner`, so the rules live here
once:

- On the layout that saved them a rank needs only its own state and continues exactly.
- On another layout (see :mod:`energy_loader.loader.partitions`) the job's position is the
  saved assignment's start plus the items the ranks consumed, and each rank takes the
  partitions its steps reach from there.
- A smaller batch size that divides the saved one is accepted when the batch is the outermost
  stage that keeps state; replay counts are scaled.

The pipeline is bound to a partition's context only for the duration of a call, and left bound
to the loader's rank context (worker 0) afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ..dataset import SavableDataset
from ..errors import StateMismatchError
from ..state.positions import Position, Snapshot
from ..state.rank_state import PartitionState, RankState, WorkerSlots
from ..worker import WorkerConfig
from ..workers.protocol import RunPlan
from .equal_steps import Tally
from .equal_steps import tally as equal_tally
from .partitions import PartitionLayout, world_sizes_for


class Planner:
    """Plans saves and restores of one rank's loader over ``pipeline`` (see the module doc); its
    configuration, computed once, goes in every saved state and is compared at every restore."""

    def __init__(
        self,
        pipeline: SavableDataset,
        config: WorkerConfig,
        num_partitions: int,
        changes: tuple[str, ...] = (),
    ) -> None:
        self.pipeline = pipeline
        # What a restore may find changed on purpose (energy_loader.state.changes).
        self.changes = changes
        self.config = config
        self.num_partitions = num_partitions
        pipeline.bind(config.context(0))
        self.pipeline_config = pipeline.config()
        pipeline.reset_state()
        # Every partition's items per epoch (empty: unknown), for equal steps; on first use.
        self._lengths: tuple[int, ...] | None = None

    def describe(self) -> dict[str, Any]:
        """What ``loader.config()`` says of the engine: the pipeline and its layout."""
        config = self.config
        return {
            "pipeline": self.pipeline_config,
            "rank": config.rank,
            "world_size": config.world_size,
            "num_workers": config.num_workers,
            "num_partitions": self.num_partitions,
            "seed": config.seed,
        }

    # -- layouts -------------------------------------------------------------------------------

    def layout(self, start: int = 0) -> PartitionLayout:
        config = self.config
        return PartitionLayout(self.num_partitions, config.world_size, config.num_workers, start)

    def canonical_plan(self, start: int = 0) -> RunPlan:
        """What this rank's workers run at the start of an epoch whose assignment starts at
        global position ``start``: every partition fresh."""
        return RunPlan(self.num_partitions, self.layout(start).worker_slots(self.config.rank))

    def is_canonical(self, plan: RunPlan, offset: int, start: int) -> bool:
        """Workers unrotated and running the partitions a new epoch gives them."""
        canonical = self.canonical_plan(start % self.config.world_size).workers
        return offset == 0 and all(
            a.partitions == b.partitions for a, b in zip(plan.workers, canonical)
        )

    def rank_length(self) -> int:
        """Items per epoch for this rank: the sum over the partitions it runs (raises
        ``TypeError`` when a stage's length is unknown)."""
        config, pipeline = self.config, self.pipeline
        total = 0
        try:
            for partition in self.layout().rank_partitions(config.rank):
                pipeline.bind(config.partition_context(partition, self.num_partitions))
                total += len(pipeline)  # type: ignore[arg-type]
        finally:
            pipeline.bind(config.context(0))
        return total

    def tally(self, start: int, consumed: int = 0) -> Tally | None:
        """This rank's count of the epoch's steps (:mod:`.equal_steps`) for an assignment from
        ``start`` after ``consumed`` items of the epoch; None when a stage's length is unknown."""
        lengths = self.partition_lengths()
        if not lengths:
            return None
        layout = self.layout(start % self.num_partitions)
        return equal_tally(lengths, layout, self.config.rank, consumed)

    def partition_lengths(self) -> tuple[int, ...]:
        """Every partition's items per epoch (empty when a stage's length is unknown)."""
        if self._lengths is None:
            config, pipeline = self.config, self.pipeline
            try:
                lengths = []
                for partition in range(self.num_partitions):
                    pipeline.bind(config.partition_context(partition, self.num_partitions))
                    lengths.append(len(pipeline))  # type: ignore[arg-type]
            except TypeError:
                lengths = []
            finally:
                pipeline.bind(config.context(0))
            self._lengths = tuple(lengths)
        return self._lengths

    # -- saving --------------------------------------------------------------------------------

    def fresh_checkpoint(self, partition: int) -> dict[str, Any]:
        """Partition ``partition``'s state before its first item."""
        pipeline, config = self.pipeline, self.config
        try:
            pipeline.bind(config.partition_context(partition, self.num_partitions))
            pipeline.reset_state()
            return pipeline.save_state()
        finally:
            pipeline.bind(config.context(0))

    def pending_position(self, plan: RunPlan, logical: int) -> Position:
        """Where logical worker ``logical`` of ``plan`` stands before it starts: its restore
        states, or fresh."""
        slots = plan.workers[logical]
        restores = plan.restores
        entries = [
            PartitionState(partition, self.fresh_checkpoint(partition))
            if restores is None
            else restores[partition]
            for partition in slots.partitions
        ]
        return entries, slots.next

    def rank_state(
        self,
        plan: RunPlan,
        positions: Sequence[Position],
        *,
        epoch: int,
        in_epoch: bool,
        epoch_ended: bool,
        delivered: int,
        start: int,
        next_worker: int,
        done: Sequence[bool],
        tally: Tally | None = None,
        pieces: int = 0,
        history: Sequence[dict[str, Any]] = (),
    ) -> RankState:
        """This rank's state from each logical worker's position."""
        workers, partitions = [], []
        for logical, (entries, following) in enumerate(positions):
            slots = plan.workers[logical]
            workers.append(WorkerSlots(slots.partitions, following, done[logical]))
            partitions.extend(entries)
        return self._rank_state(
            self.config.rank,
            workers=tuple(workers),
            partitions=tuple(partitions),
            epoch=epoch,
            in_epoch=in_epoch,
            epoch_ended=epoch_ended,
            delivered=delivered,
            start=start,
            next_worker=next_worker,
            job_left=None if tally is None else tally.job_left,
            items_left=0 if tally is None else tally.items_left,
            extra=0 if tally is None else tally.extra,
            pieces=pieces,
            history=tuple(history),
        )

    def ended_rank_state(self, workers: Sequence[Snapshot], start: int) -> RankState:
        """The state of this rank right after its epoch ended, from each worker's snapshot
        (for ``peek``, which runs the workers in this process)."""
        slots: list[WorkerSlots] = []
        partitions: list[PartitionState] = []
        for snapshot in workers:
            entries = snapshot.partitions
            slots.append(WorkerSlots(tuple(entry.partition for entry in entries), 0, True))
            partitions.extend(PartitionState(e.partition, e.checkpoint, 0, True) for e in entries)
        return self._rank_state(
            self.config.rank,
            workers=tuple(slots),
            partitions=tuple(partitions),
            epoch=0,
            in_epoch=False,
            epoch_ended=True,
            delivered=0,
            start=start,
            next_worker=0,
        )

    def _rank_state(self, rank: int, **fields: Any) -> RankState:
        config = self.config
        return RankState(
            rank=rank,
            world_size=config.world_size,
            num_workers=config.num_workers,
            num_partitions=self.num_partitions,
            config=self.pipeline_config,
            seed=config.seed,
            **fields,
        )

    # -- restoring -------------------------------------------------------------------------------

    def adopting(self, states: Sequence[RankState]) -> Planner:
        """This planner, or one for the partition count ``states`` were saved with (a loader built
        without ``num_partitions``); ``StateMismatchError`` when this world size cannot run them."""
        if not states or states[0].num_partitions == self.num_partitions:
            return self
        saved = states[0].num_partitions
        world_size = self.config.world_size
        if saved % world_size:
            raise StateMismatchError(
                f"the state was saved with num_partitions={saved}, which world_size="
                f"{world_size} cannot run (every rank runs the same number of partitions): "
                f"restore it on a world size in {world_sizes_for(saved)}"
            )
        return Planner(self.pipeline, self.config, saved, self.changes)

    def saved_ranks_needed(self, first: RankState, rank: int | None = None) -> list[int]:
        """The saved ranks whose states ``rank`` (this planner's by default) restores from on
        another layout: those that ran the partitions it runs from the job's position (``first``'s,
        the lowest saved rank's), so a rank reads a few states, not all."""
        rank = self.config.rank if rank is None else rank
        lockstep = first.start + first.world_size * first.delivered
        ranks = {first.rank}
        for position in (lockstep, first.start % first.world_size):
            for partition in self.layout(position % self.num_partitions).rank_partitions(rank):
                ranks.add((partition - first.start) % first.world_size)
        return sorted(ranks)

    def plan(self, states: list[RankState], *, scale: int = 1) -> RestorePlan:
        """Plan this rank's restore from ``states``, which fit this pipeline: its loader saved
        them itself (to move its own position at an epoch's start), or
        :func:`~energy_loader.loader.checks.check_fits` checked them (and gave ``scale``)."""
        config = self.config
        return _plan_rank(
            states,
            rank=config.rank,
            world_size=config.world_size,
            num_workers=config.num_workers,
            num_partitions=self.num_partitions,
            scale=scale,
            lengths=self.partition_lengths(),
        )


@attrs.frozen
class RestorePlan:
    """How one rank continues from saved states: its workers' partitions and their states.
    ``offset`` rotates torch's round-robin to the worker due next (on the saving layout only)."""

    workers: tuple[WorkerSlots, ...]
    restores: dict[int, PartitionState]
    epoch: int
    in_epoch: bool
    epoch_ended: bool
    delivered: int
    start: int
    next_worker: int
    offset: int
    tally: Tally | None = None
    pieces: int = 0
    history: tuple[dict[str, Any], ...] = ()

    def keys_only(self) -> RestorePlan:
        """This plan with each partition's proof of values dropped and its keys kept (a restore onto
        changed code, and a peek)."""
        restores = {p: attrs.evolve(entry, made=None) for p, entry in self.restores.items()}
        return attrs.evolve(self, restores=restores)


def _describe(numbers: Any) -> str:
    numbers = sorted(numbers)
    return str(numbers) if len(numbers) <= 12 else f"{numbers[:12]} ... ({len(numbers)} in all)"


def _scaled(entry: PartitionState, scale: int) -> PartitionState:
    """``entry`` replayed with ``scale`` times smaller batches: ``scale`` times the items and no
    proof (it names an old batch); it may end up to ``scale - 1`` items early (``replay_slack``)."""
    if scale == 1:
        return entry
    return attrs.evolve(
        entry, skip=entry.skip * scale, last=None, made=None, replay_slack=scale - 1
    )


def _plan_rank(
    states: Sequence[RankState],
    *,
    rank: int,
    world_size: int,
    num_workers: int,
    num_partitions: int,
    scale: int = 1,
    lengths: Sequence[int] = (),
) -> RestorePlan:
    """Plan rank ``rank`` of the layout ``(world_size, num_workers)`` from saved rank states.

    On the saving layout a rank continues from its own state exactly. On another, the job's position
    is the saved start plus ``world_size x`` the lowest rank's delivered items (lockstep), and the
    rank takes the partitions its steps reach from there, counting the epoch's steps again from
    ``lengths`` (:mod:`.equal_steps`). Replay counts are multiplied by ``scale``. Raises
    ``StateMismatchError`` naming partitions no given state holds.
    """
    first = states[0]
    own = next((s for s in states if s.rank == rank), None)
    same_layout = first.world_size == world_size and first.num_workers == num_workers
    if own is not None and same_layout and not own.epoch_ended:
        restores = {p.partition: _scaled(p, scale) for p in own.partitions}
        # (smaller batches: more items than the saved count, which no longer holds; the next
        # epoch counts again)
        tally = _tally_of(own) if scale == 1 else None
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
            tally=tally,
            pieces=own.pieces if tally is not None else 0,
            history=own.history,
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
        # A new epoch starts where the loader starts it (``start mod world_size``: 0, or the
        # rank-level rotation an earlier restore onto another world size left), on any layout.
        position = basis.start % first.world_size
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
        restores[p] = attrs.evolve(_scaled(entry, scale), done=done)
    tally = None
    if not ended:
        if basis.pieces:
            raise StateMismatchError(
                f"the state was saved while rank {basis.rank} handed out an item in pieces (its "
                "epoch's last steps, cut so that every rank takes as many): it restores on the "
                f"layout that saved it (world_size={first.world_size} x num_workers="
                f"{first.num_workers}), not on world_size={world_size} x num_workers="
                f"{num_workers}. Restore it there, or a state saved at another step"
            )
        if basis.job_left is not None and scale == 1 and lengths:
            # The items the job consumed since the assignment began: every rank's steps.
            left = max(0, basis.job_left - first.world_size * basis.delivered)
            tally = equal_tally(lengths, layout, rank, sum(lengths) - left)
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
        tally=tally,
        history=basis.history,
    )


def _tally_of(state: RankState) -> Tally | None:
    if state.job_left is None:
        return None
    return Tally(state.job_left, state.items_left, state.extra)
