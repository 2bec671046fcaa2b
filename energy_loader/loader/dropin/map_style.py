"""The drop-in loader over a map-style dataset: torch's batches, our transport, exact resume.

How it runs. The loader is a torch ``DataLoader`` initialised with the user's own arguments
(torch validated them and set every attribute). It iterates through an *internal* plain torch
DataLoader, the engine, over a :class:`~energy_loader.workers.fetch.BatchFetcher`: the engine
gets ``batch_size=None`` and a sampler of tasks (:class:`_TaskSampler`); each task is one or
several consecutive units of the user's index sampler (a bundle: it starts at one unit per
task each epoch and grows to ``items_per_transfer`` while units are small and quick to make),
and the engine gets the user's generator, ``worker_init_fn``, ``persistent_workers``,
``timeout``, ``pin_memory``, ``multiprocessing_context`` and ``prefetch_factor``, so base-seed
draws, worker seeds and worker lifetimes are torch's. Batches come back encoded by the
transport codec and are handed out one at a time, in the sampler's order (``in_order=False``
is accepted, and ignored: a saved position is a count of batches handed out).

What a save records (:class:`~energy_loader.loader.dropin.state.MapState`): the epoch, the
batches handed out in it (not those prefetched), the epoch's seed, and how its index stream
began (:mod:`energy_loader.loader.dropin.sampling`). A restore re-runs the sampler to that
point on the first ``iter()`` and continues from there, on any ``num_workers``.

Epochs. Like torch, every ``iter(loader)`` starts a new epoch, except the first after a
restore, which continues the saved epoch -- or starts the next one when the saved epoch had
no batches left (saved after its last batch).
"""

from __future__ import annotations

import collections
import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, Sampler

from ...metrics import WORKER_FIELDS, LoaderMetrics, clock
from ...torch_internals import ExceptionWrapper, WorkersDataLoader, shut_down_workers_of
from ...transport import Transport
from ...worker import WorkerConfig
from ...workers.bundling import BUNDLE_SECONDS, bundle_bytes
from ...workers.fetch import BatchFetcher, FetchResult, FetchTask, WorkerInit
from . import global_rngs
from .epoch_begin import EpochBeginning
from .job import agree_on_job
from .pin import Pin
from .position import (
    own_generators_digest,
    saved_after_last_batch,
)
from .restore import DropInRestore
from .sampling import (
    PrivateGlobal,
    SamplerRng,
    describe_chain,
    epoch_global_state,
    epoch_seed,
    job_seed,
)
from .state import JobStart, MapState
from .stream import (
    Epoch,
    IndexStream,
    check_restorable,
    distributed_config,
    sampled_length,
)
from .values import ValuesCheck

__all__ = ["MapEngine"]

_END = object()


def _identity(item: Any) -> Any:
    return item


class _TaskSampler(Sampler[FetchTask]):
    """The engine's sampler: each ``iter()`` opens the epoch's task stream."""

    def __init__(self, engine: MapEngine) -> None:
        self.engine = weakref.ref(engine)

    def __iter__(self) -> Iterator[FetchTask]:
        engine = self.engine()
        if engine is None:
            raise RuntimeError("the drop-in loader that owned this sampler is gone")
        return engine.open_stream()


