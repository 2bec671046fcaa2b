"""SavableDataLoader and BasicDataLoader: the main-process side.

:class:`SavableDataLoader` is a ``torch.utils.data.DataLoader`` whose workers run a
:class:`~energy_loader.worker_process.WorkerSideDataset`. The main process records, per
(logical) worker, the index of the last item the user received, whether that worker ended the
current epoch, and which worker is due next. Each worker's rolling checkpoints arrive with
its items and are kept in a :class:`~energy_loader.worker_process.PositionBook` per worker, so
``save_state_rank()`` computes every worker's newest checkpoint not after that item, and the
items to replay from it, without a message to any worker. ``restore_state_rank()`` hands
each worker its checkpoint and replay count and rotates the workers so the one that was due
next is first. With ``num_workers=0`` the pipeline runs in the main process and its state is
read directly (nothing to replay).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import multiprocessing
import re
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import attrs
import dill
from torch.utils.data import DataLoader

from ..dataset import SavableDataset
from ..errors import StateFormatError, StateMismatchError, WorkerError
from ..metrics import LoaderMetrics, clock, poll_loader, resolve_stall_policy
from ..state.fingerprint import ConfigDifference, config_differences, describe_differences
from ..state.positions import Position, PositionBook, Snapshot
from ..state.rank_state import (
    PARTITION_KEY_PREFIX,
    PartitionState,
    RankState,
    WorkerSlots,
    partition_entries,
    states_from_entries,
)
from ..transport import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_INLINE_BYTES,
    Transport,
    decode,
    validate_transport_settings,
)
from ..validation import require_bool, require_int
from ..worker import WorkerConfig, active_worker
from ..workers.bundling import DEFAULT_ITEMS_PER_TRANSFER
from ..workers.protocol import CheckpointSettings, RunPlan
from ..workers.side import WorkerSideDataset
from .partitions import PartitionLayout, RestorePlan, plan_restore, resolve_num_partitions
from .torch_args import DEFAULT_BATCH_SIZE, PipelineTorchArgs, apply_to_pipeline
from .unbundler import Unbundler

__all__ = ["BasicDataLoader", "SavableDataLoader"]

_WORKER_IN_MESSAGE = re.compile(r"worker process (\d+)")
_PIDS_IN_MESSAGE = re.compile(r"\b(\d{2,})\b")


def _identity(item: Any) -> Any:
    return item


def _resolve_config(
    dataset: Any, worker_config: WorkerConfig | None, num_workers: Any
) -> WorkerConfig:
    if not isinstance(dataset, SavableDataset):
        raise TypeError(
            "the loader runs a SavableDataset pipeline (e.g. IndexedSource(...) wrapped in "
            f"MapDataset/BatchDataset); got {type(dataset).__name__}"
        )
    if worker_config is None:
        return WorkerConfig.from_env(num_workers=require_int(num_workers, "num_workers", minimum=0))
    if not isinstance(worker_config, WorkerConfig):
        raise TypeError(
            f"`worker_config` must be a WorkerConfig (got {type(worker_config).__name__})"
        )
    if num_workers not in (0, worker_config.num_workers):
        raise ValueError(
            f"num_workers={num_workers} disagrees with worker_config.num_workers="
            f"{worker_config.num_workers}; pass one of them"
        )
    return worker_config


def _check_serializable(pipeline: SavableDataset) -> None:
    """Fail now, naming the culprit, if spawn/forkserver could not ship the pipeline."""
    try:
        dill.dumps(pipeline, recurse=True)
        return
    except Exception as error:
        whole = error
    for dataset in pipeline.walk():
        for name, value in vars(dataset).items():
            if isinstance(value, SavableDataset) or name.startswith("_cursor"):
                continue
            try:
                dill.dumps(value, recurse=True)
            except Exception as error:
                raise TypeError(
                    f"{type(dataset).__name__}.{name} ({value!r}) cannot be serialized with dill "
                    f"for the spawn/forkserver start method: {error}. Use the fork start method "
                    "or make it serializable"
                ) from error
    raise TypeError(f"the pipeline cannot be serialized with dill: {whole}") from whole


# How many delivered items a save may hold back (``save_state_rank(held_back=n)``): the rolling
# checkpoints keep that many more items per worker.
MAX_HELD_BACK = 2


@attrs.frozen
class _Mark:
    """Where the rank stood right after handing out one item (for held-back saves)."""

    last_index: tuple[int, ...]
    done: tuple[bool, ...]
    next_worker: int
    delivered: int


class _Progress:
    """What the main process knows about each logical worker's stream and the epoch."""

    def __init__(self, workers: int) -> None:
        self.last_index = [-1] * workers
        self.done = [False] * workers
        self.next_worker = 0
        self.epoch = 0
        self.in_epoch = False
        self.epoch_ended = False
        self.delivered = 0
        self.start = 0
        # The position after each of the last items handed out, and before the first one.
        self.marks: collections.deque[_Mark] = collections.deque(maxlen=MAX_HELD_BACK + 1)
        self.marks.append(self.mark())

    def start_epoch(self, start: int) -> None:
        """The next epoch begins, its partition assignment starting at ``start``."""
        self.epoch += 1
        self.done = [False] * len(self.done)
        self.epoch_ended = False
        self.next_worker = 0
        self.delivered = 0
        self.start = start
        self.marks.clear()
        self.marks.append(self.mark())

    def mark(self) -> _Mark:
        return _Mark(tuple(self.last_index), tuple(self.done), self.next_worker, self.delivered)

    def held_back(self, count: int) -> _Mark:
        """Where the rank stood ``count`` items before the last one it handed out."""
        if count == 0:
            return self.mark()
        if count > MAX_HELD_BACK:
            raise ValueError(f"`held_back` must be at most {MAX_HELD_BACK} (got {count})")
        if count >= len(self.marks):
            raise ValueError(
                f"held_back={count}: only {len(self.marks) - 1} item(s) were handed out since "
                "this epoch began or the loader was restored, so there is no position that "
                "many items back"
            )
        return self.marks[-1 - count]


