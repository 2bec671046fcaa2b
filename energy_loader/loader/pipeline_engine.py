"""The pipeline engine: a savable pipeline run as logical partitions, with exact saves.

A :class:`PipelineEngine` drives a torch ``DataLoader`` over a
:class:`~energy_loader.workers.side.WorkerSideDataset` (the user's loader itself for a
pipeline; a private one for an iterable drop-in). It keeps the epoch's
:class:`~energy_loader.loader.progress.Progress` (per logical worker the last item handed out,
whether that worker ended the epoch, which worker is due next) and delegates the rest: its
:class:`~energy_loader.loader.fleet.WorkerFleet` files the snapshots that arrive with the
items, so a save needs no message to any worker, and its
:class:`~energy_loader.loader.planner.Planner` turns positions into a saved state, or saved
states into a restore plan (pure). Restoring hands each worker its checkpoint and replay count
and rotates the workers so the one that was due next is first. With ``num_workers=0`` the
pipeline runs in the main process, from the same rolling checkpoints.

Not here: the state's format (:mod:`energy_loader.state.rank_state`), how states are read
from ``state_dict()`` leaves and rank files (:mod:`.pipeline_states`), process groups.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader

from ..dataset import SavableDataset, attach_restore_key, restore_key_of
from ..errors import WorkerError
from ..metrics import LoaderMetrics, StallPolicy, clock
from ..rng import kept_rng_state, kept_rng_state_if_seeded
from ..state.plain import to_key
from ..state.positions import Position
from ..state.rank_folder import RankFolder
from ..state.rank_state import RankState, decode_rank_states, partition_entries
from ..transport import decode
from ..validation import require_int
from ..worker import WorkerConfig, active_worker
from ..workers.protocol import CheckpointSettings, RunPlan, WorkerItem
from ..workers.side import WorkerSideDataset
from . import pipeline_states
from .arguments import LoaderArguments
from .equal_steps import cut_for_equal_steps
from .fleet import WorkerFleet
from .partitions import idle_workers_warning
from .planner import Planner, RestorePlan
from .progress import Mark, Progress
from .stall import StallWarner
from .unbundler import Unbundler

_EPOCH_OVER = object()

Readings = tuple[list[dict[str, float] | None], list[int]]


def _identity(item: Any) -> Any:
    return item


@attrs.frozen
class PipelinePlan:
    """A checked restore: the planner it was planned with (this engine's, or one for the
    saved partition count) and the plan."""

    planner: Planner
    restore: RestorePlan


class _EngineIterator:
    """What ``iter(loader)`` returns: the engine's epoch stream, item by item; made mid-epoch it
    continues the epoch, or rolls into the next if nothing was left."""

    def __init__(self, engine: PipelineEngine, continuation: bool) -> None:
        self._engine = engine
        self._generation = engine.generation
        self._continuation = continuation
        self._finished = False
        self.owner: Any = None  # the loader, kept alive while this iterator is
        engine.metrics.new_iterator()

    def __iter__(self) -> _EngineIterator:
        return self

    def is_current(self) -> bool:
        """Whether a ``next()`` continues the loader's stream (neither ended nor outdated)."""
        return not self._finished and self._generation == self._engine.generation

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        engine = self._engine
        if self._generation != engine.generation:
            raise RuntimeError(
                "this iterator belongs to a loader state that was since restored or reset; "
                "call iter(loader) again"
            )
        while True:
            try:
                sample = engine.next_sample()
            except StopIteration:
                if self._continuation:
                    # Everything of the epoch had been handed out: roll into the next one.
                    self._continuation = False
                    engine.begin_epoch()
                    self._generation = engine.generation
                    continue
                self._finished = True
                raise
            self._continuation = False
            return sample

    def __len__(self) -> int:
        return self._engine.rank_length()