class MapEngine(EpochBeginning, DropInRestore):
    """Runs and records a map-style drop-in loader (owned by the loader, one per loader)."""

    def __init__(
        self,
        loader: DataLoader[Any],
        worker_config: WorkerConfig,
        *,
        seed_per_sample: bool,
        items_per_transfer: int,
        transport: Transport | None,
        verify_restore: bool = True,
    ) -> None:
        # No reference back to the loader (nor from the task sampler to this engine): a cycle
        # would leave the workers to the cyclic garbage collector, where torch's shutdown
        # waits seconds per worker.
        self.num_workers = loader.num_workers
        self._owner = weakref.ref(loader)  # for torch's len(): no cycle
        self.persistent_workers = loader.persistent_workers
        collate = loader.collate_fn
        if collate is torch.utils.data.default_collate:
            # The same batches (tuples excepted, see default_collate), stacked straight into
            # the worker's shared-memory arena.
            from ...wrappers.collate import default_collate

            collate = default_collate
        self.fetcher = BatchFetcher(
            loader.dataset,
            collate,
            auto_collation=loader.batch_sampler is not None,
            seed_per_sample=seed_per_sample,
            prove=verify_restore,  # the digest of each batch's values (values.py)
        )
        index_sampler = index_sampler_of(loader)
        self.rng = rng = SamplerRng(loader.generator, index_sampler)
        # The global RNGs the sampler may draw from unseen, watched at each epoch's start.
        self.watched = global_rngs.watched(rng.uses_global)
        # The index stream and where it stands (stream.py): what a save records, what a
        # restore re-derives and checks.
        self.stream = IndexStream(
            index_sampler,
            rng,
            length=_length_of(loader),
            config=_config_of(loader, rng),
            unit_size=1 if loader.batch_size is None else int(loader.batch_size),
            drop_last=bool(loader.drop_last),
            verify=verify_restore,
        )
        if verify_restore:  # a restore re-makes the last batch and checks its values
            self.stream.values_check = ValuesCheck(self.fetcher, loader, seed_per_sample)
        self.index_sampler = index_sampler
        self.stateful = self.stream.stateful
        self.distributed = self.stream.distributed
        self.base_seed_generator = loader.generator or torch.default_generator
        # The base-seed draw this iter() must take back ("undo") or add ("draw") so that the
        # loader's generator moves as in the uninterrupted job (see iterate()).
        self.base_fixup: str | None = None
        self.before_base_seed: torch.Tensor | None = None
        self.job: JobStart | None = None  # set at the job's first iter()
        # The job's start, pinned by a save before the first iter() or restored from one
        # (pin.py); taken by the next iter().
        self.pin: Pin | None = None
        self.worker_config = worker_config
        self.agreed = False  # whether the ranks agreed on self.job (at an iter())
        # Whether the ranks share one dataset's epochs (and so one job seed): a loader without
        # a DistributedSampler may run on some ranks only (evaluation on rank 0).
        self.shares_job = self.distributed is not None and self.distributed.num_replicas > 1
        self.items_per_transfer = items_per_transfer
        self.max_bytes = bundle_bytes(None if transport is None else transport.arena_bytes)
        self.bundle = 1
        self.transport = transport if loader.num_workers > 0 else None
        with warnings.catch_warnings():  # torch warned about num_workers once already
            warnings.simplefilter("ignore")
            self.torch_loader = WorkersDataLoader(
                self.fetcher,
                batch_size=None,
                sampler=_TaskSampler(self),
                num_workers=loader.num_workers,
                collate_fn=_identity,
                pin_memory=loader.pin_memory,
                timeout=loader.timeout,
                worker_init_fn=WorkerInit(loader.worker_init_fn),
                multiprocessing_context=loader.multiprocessing_context,
                generator=loader.generator,
                prefetch_factor=loader.prefetch_factor,
                persistent_workers=loader.persistent_workers,
                pin_memory_device=loader.pin_memory_device,
            )
        self.epoch: Epoch | None = None  # None: never iterated
        self.pending: MapState | None = None  # a restore waiting for the next iter()
        self.generation = 0
        self.torch_iterator: Any = None
        # stats(): the main process's waits and saves, and per worker what its trips took.
        workers = max(1, loader.num_workers)
        self.worker_counters = [dict.fromkeys(WORKER_FIELDS, 0.0) for _ in range(workers)]
        self.trips = 0
        self.born = clock()
        self.metrics = LoaderMetrics(workers, self._poll, None)

    @property
    def state_config(self) -> dict[str, Any]:
        """What a state must agree with (dataset, sampler, generators, batching)."""
        return self.stream.config

    def rank_length(self) -> int:
        """torch's ``len(loader)``: batches per epoch (the sampler's length)."""
        loader = self._owner()
        if loader is None:
            raise RuntimeError("the drop-in loader that owned this engine is gone")
        return DataLoader.__len__(loader)

    def _poll(self) -> tuple[list[dict[str, float] | None], list[int]]:
        now = clock() - self.born
        return [{**c, "wall_s": now} for c in self.worker_counters], []

    # -- iteration -----------------------------------------------------------------------------

    def iterate(self) -> _MapIterator:
        """A new epoch (or the restored one): torch's ``iter(loader)``."""
        pending = self.pending
        if pending is not None and pending.started and self.stream.verify:
            self._check_global_rngs(pending)  # (raises with the restore still pending)
        self.generation += 1
        self.pending = None
        previous = self.epoch
        if pending is not None:
            self.job = pending.job
        saved = self.job
        pin, self.pin = self.pin, None
        if pin is not None:  # the job's first iter(), its start pinned by a save (pin.py)
            fresh, job = True, pin.job_for(pending, self.worker_config, self.base_seed_generator)
        elif saved is None or saved.seed is None:  # the job's first iter()
            persistent = self.persistent_workers if saved is None else saved.persistent
            workers = (
                self.num_workers > 0 if saved is None or saved.workers is None else saved.workers
            )
            hashed = job_seed(self.base_seed_generator)
            fresh, job = True, JobStart(hashed, persistent, workers=workers)
        else:
            fresh, job = False, saved
        if (fresh or not self.agreed) and self.shares_job:  # one job seed and id (job.py)
            job = agree_on_job(job, not fresh, self.worker_config)
            self.agreed = True
        self.job = job
        seed = job.seed
        assert seed is not None
        epoch = Epoch(0 if previous is None else previous.number + 1)
        if pending is not None and pending.started:
            epoch = self.stream.resume(pending)
        epoch.seed = epoch_seed(seed, epoch.number)
        rng = self.rng
        if rng.uses_global and rng.draws and epoch.number >= 1 and epoch.resume is None:
            order = job.order_seed
            assert order is not None
            epoch.private = PrivateGlobal(epoch_global_state(order, epoch.number))
        if pin is not None:
            self._start_pinned(epoch, pin, restored=pending is not None)
        if epoch.resume is None:
            epoch.iter_calls = job.iter_calls(epoch.number)
        self.epoch = epoch
        self.bundle = 1
        self.trips = 0
        self.metrics.new_iterator()
        new_iterator = self.torch_iterator is None or not self.persistent_workers
        if not self.persistent_workers and self.torch_iterator is not None:
            shut_down_workers_of(self.torch_iterator)
            self.torch_iterator = None
        if self.transport is not None and new_iterator:
            self.fetcher.transport = self.transport.open(self.num_workers)
        # torch draws a base seed from the loader's generator when it makes a new internal
        # iterator (every epoch, or once with persistent workers). The job draws one per
        # epoch (once, at epoch 0, if it started with persistent workers) and none in a
        # restored epoch (the saving run drew it), nor, from the second epoch on, from the
        # training process's global generator: take back or add the difference.
        from_global = self.base_seed_generator is torch.default_generator
        # (a pinned start whose generators moved draws it in the epoch's own stream: pin.py)
        elsewhere = epoch.base_draw is not None
        if epoch.resume is not None or (from_global and epoch.number >= 1) or elsewhere:
            wanted = False
        else:
            wanted = epoch.number == 0 or not job.persistent
        self.base_fixup = None
        if new_iterator != wanted:
            self.base_fixup = "undo" if new_iterator else "draw"
        self.before_base_seed = None
        self.torch_iterator = iter(self.torch_loader)
        self._fix_base_seed()  # if no pull happened inside iter() (num_workers=0)
        return _MapIterator(self, self.torch_iterator, self.generation)

    def open_stream(self) -> Iterator[FetchTask]:
        """The epoch's task stream (torch may open it twice; the one it pulls is used)."""
        epoch = self.epoch
        if epoch is None:
            raise RuntimeError("the drop-in loader's task stream was opened outside iter()")
        if epoch.resume is not None:
            epoch.iterator = epoch.resume[0]
            self._note_before_base_seed()
            return self._tasks(epoch)
        self._pay_base_draw(epoch)  # torch drew its base seed after the stream it opened last
        calls = epoch.iter_calls
        if epoch.iterator is None or calls is None or epoch.iters < calls:
            self._iter_sampler(epoch)
        # (else the job's iterator called iter(sampler) no more: this stream reuses the last)
        if epoch.base_draw == "due":
            epoch.base_draw = "owed"  # torch draws it right after this returns
        self._note_before_base_seed()
        return self._tasks(epoch)

    def _tasks(self, epoch: Epoch) -> Iterator[FetchTask]:
        self.begin(epoch)
        iterator = epoch.iterator
        assert iterator is not None
        seed = epoch.seed
        stateful = self.stateful
        recent = epoch.recent
        if stateful is not None and epoch.pulled not in epoch.snapshots:
            epoch.snapshots[epoch.pulled] = stateful.state_dict()
        while True:
            units = []
            want = self.bundle
            with epoch.sampling():
                for _ in range(want):
                    unit = next(iterator, _END)
                    if unit is _END:
                        break
                    units.append(unit)
                    recent.append((epoch.pulled, unit))
                    epoch.pulled += 1
                    if stateful is not None:
                        epoch.snapshots[epoch.pulled] = stateful.state_dict()
                if iterator.ended and not epoch.end_proof:
                    epoch.end_proof = own_generators_digest(self.rng, self.rng.capture()) or "-"
            if units:
                yield FetchTask(epoch.pulled - len(units), tuple(units), seed)
            if len(units) < want:
                epoch.exhausted = True
                return

    def received(self, result: FetchResult) -> None:
        """Count the trip for ``stats()`` (the worker that made it: torch deals trips to its
        workers in turn), and adapt the bundle size to what it cost: grow while units are
        small and quick."""
        counters = self.worker_counters[self.trips % len(self.worker_counters)]
        self.trips += 1
        counters["produce_s"] += result.seconds
        counters["items"] += result.count
        counters["bytes"] += result.nbytes
        if result.count == 0:
            return
        per_second = result.seconds / result.count
        per_bytes = result.nbytes / result.count
        target = self.items_per_transfer
        if per_second > 0:
            target = min(target, int(BUNDLE_SECONDS / per_second))
        if per_bytes > 0:
            target = min(target, int(self.max_bytes / per_bytes))
        self.bundle = max(1, min(2 * self.bundle, target))

    def handed(self, epoch: Epoch) -> None:
        epoch.hand_out()

    # -- state ---------------------------------------------------------------------------------

    def record(self, rank: int, world_size: int, held_back: int) -> MapState:
        """The position ``held_back`` batches before the last handed out (timed for stats)."""
        began = clock()
        state = self._position(rank, world_size, held_back)
        self.metrics.save(clock() - began)
        return state

    def _position(self, rank: int, world_size: int, held_back: int) -> MapState:
        epoch = self.epoch
        if self.pending is not None:
            return self.pending
        if epoch is None:
            if held_back:
                raise ValueError(f"held_back={held_back}: nothing was handed out yet")
            if self.pin is None:  # the job's start, as the next iter() takes it (pin.py)
                self.pin = Pin.now(
                    self.rng,
                    self.base_seed_generator,
                    JobStart(None, self.persistent_workers, workers=self.num_workers > 0),
                    self.watched,
                )
            return self.pin.state(rank, world_size, self.state_config)
        used = epoch.used - held_back
        if used < 0:
            raise ValueError(
                f"held_back={held_back}: only {epoch.used} batch(es) were handed out in this "
                "epoch, so there is no position that many batches back"
            )
        if epoch.start is None:  # iter() made, nothing pulled yet: the stream starts now
            self.begin(epoch)
        start = epoch.start
        assert start is not None
        rng, at_iter, rng_check, at_iter_check = start.encoded()
        drawn = start.global_start
        at_save = None if drawn is None else global_rngs.digests_now(drawn.names)
        sampler_state = None
        if self.stateful is not None:
            if used not in epoch.snapshots:
                raise ValueError(f"held_back={held_back} reaches further back than recorded")
            sampler_state = epoch.snapshots[used]
        return MapState(
            rank,
            world_size,
            self.state_config,
            True,
            epoch.number,
            used,
            self.job,
            rng,
            at_iter,
            sampler_state,
            rng_check,
            at_iter_check,
            self.stream.distributed_of(epoch),
            self.stream.proof(epoch, used),
            drawn,
            at_save,
        )

    def decode_one(self, state: Any) -> MapState:
        return MapState.from_plain(state)

    def check(self, state: MapState) -> None:
        check_restorable(state, self.stream)

    def set_distributed_rank(self, loader: DataLoader[Any], rank: int, num_replicas: int) -> None:
        """The ``DistributedSampler`` set to ``rank`` of ``num_replicas``, and what the engine
        derived from it (the length, the config a state is checked against) again."""
        sampler = self.distributed
        if sampler is None:
            raise TypeError(
                "the loader's sampler is not a DistributedSampler: a rank has no part of its own"
            )
        if self.epoch is not None or self.pending is not None:
            raise ValueError("set_distributed_rank must come before the first iter() or restore")
        size = sampled_length(sampler)
        if sampler.drop_last and size % num_replicas:
            sampler.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            sampler.num_samples = math.ceil(size / num_replicas)
        sampler.total_size = sampler.num_samples * num_replicas
        sampler.num_replicas, sampler.rank = num_replicas, rank
        self.stream.length = _length_of(loader)
        self.stream.config = _config_of(loader, self.rng)

    def stats(self) -> dict[str, Any]:
        return self.metrics.stats()

    def resumed_batches_left(self) -> int | None:
        """Batches of the restored epoch this rank has not handed out yet, while the first
        ``iter()`` after a restore runs; None in any other epoch."""
        epoch = self.epoch
        if epoch is None or not epoch.resumed:
            return None
        units = self.length if epoch.units is None else epoch.units
        return None if units is None else units - epoch.used

    def rank_free(self, state: MapState) -> bool:
        """Whether the state names the job's position, whichever rank saved it: under a
        ``DistributedSampler`` every rank has used the same number of batches."""
        return "DistributedSampler" in str(state.config.get("sampler"))

    def restored_batches_used(self) -> int | None:
        """The batches of its epoch a restored state had used, until the next ``iter()``
        (what Lightning counts from, :mod:`.trainers`); None when nothing is pending."""
        pending = self.pending
        return pending.used if pending is not None and pending.started else None

    def restore_record(self, state: MapState) -> None:
        check_restorable(state, self.stream)
        pin = Pin.of(state)
        self.shutdown()
        self.pin = pin
        self.pending = state
        self.agreed = False  # the ranks agree on the restored job at the next iter()
        self.epoch = None
        self.generation += 1

    def reset(self) -> None:
        self.shutdown()
        self.pending = None
        self.pin = None
        self.epoch = None
        self.job = None
        self.generation += 1

    def close(self) -> None:
        """Stop the workers, keeping the position: the next ``iter()`` continues the epoch."""
        if self.epoch is None or self.torch_iterator is None:
            self.shutdown()
            return
        # (the same process goes on: its global RNGs are where they belong, nothing to check,
        # nor a batch to re-make: it handed out its own)
        state = self.record(0, 1, 0)
        proof = attrs.evolve(state.proof, made=None)
        self.restore_record(attrs.evolve(state, global_rngs_at_save=None, proof=proof))
        self.agreed = True  # the same job goes on: nothing to agree on again

    def shutdown(self) -> None:
        iterator = self.torch_iterator
        self.torch_iterator = None
        if iterator is not None:
            shut_down_workers_of(iterator)
        if self.transport is not None:
            self.transport.close()
        self.fetcher.transport = None

    @property
    def epoch_number(self) -> int:
        """The epoch of the batch handed out last (0 before the first); once the epoch's end
        was reported, or after a restore of a state saved after an epoch's last batch, the
        next one (what the next ``iter()`` yields)."""
        epoch, pending = self.epoch, self.pending
        if epoch is None:
            if pending is None:
                return 0
            return pending.epoch + int(saved_after_last_batch(pending))
        return epoch.number + int(epoch.ended)