class _LoaderIterator:
    """Pulls from the loader's epoch stream: strips numbering and end markers.

    An iterator made by ``iter(loader)`` while an epoch is in progress *continues* it. If a
    continuation finds nothing left (every item of the epoch had been handed out, the end
    just not reported yet), the epoch is over and the iterator rolls straight into the next.
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
        loader = self._loader
        if self._finished:
            raise StopIteration
        if self._generation != loader._generation:
            raise RuntimeError(
                "this iterator belongs to a loader state that was since restored or reset; "
                "call iter(loader) again"
            )
        progress = loader._progress
        workers = len(progress.done)
        decoding = loader._transport is not None
        began, decode_s = clock(), 0.0  # for loader.stats()
        while True:
            try:
                worker, index, is_end, sample, slot, snapshots = loader._pull()
                if decoding and not is_end:
                    decoding_began = clock()
                    sample = decode(sample)
                    decode_s += clock() - decoding_began
            except StopIteration:
                loader._end_epoch()
                if self._continuation:
                    # Everything of the epoch had been handed out: roll into the next one.
                    self._continuation = False
                    loader._begin_epoch()
                    self._generation = loader._generation
                    progress = loader._progress
                    continue
                self._finished = True
                raise
            except WorkerError:
                raise
            except Exception as error:
                if loader.num_workers == 0:
                    raise
                failure = loader._worker_error(error)
                loader._fail(failure)
                raise failure from error
            if loader._books:
                loader._books[worker].receive(index, slot, snapshots)
            progress.last_index[worker] = index
            progress.next_worker = (worker + 1) % workers
            if is_end:
                progress.done[worker] = True
                continue
            progress.delivered += 1
            progress.marks.append(progress.mark())
            self._continuation = False
            loader._metrics.item(began, decode_s)
            return sample

    def __len__(self) -> int:
        return len(self._loader)


class SavableDataLoader(DataLoader):
    """A torch DataLoader over a savable pipeline that saves its exact position.

    Example::

        loader = SavableDataLoader(pipeline, num_workers=2)
        for step, batch in enumerate(loader):
            train_step(batch)
            if step % 500 == 0:
                torch.save({"model": model.state_dict(), "data": loader.state_dict()}, path)

        loader = SavableDataLoader(build_pipeline(), num_workers=2)
        loader.load_state_dict(torch.load(path, weights_only=True)["data"])

    Checkpoints. Each worker checkpoints its pipeline every ``checkpoint_every_n_samples``
    items (items are what the pipeline yields: batches, for a batched pipeline) and at most
    every ``checkpoint_every_sec`` seconds; a restore replays fewer than
    ``checkpoint_every_n_samples`` items per worker. ``n_checkpoints`` (default: enough for
    ``prefetch_factor * num_workers`` items in flight per worker) bounds the checkpoints each
    worker keeps; a value too small to cover the items in flight is a ``ValueError``.

    Epochs. ``iter(loader)`` continues the current epoch if it has not ended (also after a
    ``break``: nothing in flight is lost), otherwise starts the next. Workers are persistent.

    Transport. A worker sends up to ``items_per_transfer`` items in one trip through torch's
    queues (fewer when they are large or slow to make; :mod:`energy_loader.bundles`); the
    main process hands them out one at a time, in the order one item a trip would give. Torch
    keeps ``prefetch_factor`` trips outstanding per worker. With workers and
    ``transport_codec=True`` (the default) each item crosses to
    the main process through :mod:`energy_loader.transport` instead of torch's per-tensor
    shared memory: pickled in one payload with its tensors and arrays out of band, inline
    below ``transport_inline_bytes`` and through a per-worker shared-memory arena of
    ``transport_arena_bytes`` (address space, touched only as needed) above. Decoded items
    equal the originals; tensors come back contiguous. ``transport_codec=False`` uses torch's
    transport.

    Observing. ``stats()`` returns what the loader has been doing (waits, items/s, worker busy
    fractions, saves; :mod:`energy_loader.metrics`), ``peek_keys(n)`` the restore keys of the
    next items. ``stall_warning`` (True: a :class:`~energy_loader.metrics.StallPolicy` with
    its defaults; a fraction; a ``StallPolicy``; False or None: off) logs one warning on the
    ``energy_loader`` logger, with backoff, when the training loop waits for data more than
    that fraction of its step time, naming the likely cause (:mod:`energy_loader.stall`).
    """

    _savable = True
    # False for drop-in loaders over plain datasets, whose states have their own format.
    savable_pipeline = True

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> SavableDataLoader:
        # Any dataset that is not a savable pipeline runs as a drop-in for torch's DataLoader
        # (energy_loader.loader.dropin): still a SavableDataLoader, with torch's behaviour.
        if cls is SavableDataLoader and not isinstance(dataset, SavableDataset):
            from .dropin import DropInDataLoader

            return super().__new__(DropInDataLoader)
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
        checkpoint_every_sec: float | None = 1.0,
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
            dataset = apply_to_pipeline(dataset, torch_args)
            if prefetch_factor is None:  # torch's default with workers
                prefetch_factor = 2
        require_bool(seed_per_sample, "seed_per_sample")  # drop-in loaders only
        config = _resolve_config(dataset, worker_config, num_workers)
        stall = resolve_stall_policy(stall_warning)
        workers = config.num_workers
        partitions = resolve_num_partitions(num_partitions, config.world_size, workers)
        settings = _checkpoint_settings(
            workers,
            prefetch_factor,
            checkpoint_every_n_samples,
            checkpoint_every_sec,
            n_checkpoints,
            gc_collect_every_n_steps,
            gc_freeze_at_start,
        )
        if (
            isinstance(worker_reply_timeout, bool)
            or not isinstance(worker_reply_timeout, (int, float))
            or worker_reply_timeout <= 0
        ):
            raise ValueError(
                "`worker_reply_timeout` must be a positive number of seconds "
                f"(got {worker_reply_timeout!r})"
            )
        validate_transport_settings(transport_codec, transport_inline_bytes, transport_arena_bytes)
        require_int(items_per_transfer, "items_per_transfer", minimum=1)
        self._transport = (
            Transport(transport_inline_bytes, transport_arena_bytes)
            if transport_codec and workers
            else None
        )
        self._mp_context = _resolve_mp_context(multiprocessing_context) if workers else None
        if self._mp_context is not None and self._mp_context.get_start_method() != "fork":
            _check_serializable(dataset)
        self._pipeline = dataset
        self._worker_config = config
        self._num_partitions = partitions
        self._worker_side = WorkerSideDataset(
            dataset, config, settings, self._canonical_plan(0), savable=self._savable
        )
        self._worker_side.items_per_transfer = items_per_transfer
        self._reply_timeout = float(worker_reply_timeout)
        self._progress = _Progress(max(1, workers))
        self._inner: Iterator[Any] | Unbundler | None = None
        self._generation = 0
        self._failure: WorkerError | None = None
        self._request_ids = itertools.count()
        self._parent_channels: list[Connection] = []
        # Per logical worker, what its items brought: snapshots and which partition made each
        # item (see worker_process). A save is computed from these, with no round trip.
        self._books: list[PositionBook] = []
        # Set by integrations whose trainer fetches ahead of training (see state_dict()).
        self.held_back_source: Callable[[], int] | None = None
        self._metrics = _make_metrics(self, stall)
        dataset.bind(config.context(0))
        self._config_cache = dataset.config()
        dataset.reset_state()
        super().__init__(
            self._worker_side,
            batch_size=None,
            num_workers=workers,
            collate_fn=_identity,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if workers else None,
            persistent_workers=workers > 0,
            multiprocessing_context=self._mp_context,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            pin_memory_device=pin_memory_device,
        )

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> _LoaderIterator:  # type: ignore[override]
        """Continue the current epoch if it has items left, otherwise start the next one."""
        progress = self._progress
        continuation = progress.in_epoch and not progress.epoch_ended
        if not continuation:
            self._begin_epoch()
        return _LoaderIterator(self, continuation)

    def _begin_epoch(self) -> None:
        """Start the next epoch (or the first), from the canonical partition assignment."""
        progress = self._progress
        if progress.epoch_ended:
            if not self._is_canonical():
                # A restore rotated the workers or partitions: put every partition back where
                # a new epoch expects it (only this rank's own partitions move).
                self.restore_state_rank(self.save_state_rank())
                progress = self._progress
            progress.start_epoch(progress.start % self._worker_config.world_size)
            self._inner = None
        progress.in_epoch = True

    def _end_epoch(self) -> None:
        progress = self._progress
        progress.in_epoch = False
        progress.epoch_ended = True
        progress.next_worker = 0
        self._inner = None

    def _pull(self) -> Any:
        """The next raw item of the current epoch (a ``WorkerItem``)."""
        inner = self._inner
        if inner is None:
            if self.num_workers > 0 and self._iterator is None:
                self._open_channels()
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
        return next(inner)

    def _canonical_plan(self, start: int) -> RunPlan:
        config = self._worker_config
        layout = PartitionLayout(self._num_partitions, config.world_size, config.num_workers, start)
        return RunPlan(self._num_partitions, layout.worker_slots(config.rank))

    def _is_canonical(self) -> bool:
        """Workers unrotated and running the partitions a new epoch gives them."""
        side = self._worker_side
        start = self._progress.start % self._worker_config.world_size
        canonical = self._canonical_plan(start).workers
        return side.offset == 0 and all(
            a.partitions == b.partitions for a, b in zip(side.plan.workers, canonical)
        )

    @property
    def epoch(self) -> int:
        """The epoch of the item handed out last (0 before the first; read after each item).

        After an epoch's end was reported it is the epoch the next ``iter()`` starts. A loader
        restored from a state saved right after an epoch's last item moves on to the next
        epoch with its first item, so read it after each item rather than before.
        """
        progress = self._progress
        return progress.epoch + (1 if progress.epoch_ended else 0)

    @property
    def num_partitions(self) -> int:
        """P: the logical partitions of the whole job (see :mod:`energy_loader.partitions`)."""
        return self._num_partitions

    def __len__(self) -> int:
        """Items per epoch for this rank, when every stage's length is known."""
        pipeline, config = self._pipeline, self._worker_config
        layout = PartitionLayout(self._num_partitions, config.world_size, config.num_workers)
        total = 0
        try:
            for partition in layout.rank_partitions(config.rank):
                pipeline.bind(config.partition_context(partition, self._num_partitions))
                total += len(pipeline)  # type: ignore[arg-type]
        finally:
            pipeline.bind(config.context(0))
        return total

    def _open_channels(self) -> None:
        context = self._mp_context or multiprocessing.get_context()
        pairs = [context.Pipe(duplex=True) for _ in range(self.num_workers)]
        self._parent_channels = [parent for parent, _ in pairs]
        self._worker_side.channels = [child for _, child in pairs]
        self._books = [self._starting_book(logical) for logical in range(self.num_workers)]
        side = self._worker_side
        side.bundle_limits = context.RawArray("i", [side.items_per_transfer] * self.num_workers)
        self._open_transport()

    def _starting_book(self, logical: int) -> PositionBook:
        """A book for logical worker ``logical`` about to start: its pending position first."""
        settings = self._worker_side.settings
        book = PositionBook(settings.capacity, settings.in_flight)
        book.add(-1, Snapshot.at(*self._pending_position(logical)))
        return book

    def _open_transport(self) -> None:
        if self._transport is not None:
            self._worker_side.transport = self._transport.open(self.num_workers)

    def _shutdown_workers(self) -> None:
        self._inner = None
        if self._iterator is not None:
            self._iterator._shutdown_workers()  # type: ignore[attr-defined]
            self._iterator = None
        for channel in self._parent_channels:
            channel.close()
        self._parent_channels = []
        self._books = []
        self._worker_side.channels = None
        if self._transport is not None:
            self._transport.close()
        self._worker_side.transport = None

    def _live_workers(self) -> list[Any]:
        iterator = self._iterator
        return list(getattr(iterator, "_workers", [])) if iterator is not None else []

    def _worker_error(self, error: BaseException) -> WorkerError:
        text = str(error)
        physical = None
        match = _WORKER_IN_MESSAGE.search(text)
        if match is not None:
            physical = int(match.group(1))
        else:  # "DataLoader worker (pid(s) 4771) exited unexpectedly": find it by pid
            pids = {int(p) for p in _PIDS_IN_MESSAGE.findall(text)}
            workers = self._live_workers()
            physical = next((i for i, w in enumerate(workers) if w.pid in pids), None)
        logical = None
        if physical is not None:
            logical = (physical + self._worker_side.offset) % self.num_workers
        who = f"worker {logical}" if logical is not None else "a worker"
        return WorkerError(
            f"{who} of the data loader failed: {type(error).__name__}: {text}",
            worker_id=logical,
            original_traceback=text,
        )

    # -- saving ----------------------------------------------------------------------------

    def _fail(self, failure: WorkerError) -> None:
        """Stop the workers now and refuse to save until a restore or reset.

        Stopping here, not when the loader is garbage collected, matters: the traceback keeps
        the loader alive in a reference cycle, and torch's shutdown from the cycle collector
        waits 5 s for each worker. Refusing to save matters more: the workers' positions died
        with them, and a fresh-looking state would silently restart the epoch.
        """
        self._failure = failure
        self._shutdown_workers()

    def save_state_rank(self, *, held_back: int = 0) -> dict[str, Any]:
        """This rank's exact position as plain data (json-able, weights_only-loadable).

        ``held_back=n`` saves the position as of ``n`` items before the last one handed out
        (at most 2): for a consumer that fetches ahead of what it has trained on, such as
        Lightning with a loader of unknown length. Raises ``WorkerError`` after a worker
        failed, until ``restore_state_rank`` (from the last state saved before the failure)
        or ``reset_state``.
        """
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
        plan = self._worker_side.plan
        workers, partitions = [], []
        for logical, (entries, following) in enumerate(self._positions(mark)):
            slots = plan.workers[logical]
            workers.append(WorkerSlots(slots.partitions, following, mark.done[logical]))
            for partition, (checkpoint, skip, done) in zip(slots.partitions, entries):
                partitions.append(PartitionState(partition, checkpoint, skip, done))
        config = self._worker_config
        state = RankState(
            rank=config.rank,
            world_size=config.world_size,
            num_workers=self.num_workers,
            num_partitions=self._num_partitions,
            config=self._config_cache,
            epoch=progress.epoch,
            in_epoch=progress.in_epoch or held_back > 0,
            epoch_ended=progress.epoch_ended and held_back == 0,
            delivered=mark.delivered,
            start=progress.start,
            next_worker=mark.next_worker,
            workers=tuple(workers),
            partitions=tuple(partitions),
        )
        self._metrics.save(clock() - began)
        return state.to_plain()

    def _positions(self, mark: _Mark) -> list[Position]:
        """Each logical worker's partitions' (checkpoint, skip, done) and its next slot."""
        side = self._worker_side
        count = max(1, self.num_workers)
        if self.num_workers == 0:
            runner = side.local_runner
            if runner is None or not runner.started:
                return [self._pending_position(0)]
            return [runner.position_at(mark.last_index[0])]
        if self._iterator is None or not self._books:
            return [self._pending_position(w) for w in range(count)]
        return [
            self._books[w].position_at(mark.last_index[w], epoch_ended=mark.done[w])
            for w in range(count)
        ]

    def _pending_position(self, logical: int) -> Position:
        """The position of a worker that has not started: its restore states, or fresh."""
        plan = self._worker_side.plan
        slots = plan.workers[logical]
        entries = []
        for partition in slots.partitions:
            restore = None if plan.restores is None else plan.restores[partition]
            if restore is not None:
                entries.append((restore.checkpoint, restore.skip, restore.done))
            else:
                entries.append((self._fresh_checkpoint(partition), 0, False))
        return entries, slots.next

    def _fresh_checkpoint(self, partition: int) -> dict[str, Any]:
        pipeline, config = self._pipeline, self._worker_config
        try:
            pipeline.bind(config.partition_context(partition, self._num_partitions))
            pipeline.reset_state()
            return pipeline.save_state()
        finally:
            pipeline.bind(config.context(0))

    def _await_reply(self, physical: int, logical: int, request: int) -> Any:
        channel = self._parent_channels[physical]
        deadline = time.monotonic() + self._reply_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(
                    f"worker {logical} did not answer a request within "
                    f"{self._reply_timeout:.0f} s (worker_reply_timeout)",
                    worker_id=logical,
                )
            if channel.poll(min(0.05, remaining)):
                try:
                    status, reply_id, payload = channel.recv()
                except (EOFError, OSError) as error:
                    raise WorkerError(
                        f"worker {logical} closed its command channel", worker_id=logical
                    ) from error
                if reply_id != request:
                    continue
                if status != "ok":
                    raise WorkerError(
                        f"worker {logical} failed to answer a request:\n{payload}",
                        worker_id=logical,
                        original_traceback=payload,
                    )
                return payload
            workers = self._live_workers()
            if physical < len(workers) and not workers[physical].is_alive():
                raise WorkerError(
                    f"worker {logical} (pid {workers[physical].pid}) died with exit code "
                    f"{workers[physical].exitcode} before answering a request",
                    worker_id=logical,
                )

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

    def restore_from_states(self, states: list[RankState]) -> None:
        """Restore this rank from some or all ranks' decoded states of one save."""
        plan = self.plan_restore(states)
        self._shutdown_workers()
        side = self._worker_side
        side.plan = RunPlan(self._num_partitions, plan.workers, plan.restores)
        side.offset = plan.offset
        side.drop_runner()
        workers = len(plan.workers)
        progress = self._progress = _Progress(workers)
        progress.done = [w.done for w in plan.workers]
        progress.next_worker = plan.next_worker
        progress.epoch = plan.epoch
        progress.in_epoch = plan.in_epoch
        progress.epoch_ended = plan.epoch_ended
        progress.delivered = plan.delivered
        progress.start = plan.start
        progress.marks.clear()
        progress.marks.append(progress.mark())
        self._inner = None
        self._failure = None
        self._generation += 1

    def plan_restore(self, states: list[RankState]) -> RestorePlan:
        """Check ``states`` against this loader and plan its restore (changes nothing).

        Raises ``StateMismatchError`` for another pipeline or partitioning, and
        ``StateFormatError`` for a checkpoint the pipeline cannot read.
        """
        scale = 1
        for state in states:
            scale = self._check_compatible(state)
        config = self._worker_config
        plan = plan_restore(
            states,
            rank=config.rank,
            world_size=config.world_size,
            num_workers=self.num_workers,
            num_partitions=self._num_partitions,
            scale=scale,
        )
        self._validate_checkpoints(plan.restores)
        return plan

    def _check_compatible(self, state: RankState) -> int:
        """Raise ``StateMismatchError`` unless the pipeline fits; returns the replay scale."""
        differences = config_differences(state.config, self._config_cache)
        scale = _batch_size_scale(differences, self._config_cache)
        if scale is None:
            raise StateMismatchError(
                "the state belongs to a different pipeline: " + describe_differences(differences)
            )
        return scale

    def _validate_checkpoints(self, restores: dict[int, PartitionState]) -> None:
        """Decode every partition checkpoint in the main process so errors surface here."""
        pipeline, config = self._pipeline, self._worker_config
        try:
            for partition, entry in restores.items():
                pipeline.bind(config.partition_context(partition, self._num_partitions))
                try:
                    pipeline.restore_state(entry.checkpoint)
                except StateFormatError as error:
                    raise StateFormatError(f"partition {partition} checkpoint: {error}") from None
        finally:
            pipeline.reset_state()
            pipeline.bind(config.context(0))

    def reset_state(self) -> None:
        """Forget all progress: the next ``iter()`` starts epoch 0 from scratch."""
        self._shutdown_workers()
        self._worker_side.plan = self._canonical_plan(0)
        self._worker_side.offset = 0
        self._worker_side.drop_runner()
        self._progress = _Progress(max(1, self.num_workers))
        self._inner = None
        self._failure = None
        self._generation += 1

    # -- across ranks ------------------------------------------------------------------------

    @property
    def worker_config(self) -> WorkerConfig:
        """The rank/worker layout this loader runs with."""
        return self._worker_config

    def save_state_global(self, dst_rank: int = 0) -> list[dict[str, Any]] | None:
        """Gather every rank's state to ``dst_rank``: a list there, ``None`` elsewhere.

        A collective: every rank of the data-parallel group must call it.
        """
        from ..distributed import save_state_global

        return save_state_global(self, dst_rank)

    def restore_state_global(
        self, states: list[dict[str, Any]] | None, *, src_rank: int | None = None
    ) -> None:
        """Restore every rank from the list of all ranks' states.

        Either every rank passes the full list (``src_rank=None``), or only ``src_rank``
        passes it and it is scattered. A collective over the data-parallel group in both forms
        when torch.distributed is initialised: a state that does not fit on any rank raises on
        every rank.
        """
        from ..distributed import restore_state_global

        restore_state_global(self, states, src_rank=src_rank)

    # -- torch.distributed.checkpoint Stateful protocol --------------------------------------

    def state_dict(self, *, held_back: int | None = None) -> dict[str, Any]:
        """This rank's state as one JSON string leaf per partition it runs.

        ``held_back`` is passed to :meth:`save_state_rank`. Left at ``None`` (how DCP and
        trainers call it), it is ``held_back_source()`` when an integration set that attribute
        -- :class:`energy_loader.integrations.lightning.SavableLoaderCallback` does, because
        Lightning may hold a fetched batch it has not trained on when it saves -- and 0
        otherwise.

        ``{"partition_00003": "<JSON>", ...}``: each leaf holds one partition's state and its
        rank's position, so the leaves of all ranks together are the whole job's state, under
        keys that do not depend on the layout. ``torch.distributed.checkpoint`` (DCP) stores
        them leaf by leaf under one common key for the loader on every rank, and a job saved
        on ``R`` ranks loads on ``R'``: a loader that has not started yet lists every
        partition of the job (all fresh, identical on every rank), so a DCP load into a fresh
        loader reads every partition and each rank takes the ones it now runs. String leaves
        also avoid DCP's deduplication of equal leaves and its load into the *shape* of a
        fresh state, which a shuffle buffer's state does not keep. ``torch.save`` and
        ``json`` take the dict as is; :meth:`load_state_dict` reads it back.
        """
        if held_back is None:
            held_back = 0 if self.held_back_source is None else self.held_back_source()
        if self._is_fresh() and held_back == 0:
            states = [self._fresh_rank_state(r) for r in range(self._worker_config.world_size)]
        else:
            states = [RankState.from_plain(self.save_state_rank(held_back=held_back))]
        return partition_entries(states)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output (from any layout with the same partitions)
        or from a plain ``save_state_rank()`` state."""
        if (
            isinstance(state_dict, dict)
            and state_dict
            and all(isinstance(k, str) and k.startswith(PARTITION_KEY_PREFIX) for k in state_dict)
        ):
            self.restore_from_states(states_from_entries(state_dict))
            return
        self.restore_state_rank(state_dict)

    def _is_fresh(self) -> bool:
        progress = self._progress
        return (
            progress.epoch == 0
            and not progress.in_epoch
            and not progress.epoch_ended
            and self._worker_side.plan.restores is None
        )

    def _fresh_rank_state(self, rank: int) -> RankState:
        """What rank ``rank`` of this layout saves before it starts: every partition fresh."""
        config = self._worker_config
        workers = PartitionLayout(
            self._num_partitions, config.world_size, config.num_workers
        ).worker_slots(rank)
        partitions = tuple(
            PartitionState(p, self._fresh_checkpoint(p)) for w in workers for p in w.partitions
        )
        return RankState(
            rank=rank,
            world_size=config.world_size,
            num_workers=self.num_workers,
            num_partitions=self._num_partitions,
            config=self._config_cache,
            epoch=0,
            in_epoch=False,
            epoch_ended=False,
            delivered=0,
            start=0,
            next_worker=0,
            workers=workers,
            partitions=partitions,
        )

    # -- observing ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What the loader has been doing, as plain numbers: see :mod:`energy_loader.metrics`.

        ``{"since_last": {...}, "total": {...}, "queue_depth": [...]}``: per section the
        items handed out and items/s, the time ``next()`` waited (mean, p50/p90/p99, max,
        and as a fraction of the step time), decoding, saves and their latency, and per worker
        its busy fraction, checkpoint and encode seconds and payload bytes. Asks each worker
        over its command channel (a round trip, not a wait for a sample). Example::

            if step % 100 == 0:
                print(energy_loader.metrics.flatten(loader.stats()))
        """
        return self._metrics.stats()

    def peek_keys(self, n: int) -> list[Any]:
        """The restore keys of the next ``n`` items this rank will yield, without taking them.

        How: save this rank's state and run a throwaway copy of the pipeline from it in this
        process, the way a restore would, emulating the workers' round-robin (see
        :mod:`energy_loader.peek`). Exact by the same argument as save/restore, and the live
        loader is untouched: nothing is pulled from its workers and nothing buffered, so a
        later save needs no special case. Cost: one save plus making the replayed and the
        ``n`` peeked items once more in this process (global RNG states are kept). Keys run
        on across an epoch end into the epoch the next ``iter(loader)`` starts; fewer than
        ``n`` only if the pipeline has no more items at all.
        """
        from .peek import peek_keys

        return peek_keys(self, n)

    # -- the rest --------------------------------------------------------------------------

    def restore_sample(self, key: Any) -> Any:
        """Rebuild the sample (or batch) that carried ``key``."""
        from ..dataset import attach_restore_key
        from ..state.plain import to_key

        key = to_key(key)
        with active_worker(self._worker_config.context(0)):
            return attach_restore_key(self._pipeline.restore_sample(key), key)

    def config(self) -> dict[str, Any]:
        """The pipeline's configuration plus the loader's layout."""
        config = self._worker_config
        return {
            "pipeline": self._config_cache,
            "rank": config.rank,
            "world_size": config.world_size,
            "num_workers": self.num_workers,
            "num_partitions": self._num_partitions,
            "seed": config.seed,
        }

    def close(self) -> None:
        """Stop the worker processes now, keeping the position: the next ``iter()`` restarts
        them exactly where the loader stood.

        Frameworks that keep the loader in reference cycles (trainers, accelerators) free it
        through the cyclic garbage collector, where torch's own shutdown waits up to 5 s per
        worker; call this (or use the loader as a context manager) when done with it.
        """
        if self._iterator is None or self._failure is not None:
            self._shutdown_workers()
            return
        self.restore_state_rank(self.save_state_rank())

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

    _savable = False

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.num_workers > 0 and self._iterator is None:
            self._open_transport()
        with self._worker_side.iterated_by_owner():
            inner = DataLoader.__iter__(self)
        return inner if self._transport is None else map(decode, inner)

    def save_state_rank(self, *, held_back: int = 0) -> dict[str, Any]:
        raise TypeError("BasicDataLoader does not save state; use SavableDataLoader")

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        raise TypeError("BasicDataLoader does not restore state; use SavableDataLoader")


