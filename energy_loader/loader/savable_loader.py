"""SavableDataLoader and BasicDataLoader: the DataLoader subclasses users hold.

:class:`SavableDataLoader` is a ``torch.utils.data.DataLoader`` whose workers run a
:class:`~energy_loader.workers.side.WorkerSideDataset`. It keeps the epoch's
:class:`~energy_loader.loader.progress.Progress` (per logical worker the last item the user
received, whether that worker ended the epoch, which worker is due next) and delegates the
rest: its :class:`~energy_loader.loader.fleet.WorkerFleet` files the snapshots that arrive with
the items and answers where each worker stands, and its
:class:`~energy_loader.loader.planner.Planner` turns that into a saved state, or saved states
into a restore plan. So ``save_state_rank()`` needs no message to any worker, and
``restore_state_rank()`` hands each worker its checkpoint and replay count and rotates the
workers so the one that was due next is first. With ``num_workers=0`` the pipeline runs in the
main process and its state is read directly (nothing to replay).
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from torch.utils.data import DataLoader

from ..dataset import SavableDataset, restore_key_of
from ..errors import StateFormatError, WorkerError
from ..metrics import clock
from ..state.positions import Position
from ..state.rank_state import (
    RankState,
)
from ..transport import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_INLINE_BYTES,
    decode,
)
from ..validation import require_bool, require_int
from ..worker import WorkerConfig
from ..workers.bundling import DEFAULT_ITEMS_PER_TRANSFER
from ..workers.protocol import CheckpointSettings, RunPlan, WorkerItem
from ..workers.side import WorkerSideDataset
from .arguments import resolve_arguments
from .fleet import WorkerFleet
from .observing import ObservedLoader, make_metrics
from .partitions import idle_workers_warning
from .planner import Planner, RestorePlan
from .progress import Mark, Progress
from .protocols import RankStateProtocols
from .torch_args import DEFAULT_BATCH_SIZE, PipelineTorchArgs, pipeline_with_torch_args
from .unbundler import Unbundler

__all__ = ["BasicDataLoader", "SavableDataLoader"]


_EPOCH_OVER = object()


def _identity(item: Any) -> Any:
    return item


class _LoaderIterator:
    """What ``iter(loader)`` returns: the loader's epoch stream, item by item.

    An iterator made while an epoch is in progress *continues* it. If a continuation finds
    nothing left (every item of the epoch had been handed out, the end just not reported
    yet), the epoch is over and the iterator rolls straight into the next.
    """

    def __init__(self, loader: SavableDataLoader, continuation: bool) -> None:
        self._loader = loader
        self._generation = loader._generation
        self._continuation = continuation
        self._finished = False
        loader._metrics.new_iterator()

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        loader = self._loader
        if self._generation != loader._generation:
            raise RuntimeError(
                "this iterator belongs to a loader state that was since restored or reset; "
                "call iter(loader) again"
            )
        while True:
            try:
                sample = loader._next_sample()
            except StopIteration:
                if self._continuation:
                    # Everything of the epoch had been handed out: roll into the next one.
                    self._continuation = False
                    loader._begin_epoch()
                    self._generation = loader._generation
                    continue
                self._finished = True
                raise
            self._continuation = False
            return sample

    def __len__(self) -> int:
        return len(self._loader)


class SavableDataLoader(RankStateProtocols, ObservedLoader, DataLoader):
    """A torch DataLoader over a savable pipeline that saves its exact position.

    Example::

        loader = SavableDataLoader(pipeline, num_workers=2)
        for step, batch in enumerate(loader):
            train_step(batch)
            if step % 500 == 0:
                torch.save({"model": model.state_dict(), "data": loader.state_dict()}, path)

        loader = SavableDataLoader(build_pipeline(), num_workers=2)
        loader.load_state_dict(torch.load(path, weights_only=True)["data"])

    Over any other dataset (map-style or iterable) it becomes a
    :class:`~energy_loader.loader.dropin.DropInDataLoader`: torch's behaviour for torch's
    arguments, with exact resume. Over a pipeline, torch's ``batch_size``, ``collate_fn`` and
    ``drop_last`` add a ``BatchDataset``; ``shuffle``, samplers and ``generator`` are refused
    with the savable way.

    Each worker snapshots its partitions every ``checkpoint_every_n_samples`` items (and after
    an item when ``checkpoint_every_sec`` seconds have passed) and sends the snapshots with its
    items, so a save is computed here and a restore replays fewer than
    ``checkpoint_every_n_samples`` items, or about ``checkpoint_every_sec`` of work, per
    worker. ``iter(loader)`` continues the current epoch if it has not ended (also after a
    ``break``), otherwise starts the next; workers are persistent. Items travel up to
    ``items_per_transfer`` a trip through :mod:`energy_loader.transport`'s codec (inline below
    ``transport_inline_bytes``, through a shared-memory arena of ``transport_arena_bytes``
    above; ``transport_codec=False`` uses torch's). ``stats()``, ``peek_keys(n)`` and
    ``stall_warning``: :mod:`energy_loader.loader.observing`. Every option: docs/loader.md.
    """

    # Whether this loader keeps and saves state (BasicDataLoader does not).
    saves_state = True

    # The loader class for datasets that are not savable pipelines; energy_loader.loader.dropin
    # registers DropInDataLoader here when it is imported (the package imports it).
    dropin_class: ClassVar[type[SavableDataLoader] | None] = None

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> SavableDataLoader:
        # Any dataset that is not a savable pipeline runs as a drop-in for torch's DataLoader
        # (energy_loader.loader.dropin): still a SavableDataLoader, with torch's behaviour.
        if cls is SavableDataLoader and not isinstance(dataset, SavableDataset):
            if SavableDataLoader.dropin_class is None:
                raise TypeError(
                    "the loader runs a SavableDataset pipeline; import energy_loader (not "
                    "only energy_loader.loader.savable_loader) to run plain datasets"
                )
            return super().__new__(SavableDataLoader.dropin_class)
        return super().__new__(cls)

    def __init__(
        self,
        dataset: SavableDataset,
        batch_size: int | None = DEFAULT_BATCH_SIZE,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_config: WorkerConfig | None = None,
        checkpoint_every_n_samples: int = 16,
        checkpoint_every_sec: float | None = 0.1,
        n_checkpoints: int | None = None,
        gc_collect_every_n_steps: int | None = None,
        gc_freeze_at_start: bool = True,
        worker_reply_timeout: float = 60.0,
        transport_codec: bool = True,
        transport_inline_bytes: int = DEFAULT_INLINE_BYTES,
        transport_arena_bytes: int = DEFAULT_ARENA_BYTES,
        items_per_transfer: int = DEFAULT_ITEMS_PER_TRANSFER,
        num_partitions: int | None = None,
        stall_warning: Any = True,
        seed_per_sample: bool = True,
    ) -> None:
        if isinstance(dataset, SavableDataset):
            # torch's batching arguments as their savable equivalent (or a clear refusal).
            torch_args = PipelineTorchArgs(
                batch_size=batch_size,
                shuffle=shuffle,
                sampler=sampler,
                batch_sampler=batch_sampler,
                collate_fn=collate_fn,
                drop_last=drop_last,
                generator=generator,
                in_order=in_order,
            )
            dataset, prefetch_factor = pipeline_with_torch_args(
                dataset, torch_args, prefetch_factor
            )
        require_bool(seed_per_sample, "seed_per_sample")  # drop-in loaders only
        args = resolve_arguments(
            dataset,
            worker_config=worker_config,
            num_workers=num_workers,
            num_partitions=num_partitions,
            prefetch_factor=prefetch_factor,
            checkpoint_every_n_samples=checkpoint_every_n_samples,
            checkpoint_every_sec=checkpoint_every_sec,
            n_checkpoints=n_checkpoints,
            gc_collect_every_n_steps=gc_collect_every_n_steps,
            gc_freeze_at_start=gc_freeze_at_start,
            multiprocessing_context=multiprocessing_context,
            worker_reply_timeout=worker_reply_timeout,
            transport_codec=transport_codec,
            transport_inline_bytes=transport_inline_bytes,
            transport_arena_bytes=transport_arena_bytes,
            items_per_transfer=items_per_transfer,
            stall_warning=stall_warning,
        )
        config, workers, partitions = args.config, args.config.num_workers, args.num_partitions
        self._transport = args.transport
        self._worker_config = config
        # Without a num_partitions of its own the loader continues whatever count it restores.
        self._adopts_partitions = num_partitions is None
        _warn_if_idle(partitions, config)
        self._planner = planner = Planner(dataset, config, partitions)
        self._worker_side = side = WorkerSideDataset(
            dataset, config, args.settings, planner.canonical_plan(), savable=self.saves_state
        )
        side.items_per_transfer = args.items_per_transfer
        self._fleet = WorkerFleet(
            self, side, workers, args.mp_context, args.transport, args.reply_timeout
        )
        self._progress = Progress(max(1, workers), partitions // config.world_size)
        self._inner: Iterator[Any] | Unbundler | None = None
        # Raw items pulled to learn whether a restored epoch has any left (see `epoch`), handed
        # on by the next pulls; _EPOCH_OVER stands for the end found.
        self._peeked: collections.deque[Any] = collections.deque()
        self._restored = False  # restored, and not iterated since
        self._generation = 0
        self._failure: WorkerError | None = None
        self._metrics = make_metrics(self, args.stall)
        super().__init__(
            side,
            batch_size=None,
            num_workers=workers,
            collate_fn=_identity,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if workers else None,
            persistent_workers=workers > 0,
            multiprocessing_context=args.mp_context,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            pin_memory_device=pin_memory_device,
        )

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> _LoaderIterator:  # type: ignore[override]
        """Continue the current epoch if it has items left, otherwise start the next one."""
        progress = self._progress
        self._restored = False
        continuation = progress.in_epoch and not progress.epoch_ended
        if not continuation:
            self._begin_epoch()
        return _LoaderIterator(self, continuation)

    def _begin_epoch(self) -> None:
        """Start the next epoch (or the first), from the canonical partition assignment."""
        progress = self._progress
        if progress.epoch_ended:
            side = self._worker_side
            if not self._planner.is_canonical(side.plan, side.offset, progress.start):
                # A restore rotated the workers or partitions: put every partition back where
                # a new epoch expects it (only this rank's own partitions move).
                self._restore(self._planner.plan_own([self._save(0)]))
                progress = self._progress
            progress.start_epoch(progress.start % self._worker_config.world_size)
            self._inner = None
        progress.in_epoch = True

    def _next_sample(self) -> Any:
        """The next sample of the current epoch, with its bookkeeping; ``StopIteration`` at
        the epoch's end (which is then recorded)."""
        progress = self._progress
        decoding = self._transport is not None
        began, decode_s = clock(), 0.0  # for loader.stats()
        while True:
            try:
                item = self._pull()
                sample = item.sample
                if decoding and not item.is_end:
                    decoding_began = clock()
                    sample = decode(sample)
                    decode_s += clock() - decoding_began
            except StopIteration:
                progress.end_epoch()
                self._inner = None
                raise
            except WorkerError:
                raise
            except Exception as error:
                if self.num_workers == 0:
                    raise
                failure = self._fleet.error_of(error, self._worker_side.offset)
                self._fail(failure)
                raise failure from error
            self._fleet.receive(item, None if item.is_end else restore_key_of(sample))
            progress.handed_out(item.worker, item.number, item.slot, item.is_end)
            if item.is_end:
                continue
            self._metrics.item(began, decode_s)
            return sample

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
                self._fleet.open(self._starting_position)
            with self._worker_side.iterated_by_owner():
                torch_iterator = DataLoader.__iter__(self)
            if self.num_workers == 0:
                inner = torch_iterator
            else:
                side = self._worker_side
                inner = Unbundler(torch_iterator, side.bundle_limits, side.items_per_transfer)
            self._inner = inner
        if isinstance(inner, Unbundler):
            progress = self._progress
            return inner.next_item(progress.next_worker, progress.done)
        return next(inner)  # type: ignore[no-any-return]

    def _starting_position(self, logical: int) -> Position:
        return self._planner.pending_position(self._worker_side.plan, logical)

    @property
    def epoch(self) -> int:
        """The epoch the loader is in (0 before the first item).

        While an epoch runs, and after a ``break``, it is the epoch of the item handed out
        last. Once the end of an epoch has been reported (a ``for`` loop over the loader ran to
        its end), it is already the next epoch, the one the next ``iter()`` starts. A consumer
        that takes every item without pulling the end (``zip``, ``islice``,
        ``range(len(loader))``) sees the finished epoch until the first item of the next. A
        loader restored from a state saved right after an epoch's last item is already in the
        next epoch (the next ``iter()`` starts it), as a map-style drop-in loader is: one rule
        for every loader. Read it right after the item it should describe.
        """
        progress = self._progress
        if progress.epoch_ended or (self._restored and self._restored_epoch_is_over()):
            return progress.epoch + 1
        return progress.epoch

    def _restored_epoch_is_over(self) -> bool:
        """Whether the epoch a restore continues has no item left: pulls (and keeps, for the
        next ``iter()``) raw items until one is a sample or the epoch's end is found. Nothing
        is counted as handed out, so a save in between is the restored state itself."""
        if not self._progress.in_epoch:
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
        """P: the job's logical partitions (:mod:`energy_loader.loader.partitions`)."""
        return self._planner.num_partitions

    @property
    def pipeline(self) -> SavableDataset:
        """The savable pipeline this loader runs (the recipe: never iterate it yourself)."""
        return self._planner.pipeline

    @property
    def planner(self) -> Planner:
        """Save and restore planning for this rank (:mod:`energy_loader.loader.planner`)."""
        return self._planner

    @property
    def checkpoint_settings(self) -> CheckpointSettings:
        """When this loader's workers snapshot their partitions."""
        return self._worker_side.settings

    @property
    def worker_config(self) -> WorkerConfig:
        """The rank/worker layout this loader runs with."""
        return self._worker_config

    def __len__(self) -> int:
        """Items per epoch for this rank, when every stage's length is known."""
        return self._planner.rank_length()

    # -- saving ----------------------------------------------------------------------------

    def save_state_rank(self, *, held_back: int = 0) -> dict[str, Any]:
        """This rank's exact position as plain data (json-able, weights_only-loadable).

        ``held_back=n`` saves the position as of ``n`` items before the last one handed out
        (at most 2): for a consumer that fetches ahead of what it has trained on, such as
        Lightning with a loader of unknown length. Raises ``WorkerError`` after a worker
        failed, until ``restore_state_rank`` (from the last state saved before the failure)
        or ``reset_state``.
        """
        return self._save(held_back).to_plain()

    def _save(self, held_back: int) -> RankState:
        if self._failure is not None:
            raise WorkerError(
                f"cannot save: {self._failure} -- the position of this loader was lost with "
                "its workers; restore it from the last saved state (or reset_state())",
                worker_id=self._failure.worker_id,
                original_traceback=self._failure.original_traceback,
            )
        require_int(held_back, "held_back", minimum=0)
        began = clock()
        progress = self._progress
        mark = progress.held_back(held_back)
        state = self._planner.rank_state(
            self._worker_side.plan,
            self._positions(mark),
            epoch=progress.epoch,
            in_epoch=progress.in_epoch or held_back > 0,
            epoch_ended=progress.epoch_ended and held_back == 0,
            delivered=mark.delivered,
            start=progress.start,
            next_worker=mark.next_worker,
            done=mark.done,
        )
        self._metrics.save(clock() - began)
        return state

    def _positions(self, mark: Mark) -> list[Position]:
        """Each logical worker's partitions' (checkpoint, skip, done) and its next slot."""
        side = self._worker_side
        if self.num_workers == 0:
            runner = side.local_runner
            if runner is None or not runner.started:
                return [self._starting_position(0)]
            return [runner.position_at(mark.last_index[0])]
        positions = self._fleet.positions(mark)
        if positions is None:
            return [self._starting_position(w) for w in range(self.num_workers)]
        return positions

    def _fail(self, failure: WorkerError) -> None:
        """Stop the workers now and refuse to save until a restore or reset.

        Stopping here, not when the loader is garbage collected, matters: the traceback keeps
        the loader alive in a reference cycle, and torch's shutdown from the cycle collector
        waits 5 s for each worker. Refusing to save matters more: the workers' positions died
        with them, and a fresh-looking state would silently restart the epoch.
        """
        self._failure = failure
        self._shutdown_workers()

    # -- restoring -------------------------------------------------------------------------

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        """Continue exactly from ``state`` at the next ``iter()``.

        ``state`` is this rank's own state, or, after a change of ``num_workers`` only, the
        state this rank saved on the old layout. Onto another world size, restore from every
        rank's state (:meth:`restore_state_global`, ``restore_state_rank_file`` or a
        ``torch.distributed.checkpoint`` load). Raises ``StateFormatError`` for something that
        is not a valid state and ``StateMismatchError`` for a state of another pipeline,
        another ``num_partitions``, or one that lacks partitions this rank runs; in every case
        the loader is left as it was. Running workers are stopped and restarted.
        """
        self.restore_from_states([RankState.from_plain(state)])

    def decode_states(self, states: Sequence[Any]) -> list[RankState]:
        """Every rank's plain state, decoded and validated (``StateFormatError`` naming the
        entry that is not a rank state); what :meth:`restore_from_states` takes."""
        out = []
        for index, entry in enumerate(states):
            try:
                out.append(RankState.from_plain(entry))
            except StateFormatError as error:
                raise StateFormatError(f"states[{index}]: {error}") from None
        return out

    def restore_from_states(self, states: list[RankState]) -> None:
        """Restore this rank from some or all ranks' decoded states of one save."""
        planner = self.planner_for(states)
        plan = planner.plan_restore(states)
        if planner is not self._planner:
            _warn_if_idle(planner.num_partitions, self._worker_config)
            self._planner = planner
        self._restore(plan)
        self._restored = True

    def plan_restore(self, states: list[RankState]) -> RestorePlan:
        """Check ``states`` against this loader and plan its restore (changes nothing).

        Raises ``StateMismatchError`` for another pipeline or partitioning, and
        ``StateFormatError`` for a checkpoint the pipeline cannot read.
        """
        return self.planner_for(states).plan_restore(states)

    def saved_ranks_needed(self, first: RankState, rank: int | None = None) -> list[int]:
        """The saved ranks whose states rank ``rank`` (this loader's, by default) restores
        from, given the lowest saved rank's decoded state ``first`` of a save on another layout
        (see :meth:`Planner.saved_ranks_needed`): a rank reads those, not every rank's."""
        return self.planner_for([first]).saved_ranks_needed(first, rank)

    def planner_for(self, states: Sequence[RankState]) -> Planner:
        """The planner a restore from ``states`` uses (changes nothing): this loader's own,
        or, for a loader given no ``num_partitions``, one for the states' partition count
        (:meth:`Planner.adopting`)."""
        if not self._adopts_partitions:
            return self._planner
        return self._planner.adopting(states)

    def _restore(self, plan: RestorePlan) -> None:
        self._shutdown_workers()
        side = self._worker_side
        side.plan = RunPlan(self._planner.num_partitions, plan.workers, plan.restores)
        side.offset = plan.offset
        side.drop_runner()
        self._progress = Progress.from_plan(plan)
        self._new_generation()

    def reset_state(self) -> None:
        """Forget all progress: the next ``iter()`` starts epoch 0 from scratch."""
        self._shutdown_workers()
        side = self._worker_side
        side.plan = self._planner.canonical_plan()
        side.offset = 0
        side.drop_runner()
        self._progress = Progress(max(1, self.num_workers), self._planner.layout().per_rank)
        self._new_generation()
        self._restored = False

    def _new_generation(self) -> None:
        """Iterators made before this point belong to a position the loader left."""
        self._inner = None
        self._peeked.clear()
        self._failure = None
        self._generation += 1

    # -- the rest --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes now, keeping the position: the next ``iter()`` restarts
        them exactly where the loader stood.

        Frameworks that keep the loader in reference cycles (trainers, accelerators) free it
        through the cyclic garbage collector, where torch's own shutdown waits up to 5 s per
        worker; call this (or use the loader as a context manager) when done with it.
        """
        if not self._fleet.running or self._failure is not None:
            self._shutdown_workers()
            return
        self._restore(self._planner.plan_own([self._save(0)]))

    def _shutdown_workers(self) -> None:
        self._inner = None
        self._fleet.close()

    @property
    def _is_accelerate_prepared(self) -> bool:
        """Refuses ``accelerator.prepare(loader)`` at the call, for every savable loader.

        ``Accelerator.prepare_data_loader`` (which ``prepare`` and its DeepSpeed/FSDP paths go
        through) reads this attribute of a DataLoader before anything else. A savable loader
        cannot be prepared: Accelerate would rebuild a plain DataLoader over ``loader.dataset``
        (a pipeline's internal worker-side dataset, or a drop-in's dataset without its
        position) and save no position. Raising here turns that into a ``TypeError`` at
        ``prepare`` instead of a silent loss of the position (drop-in) or an error from inside
        a worker at the first batch (pipeline), without patching Accelerate.
        """
        raise TypeError(
            f"accelerator.prepare() cannot take a {type(self).__name__}: it would rebuild a "
            "plain DataLoader that saves no position (and, for a pipeline, cannot read it). "
            "Use energy_loader.integrations.accelerate.prepare_loader(accelerator, loader) "
            "instead: it puts the batches on accelerator.device and saves the loader's "
            "position with accelerator.save_state()"
        )

    def __enter__(self) -> SavableDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _suppress: Any = contextlib.suppress) -> None:
        # Bound as a default: at interpreter exit this module's globals may already be None.
        with _suppress(Exception):
            self._shutdown_workers()


class BasicDataLoader(SavableDataLoader):
    """Runs a savable pipeline with the same sharding and seeding, but saves nothing.

    For evaluation: no numbering, no checkpoints, no command threads. ``save_state_rank``
    and the other state methods raise ``TypeError``.
    """

    saves_state = False

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.num_workers > 0 and not self._fleet.running:
            self._fleet.open_transport()
        with self._worker_side.iterated_by_owner():
            inner = DataLoader.__iter__(self)
        return inner if self._transport is None else map(decode, inner)

    def save_state_rank(self, *, held_back: int = 0) -> dict[str, Any]:
        raise TypeError("BasicDataLoader does not save state; use SavableDataLoader")

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        raise TypeError("BasicDataLoader does not restore state; use SavableDataLoader")


def _warn_if_idle(num_partitions: int, config: WorkerConfig) -> None:
    message = idle_workers_warning(num_partitions, config.world_size, config.num_workers)
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)