class _MapIterator:
    """What ``iter(loader)`` returns: batches one at a time, counted as handed out."""

    def __init__(self, engine: MapEngine, torch_iterator: Any, generation: int) -> None:
        self._engine = engine
        self._torch_iterator = torch_iterator
        self._generation = generation
        self._epoch = engine.epoch
        self._ready: collections.deque[Any] = collections.deque()
        self._failure: Any = None
        self._decode_s = 0.0
        self._finished = False
        self.owner: Any = None  # the loader, kept alive while this iterator is
        # Called once, before the first batch (the loader's check of its consumer, loader.py).
        self.before_first: Callable[[], None] | None = None

    def __iter__(self) -> _MapIterator:
        return self

    def __next__(self) -> Any:
        began = clock()
        engine = self._engine
        if self.before_first is not None:
            check, self.before_first = self.before_first, None
            check()
        if self._finished:
            raise StopIteration
        if self._generation != engine.generation:
            raise RuntimeError(
                "this iterator was replaced by a newer iter(loader) (each starts an epoch, as "
                "with torch's DataLoader) or by a restore; iterate the newest one"
            )
        epoch = self._epoch
        assert epoch is not None
        while not self._ready:
            if self._failure is not None:
                failure, self._failure = self._failure, None
                engine.handed(epoch)  # torch skips a failed batch too
                if isinstance(failure, ExceptionWrapper):
                    failure.reraise()
                raise failure
            try:
                result = next(self._torch_iterator)
            except StopIteration:
                self._finished = True
                epoch.ended = True
                raise
            engine.received(result)
            epoch.note_made(result.first, result.made)
            decoding = clock()
            self._ready.extend(result.batches())
            self._decode_s += clock() - decoding
            self._failure = result.failure
        engine.handed(epoch)
        decode_s, self._decode_s = self._decode_s, 0.0
        engine.metrics.item(began, decode_s)
        return self._ready.popleft()

    def __len__(self) -> int:
        length = self._engine.length
        if length is None:
            raise TypeError("the sampler has no len()")
        return length


def _config_of(loader: DataLoader[Any], rng: SamplerRng) -> dict[str, Any]:
    """What a state must agree with: dataset, sampler, generators and batching (not the
    workers)."""
    dataset = loader.dataset
    try:
        length: int | None = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        length = None
    index_sampler = index_sampler_of(loader)
    try:
        units: int | None = len(index_sampler)
    except TypeError:
        units = None
    return {
        "dataset": type(dataset).__name__,
        "dataset_length": length,
        "sampler": describe_chain(index_sampler),
        "generators": list(rng.kinds),
        **distributed_config(index_sampler),
        "batches_per_epoch": units,
        "batch_size": None if loader.batch_size is None else int(loader.batch_size),
        "drop_last": bool(loader.drop_last),
    }


def _length_of(loader: DataLoader) -> int | None:
    try:
        return len(index_sampler_of(loader))
    except TypeError:
        return None


def index_sampler_of(loader: DataLoader) -> Any:
    """What torch draws indices from: the batch sampler when batching, else the sampler."""
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