class PipelineEngine:
    """Runs and records a savable pipeline for one loader (see the module docstring).
    ``adopts_partitions``: continue the restored partition count; ``savable=False``: save nothing;
    ``dropin``: an iterable drop-in's inner engine, behaving as torch's loader."""

    def __init__(
        self,
        pipeline: SavableDataset,
        args: LoaderArguments,
        *,
        adopts_partitions: bool,
        verify: bool = True,
        savable: bool = True,
        on_code_change: str = "warn",
        on_data_change: str = "warn",
        dropin: bool = False,
        changes: tuple[str, ...] = (),
    ) -> None:
        config = args.config
        self.worker_config = config
        self.num_workers = config.num_workers
        self.transport = args.transport
        self.adopts_partitions = adopts_partitions
        self.verify = verify
        self.change_policies = (on_code_change, on_data_change)
        _warn_if_idle(args.num_partitions, config)
        self.planner = planner = Planner(pipeline, config, args.num_partitions, changes)
        self.side = WorkerSideDataset(
            pipeline,
            config,
            args.settings,
            attrs.evolve(planner.canonical_plan(), verify=verify),
            savable=savable,
        )
        self.side.items_per_transfer = args.items_per_transfer
        self._args = args
        self.progress = Progress(max(1, self.num_workers), args.num_partitions // config.world_size)
        self._inner: Iterator[Any] | Unbundler | None = None
        # Raw items pulled to learn whether a restored epoch has any left (see `epoch`), handed
        # on by the next pulls; _EPOCH_OVER stands for the end found.
        self._peeked: collections.deque[Any] = collections.deque()
        # The item being handed out in pieces (equal steps) and its pieces not handed out yet.
        self._pieces: tuple[WorkerItem, collections.deque[Any]] | None = None
        self.dropin = dropin
        self.restored = False  # restored, and not iterated since
        self.generation = 0
        self.failure: WorkerError | None = None
        self.metrics = _make_metrics(self, args.stall)
        self.fleet: WorkerFleet | None = None
        self._torch_loader: Any = None

    def bind(self, torch_loader: DataLoader[Any]) -> None:
        """Run through ``torch_loader`` (a DataLoader over :attr:`side`, built with
        :meth:`torch_arguments`); held by weak reference, as it owns this engine."""
        self._torch_loader = weakref.ref(torch_loader)
        args = self._args
        self.fleet = WorkerFleet(
            torch_loader,
            self.side,
            self.num_workers,
            args.mp_context,
            args.transport,
            args.reply_timeout,
        )

    def torch_arguments(self, prefetch_factor: int | None) -> dict[str, Any]:
        """The arguments of the torch DataLoader that runs :attr:`side`
        (:func:`_torch_arguments`)."""
        return _torch_arguments(self.worker_config, self._args.mp_context, prefetch_factor)

    @property
    def _fleet(self) -> WorkerFleet:
        fleet = self.fleet
        if fleet is None:
            raise RuntimeError("the pipeline engine runs no DataLoader yet (bind() it first)")
        return fleet

    # -- iteration -------------------------------------------------------------------------

    def iterate(self) -> _EngineIterator:
        """Continue the current epoch if it has items left, otherwise start the next one."""
        progress = self.progress
        self.restored = False
        continuation = progress.in_epoch and not progress.epoch_ended
        if not continuation:
            self.begin_epoch()
        return _EngineIterator(self, continuation)

    def record_skip(self, items: int) -> None:
        self.progress.skipped(items)

    def next_iter_begins_epoch(self) -> bool:
        """Whether the next :meth:`iterate` starts an epoch (where torch's own DataLoader makes
        a new iterator) rather than continuing one that has items left."""
        progress = self.progress
        if not progress.in_epoch or progress.epoch_ended:
            return True
        return self.restored and self._restored_epoch_is_over()

    def has_begun(self) -> bool:
        """Whether an epoch has begun in this run or in the run whose state it restored."""
        return not self.progress.fresh

    def begin_epoch(self) -> None:
        """Start the next epoch (or the first), from the canonical partition assignment."""
        progress = self.progress
        if progress.epoch_ended:
            side = self.side
            if not self.planner.is_canonical(side.plan, side.offset, progress.start):
                # A restore rotated the workers or partitions: put every partition back where
                # a new epoch expects it (only this rank's own partitions move).
                self._apply(self.planner.plan([self.record(0)]))
                progress = self.progress
            progress.start_epoch(progress.start % self.worker_config.world_size)
            self._inner = None
        if not progress.in_epoch and not self.dropin:
            progress.count(self.planner.tally(progress.start))
        progress.in_epoch = True

    def next_sample(self) -> Any:
        """The next sample of the current epoch, with its bookkeeping; ``StopIteration`` at
        the epoch's end (which is then recorded)."""
        progress = self.progress
        if self._pieces:
            return self._next_piece(clock(), 0.0)
        decoding = self.transport is not None
        began, decode_s = clock(), 0.0  # for loader.stats()
        while True:
            try:
                item = self._pull()
                sample = item.sample
                if decoding and not item.is_end:
                    decoding_began = clock()
                    sample = decode(sample)
                    decode_s += clock() - decoding_began
                pieces = None if item.is_end else cut_for_equal_steps(sample, progress)
            except StopIteration:
                progress.end_epoch()
                self._inner = None
                raise
            except WorkerError:
                raise
            except Exception as error:
                if self.num_workers == 0:
                    raise
                failure = self._fleet.error_of(error, self.side.offset)
                self._fail(failure)
                raise failure from error
            self._fleet.receive(item, None if item.is_end else restore_key_of(sample))
            if pieces is not None:  # the rank's last item, cut for equal steps
                self._pieces = (item, collections.deque(pieces[progress.pieces :]))
                return self._next_piece(began, decode_s)
            progress.handed_out(item.worker, item.number, item.slot, item.is_end)
            if item.is_end:
                continue
            self.metrics.item(began, decode_s)
            return sample

    def _next_piece(self, began: float, decode_s: float) -> Any:
        """The next piece of the item being handed out in pieces; the last one records the
        item as handed out."""
        pending = self._pieces
        if pending is None:
            raise RuntimeError("no item is being handed out in pieces")
        item, pieces = pending
        piece = pieces.popleft()
        if pieces:
            self.progress.handed_out_piece()
        else:
            self._pieces = None
            self.progress.handed_out(item.worker, item.number, item.slot, False)
        self.metrics.item(began, decode_s)
        return piece

    def _pull(self) -> WorkerItem:
        """The next raw item of the current epoch."""
        if self._peeked:
            item = self._peeked.popleft()
            if item is _EPOCH_OVER:
                raise StopIteration
            return item  # type: ignore[no-any-return]
        return self._pull_raw()

    def _pull_raw(self) -> WorkerItem:
        inner = self._inner
        if inner is None:
            if self.num_workers > 0 and not self._fleet.running:
                self._fleet.open(self.starting_position)
            inner = self._open_torch_iterator()
            if self.num_workers > 0:
                side = self.side
                inner = Unbundler(inner, side.bundle_limits, side.items_per_transfer)
            self._inner = inner
        if isinstance(inner, Unbundler):
            return inner.next_item(self.progress.next_worker, self.progress.done)
        if self.dropin:  # torch's: the dataset draws from the training's generators
            return next(inner)  # type: ignore[no-any-return]
        # In this process the stages seed the global RNGs per sample: the training's own draws
        # (dropout) must not see it, nor the replay of a restore, so their states are put back
        # after an item whose stages seeded them (~80 us; nothing for an item that seeded none).
        with kept_rng_state_if_seeded():
            return next(inner)  # type: ignore[no-any-return]

    def _open_torch_iterator(self) -> Iterator[Any]:
        """torch's iterator over the worker side (starting the workers, or continuing them)."""
        torch_loader = self._torch_loader() if self._torch_loader is not None else None
        if torch_loader is None:
            raise RuntimeError("the loader this pipeline engine ran in is gone")
        with self.side.iterated_by_owner():
            return DataLoader.__iter__(torch_loader)  # type: ignore[return-value]

    def iterate_unsaved(self) -> Iterator[Any]:
        """torch's own iteration of the worker side, decoded: a loader that saves nothing."""
        if self.num_workers > 0 and not self._fleet.running:
            self._fleet.open_transport()
        inner = self._open_torch_iterator()
        if self.num_workers == 0:  # the stages run here: the training's generators are kept
            inner = _keeping_rngs(inner)
        return inner if self.transport is None else map(decode, inner)

    def starting_position(self, logical: int) -> Position:
        return self.planner.pending_position(self.side.plan, logical)

    def current_epoch(self) -> int:
        """The epoch of the item handed out last; once the epoch's end was reported, or after
        restoring a state saved at its last item, the next one (what the next ``iter()`` runs)."""
        progress = self.progress
        if progress.epoch_ended or (self.restored and self._restored_epoch_is_over()):
            return progress.epoch + 1
        return progress.epoch

    def _restored_epoch_is_over(self) -> bool:
        """Whether the epoch a restore continues has no item left: pulls (and keeps, for the
        next ``iter()``) raw items until one is a sample or the epoch's end is found. Nothing
        is counted as handed out, so a save in between is the restored state itself."""
        if not self.progress.in_epoch:
            return False
        if not self._peeked:
            while True:
                try:
                    item = self._pull_raw()
                except StopIteration:
                    self._peeked.append(_EPOCH_OVER)
                    break
                self._peeked.append(item)
                if not item.is_end:
                    break
        return self._peeked[-1] is _EPOCH_OVER

    @property
    def num_partitions(self) -> int:
        return self.planner.num_partitions

    @property
    def checkpoint_settings(self) -> CheckpointSettings:
        return self.side.settings

    def rank_length(self) -> int:
        return self.planner.rank_length()

    # -- saving ----------------------------------------------------------------------------

    def save(self, held_back: int) -> dict[str, Any]:
        return self.record(held_back).to_plain()

    def leaves(self, held_back: int) -> dict[str, Any]:
        return partition_entries([self.record(held_back)])

    def leaves_of_ranks(self, states: Sequence[Any]) -> dict[str, Any]:
        return partition_entries(self.decode(states))

    def record(self, held_back: int) -> RankState:
        """This rank's state as a record (a worker failure since the last restore refuses)."""
        if self.failure is not None:
            raise WorkerError(
                f"cannot save: {self.failure} -- the position of this loader was lost with "
                "its workers; restore it from the last saved state (or reset_state())",
                worker_id=self.failure.worker_id,
                original_traceback=self.failure.original_traceback,
            )
        require_int(held_back, "held_back", minimum=0)
        began = clock()
        progress = self.progress
        mark = progress.held_back(held_back)
        fields = progress.saved_fields(mark, held_back)
        state = self.planner.rank_state(self.side.plan, _positions(self, mark), **fields)
        self.metrics.save(clock() - began)
        return state

    def _fail(self, failure: WorkerError) -> None:
        """Stop the workers now and refuse to save until a restore or reset: the workers' positions
        died with them, and the traceback's cycle would make torch's shutdown wait 5 s per worker.
        """
        self.failure = failure
        self.shutdown()

    # -- restoring: decode -> check -> plan -> apply ---------------------------------------

    def decode(self, states: Sequence[Any]) -> list[RankState]:
        return decode_rank_states(states)

    def decode_leaves(self, leaves: dict[str, Any]) -> list[RankState] | None:
        return pipeline_states.leaves_to_run(self, leaves)

    def check_one_save(self, states: Sequence[Any], *, across: bool) -> None:
        pipeline_states.check_headers_of_one_save(states, across=across)

    def saved_ranks_needed(self, first: RankState, rank: int) -> list[int]:
        return self.planner_for([first]).saved_ranks_needed(first, rank)

    def read_rank_files(self, folder: RankFolder) -> list[RankState]:
        return pipeline_states.read_rank_files(self, folder)

    def planner_for(self, states: Sequence[RankState]) -> Planner:
        """The planner a restore from ``states`` uses: this engine's own, or, for a loader
        given no ``num_partitions``, one for the states' partition count."""
        return self.planner.adopting(states) if self.adopts_partitions else self.planner

    def plan(self, records: list[RankState]) -> PipelinePlan:
        planner = self.planner_for(records)
        restore = pipeline_states.plan(planner, records, *self.change_policies)
        return PipelinePlan(planner, restore)

    def apply(self, plan: PipelinePlan) -> None:
        if plan.planner is not self.planner:
            _warn_if_idle(plan.planner.num_partitions, self.worker_config)
            self.planner = plan.planner
        self._apply(plan.restore)
        self.restored = True

    def _apply(self, plan: RestorePlan) -> None:
        self.shutdown()
        side = self.side
        side.plan = RunPlan(self.planner.num_partitions, plan.workers, plan.restores, self.verify)
        side.offset = plan.offset
        side.drop_runner()
        self.progress = Progress.from_plan(plan)
        self._new_generation()

    def reset(self) -> None:
        self.shutdown()
        side = self.side
        side.plan = attrs.evolve(self.planner.canonical_plan(), verify=self.verify)
        side.offset = 0
        side.drop_runner()
        self.progress = Progress(max(1, self.num_workers), self.planner.layout().per_rank)
        self._new_generation()
        self.restored = False

    def _new_generation(self) -> None:
        """Iterators made before this point belong to a position the loader left."""
        self._inner = None
        self._peeked.clear()
        self._pieces = None
        self.failure = None
        self.generation += 1

    # -- the rest --------------------------------------------------------------------------

    def close(self) -> None:
        fleet = self.fleet
        if fleet is None or not fleet.running or self.failure is not None:
            self.shutdown()
            return
        self._apply(self.planner.plan([self.record(0)]))

    def shutdown(self) -> None:
        self._inner = None
        if self.fleet is not None:
            self.fleet.close()

    def stats(self) -> dict[str, Any]:
        return self.metrics.stats()

    def restore_sample(self, key: Any) -> Any:
        """Rebuild a sample in this process; the caller's global RNGs stay where they were
        (the stages seed them per sample, or draw from them unseeded)."""
        key = to_key(key)
        with kept_rng_state(), active_worker(self.planner.config.context(0)):
            return attach_restore_key(self.planner.pipeline.restore_sample(key), key)

    def config(self) -> dict[str, Any]:
        return self.planner.describe()


def _keeping_rngs(inner: Iterator[Any]) -> Iterator[Any]:
    """``inner``'s items, each made with the global RNGs put back after it (the stages of a
    pipeline run in this process seed them per sample)."""
    while True:
        with kept_rng_state_if_seeded():
            try:
                item = next(inner)
            except StopIteration:
                return
        yield item


def _warn_if_idle(num_partitions: int, config: WorkerConfig) -> None:
    message = idle_workers_warning(num_partitions, config.world_size, config.num_workers)
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=4)