def _make_metrics(loader: SavableDataLoader, stall: Any) -> LoaderMetrics:
    """The loader's stats and stall check (by weak reference: no cycle keeps workers alive)."""
    import weakref

    from .stall import StallWarner

    workers = loader._worker_config.num_workers
    owner = weakref.ref(loader)

    def poll() -> Any:
        live = owner()
        if live is None:
            return [None] * max(1, workers), [0] * max(1, workers)
        return poll_loader(live)

    warner = None if stall is None else StallWarner(workers, stall.threshold)
    return LoaderMetrics(max(1, workers), poll, stall, warner)


def _resolve_mp_context(value: Any) -> Any:
    if value is None:
        return multiprocessing.get_context()
    if isinstance(value, str):
        try:
            return multiprocessing.get_context(value)
        except ValueError:
            raise ValueError(
                f"`multiprocessing_context` must be 'fork', 'spawn' or 'forkserver' (got {value!r})"
            ) from None
    if hasattr(value, "get_start_method"):
        return value
    raise TypeError(
        "`multiprocessing_context` must be a start method name or a multiprocessing context "
        f"(got {type(value).__name__})"
    )


def _checkpoint_settings(
    workers: int,
    prefetch_factor: Any,
    every_n: Any,
    every_sec: Any,
    n_checkpoints: Any,
    gc_every_n: Any,
    gc_freeze: Any,
) -> CheckpointSettings:
    if workers:
        require_int(prefetch_factor, "prefetch_factor", minimum=1)
    elif prefetch_factor not in (None, 2):
        raise ValueError("`prefetch_factor` only applies with num_workers > 0")
    require_int(every_n, "checkpoint_every_n_samples", minimum=1)
    if every_sec is not None and (
        isinstance(every_sec, bool) or not isinstance(every_sec, (int, float)) or every_sec <= 0
    ):
        raise ValueError(
            "`checkpoint_every_sec` must be a positive number of seconds or None "
            f"(got {every_sec!r})"
        )
    if gc_every_n is not None:
        require_int(gc_every_n, "gc_collect_every_n_steps", minimum=1)
    require_bool(gc_freeze, "gc_freeze_at_start")
    # Items a worker may have made that the user has not received: torch keeps up to
    # prefetch_factor * num_workers tasks outstanding, all on one worker once the others have
    # ended their epoch; plus one for the pin-memory thread, plus the items a held-back save
    # may reach back.
    in_flight = (prefetch_factor or 0) * workers + 1 + MAX_HELD_BACK
    needed = math.ceil(in_flight / every_n) + 2
    if n_checkpoints is None:
        n_checkpoints = needed
    require_int(n_checkpoints, "n_checkpoints", minimum=1)
    if n_checkpoints < needed:
        raise ValueError(
            f"n_checkpoints={n_checkpoints} cannot cover the {in_flight} items that may be in "
            f"flight per worker (prefetch_factor={prefetch_factor} x num_workers={workers} + 1, "
            f"+ {MAX_HELD_BACK} for held-back saves) "
            f"at checkpoint_every_n_samples={every_n}; use n_checkpoints >= {needed}"
        )
    return CheckpointSettings(
        every_n=every_n,
        every_sec=None if every_sec is None else float(every_sec),
        capacity=n_checkpoints,
        in_flight=in_flight,
        gc_every_n=gc_every_n,
        gc_freeze=gc_freeze,
    )


def _batch_size_scale(differences: list[ConfigDifference], config: dict[str, Any]) -> int | None:
    """1 when nothing differs; the saved/now batch-size ratio when only that differs.

    A smaller batch size that divides the saved one is accepted when the batch is the
    outermost stage that keeps state (only pass-through wrappers above it), so a replay of
    ``k`` saved batches is a replay of ``k * ratio`` new ones.
    """
    if not differences:
        return 1
    if len(differences) != 1:
        return None
    (difference,) = differences
    if not difference.field or difference.field[-1] != "batch_size":
        return None
    saved, now = difference.saved, difference.now
    if not (isinstance(saved, int) and isinstance(now, int)) or now <= 0 or saved % now:
        return None
    node = config
    for name in difference.field[:-1]:
        if node.get("type") not in _PASS_THROUGH_TYPES or name != "inner":
            return None
        node = node[name]
    if node.get("type") != "BatchDataset":
        return None
    return saved // now


_PASS_THROUGH_TYPES = ("MapDataset", "FilterDataset", "GcDataset")