def _make_metrics(engine: PipelineEngine, stall: StallPolicy | None) -> LoaderMetrics:
    """The engine's stats and stall check (by weak reference: no cycle keeps workers alive)."""
    workers = engine.num_workers
    owner = weakref.ref(engine)

    def poll() -> Readings:
        live = owner()
        if live is None:
            return [None] * max(1, workers), [0] * max(1, workers)
        return _poll_workers(live)

    warner = None if stall is None else StallWarner(workers, stall.threshold)
    return LoaderMetrics(max(1, workers), poll, stall, warner)


def _torch_arguments(
    config: WorkerConfig, mp_context: Any, prefetch_factor: int | None
) -> dict[str, Any]:
    """The torch DataLoader arguments for the worker side; its ``generator`` is the engine's own, so
    torch's unused base-seed draws never move the training's global generator."""
    workers = config.num_workers
    generator = torch.Generator()
    generator.manual_seed(config.seed)
    return {
        "batch_size": None,
        "num_workers": workers,
        "collate_fn": _identity,
        "prefetch_factor": prefetch_factor if workers else None,
        "persistent_workers": workers > 0,
        "multiprocessing_context": mp_context,
        "generator": generator,
    }


def _poll_workers(engine: PipelineEngine) -> Readings:
    """Each logical worker's counters and queue depth, for ``stats()``."""
    workers = engine.num_workers
    if workers == 0:
        runner = engine.side.local_runner
        return [None if runner is None else runner.counters.read()], [0]
    if engine.failure is not None or engine.fleet is None:
        return [None] * workers, [0] * workers
    return engine.fleet.poll_stats(engine.side.offset)


def _positions(engine: PipelineEngine, mark: Mark) -> list[Position]:
    """Each logical worker's partitions' (checkpoint, skip, done) and its next slot."""
    if engine.num_workers == 0:
        runner = engine.side.local_runner
        if runner is None or not runner.started:
            return [engine.starting_position(0)]
        return [runner.position_at(mark.last_index[0])]
    positions = engine.fleet.positions(mark) if engine.fleet is not None else None
    if positions is None:
        return [engine.starting_position(w) for w in range(engine.num_workers)]
    return positions
