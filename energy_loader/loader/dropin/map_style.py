"""The drop-in loader over a map-style dataset: torch's batches, our transport, exact resume.

The loader is a torch ``DataLoader`` initialised with the user's arguments; it iterates
through an internal plain torch DataLoader over a
:class:`~energy_loader.workers.fetch.BatchFetcher`, fed a sampler of tasks
(:class:`_TaskSampler`: bundles of consecutive units of the user's sampler) and given the
user's generator, ``worker_init_fn``, ``persistent_workers``, ``timeout``, ``pin_memory``,
``multiprocessing_context`` and ``prefetch_factor``, so seeds and worker lifetimes are
torch's. Batches are handed out one at a time in the sampler's order (``in_order=False`` is
accepted and ignored: a position is a count of batches handed out). A save records the epoch,
the batches handed out and how its index stream began
(:mod:`energy_loader.loader.dropin.sampling`); a restore re-runs the sampler to that point on
any ``num_workers``. Like torch, every ``iter()`` starts a new epoch, except the first after a
restore, which continues the saved one (or starts the next where it had no batches left).
"""

from __future__ import annotations

import collections
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
from ..checks import report_code_changes
from . import global_rngs
from .global_rngs import BaseSeedDraw, GlobalsAtSave, PrivateGlobal
from .job import agree_on_job
from .pin import Pin
from .position import saved_after_last_batch
from .restore import DropInRestore
from .sampling import SamplerRng, describe_chain, epoch_seed, job_seed
from .state import JobStart, MapState, code_config, code_fingerprints
from .stream import Epoch, IndexStream, check_restorable, distributed_config, point_at_rank
from .values import ValuesCheck


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


class MapEngine(DropInRestore):
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
        on_code_change: str = "warn",
    ) -> None:
        # No reference back to the loader (nor from the task sampler to this engine): a cycle
        # would leave the workers to the cyclic garbage collector, where torch's shutdown
        # waits seconds per worker.
        self.num_workers = loader.num_workers
        self._owner = weakref.ref(loader)  # for torch's len(): no cycle
        self.persistent_workers = loader.persistent_workers
        self.on_code_change = on_code_change
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
        # The index stream and where it stands (stream.py): what a save records, what a
        # restore re-derives and checks.
        self.stream = IndexStream(
            index_sampler,
            rng,
            length=_length_of(loader),
            config=_config_of(loader, rng),
            code=code_fingerprints(loader.dataset, loader.collate_fn, loader.worker_init_fn),
            unit_size=1 if loader.batch_size is None else int(loader.batch_size),
            drop_last=bool(loader.drop_last),
            verify=verify_restore,
        )
        if verify_restore:  # a restore re-makes the last batch and checks its values
            self.stream.values_check = ValuesCheck(self.fetcher, loader, seed_per_sample)
        self.index_sampler = index_sampler
        self.stateful = self.stream.stateful
        self.distributed = self.stream.distributed
        # torch's base-seed draw from the loader's generator, taken back or added at each
        # iter() so that the generator moves as in the uninterrupted job (global_rngs.py).
        self.base_seed = BaseSeedDraw(loader.generator or torch.default_generator)
        self.job: JobStart | None = None  # set at the job's first iter()
        # The job's start, pinned by a save before the first iter() or restored from one
        # (pin.py); taken by the next iter().
        self.pin: Pin | None = None
        self.worker_config = worker_config
        self.agreed = False  # whether the ranks agreed on self.job (at an iter())
        # Whether the ranks share one dataset's epochs (and so one job seed): a loader without
        # a DistributedSampler may run on some ranks only (evaluation on rank 0).
        self.shares_job = self.distributed is not None and self.distributed.num_replicas > 1
        self.transport = transport if loader.num_workers > 0 else None
        self.torch_loader = _internal_loader(loader, self.fetcher, _TaskSampler(self))
        self.epoch: Epoch | None = None  # None: never iterated
        self.pending: MapState | None = None  # a restore waiting for the next iter()
        self.generation = 0
        # What loader.skip() left out, oldest first: saved with every state.
        self.history: list[dict[str, Any]] = []
        self.torch_iterator: Any = None
        # stats(): the main process's waits and saves, and per worker what its trips took;
        # the units of the next task.
        max_bytes = bundle_bytes(None if transport is None else transport.arena_bytes)
        self.trips = _Trips(max(1, loader.num_workers), items_per_transfer, max_bytes)
        self.metrics = LoaderMetrics(len(self.trips.counters), self.trips.poll, None)

    @property
    def state_config(self) -> dict[str, Any]:
        """What a state must agree with (dataset, sampler, generators, batching)."""
        return self.stream.config

    @property
    def length(self) -> int | None:
        """Batches per epoch (the sampler's ``len()``), None without one."""
        return self.stream.length

    def rank_length(self) -> int:
        """torch's ``len(loader)``: batches per epoch (the sampler's length)."""
        loader = self._owner()
        if loader is None:
            raise RuntimeError("the drop-in loader that owned this engine is gone")
        return DataLoader.__len__(loader)

    # -- iteration -----------------------------------------------------------------------------

    def iterate(self) -> _MapIterator:
        """A new epoch (or the restored one): torch's ``iter(loader)``."""
        pending = self.pending
        if pending is not None and pending.started and self.stream.verify:
            # (raises with the restore still pending)
            global_rngs.check_restored_epoch(
                pending.start.global_start, pending.global_rngs_at_save, self.chain()
            )
        self.generation += 1
        self.pending = None
        previous = self.epoch
        pin, self.pin = self.pin, None
        job = self._job_for_iter(pending, pin)
        epoch = Epoch(0 if previous is None else previous.number + 1)
        if pending is not None and pending.started:
            epoch = self.stream.resume(pending)
        epoch.seed = epoch_seed(job.seed, epoch.number)
        if epoch.resume is None:
            epoch.iter_calls = job.iter_calls(epoch.number)
            if global_rngs.draws_in_own_stream(self.rng, epoch.number):
                state = global_rngs.epoch_stream_state(job.sampler_seed, epoch.number)
                epoch.private = PrivateGlobal(state)
        if pin is not None:  # (pin.py, global_rngs.py)
            epoch.private = global_rngs.pinned_stream(
                pin.start.states,
                pin.moved(self.rng),
                self.rng,
                base_from_global=self.base_seed.generator is torch.default_generator,
            )
            if self.stream.verify:  # checked at the sampler's first draws (stream.py)
                refuses = pending is not None
                epoch.globals_at_save = GlobalsAtSave.compare(pin.at_save, refuses=refuses)
        self.epoch = epoch
        self.trips.new_epoch()
        self.metrics.new_iterator()
        new_iterator = self.torch_iterator is None or not self.persistent_workers
        if not self.persistent_workers and self.torch_iterator is not None:
            shut_down_workers_of(self.torch_iterator)
            self.torch_iterator = None
        if self.transport is not None and new_iterator:
            self.fetcher.transport = self.transport.open(self.num_workers)
        job_draws = global_rngs.job_draws_base_seed(
            epoch.number,
            resumed=epoch.resume is not None,
            persistent=job.persistent,
            from_global=self.base_seed.generator is torch.default_generator,
            in_stream=epoch.private is not None and epoch.private.takes_base_draw(),
        )
        self.base_seed.expect(torch_draws=new_iterator, job_draws=job_draws)
        self.torch_iterator = iter(self.torch_loader)
        self.base_seed.settle()  # if no pull happened inside iter() (num_workers=0)
        return _MapIterator(self, self.torch_iterator, self.generation)

    def _job_for_iter(self, pending: MapState | None, pin: Pin | None) -> JobStart:
        """The job this ``iter()`` runs: the restored one, a pinned one, or, at the job's first
        ``iter()``, a new one (a hash of the generator torch draws the base seed from); agreed
        with the other ranks where they share the job's epochs (job.py)."""
        if pending is not None:
            self.job = pending.job
        if pin is not None:  # the job's first iter(), its start pinned by a save (pin.py)
            fresh, job = True, pin.job_for(pending, self.worker_config, self.base_seed.generator)
        elif self.job is None:  # the job's first iter()
            seed = job_seed(self.base_seed.generator)
            job = JobStart.new(
                seed, persistent=self.persistent_workers, workers=self.num_workers > 0
            )
            fresh = True
        else:
            fresh, job = False, self.job
        if (fresh or not self.agreed) and self.shares_job:  # one job seed and id (job.py)
            job = agree_on_job(job, not fresh, self.worker_config)
            self.agreed = True
        self.job = job
        return job

    def open_stream(self) -> Iterator[FetchTask]:
        """The epoch's task stream (torch may open it twice; the one it pulls is used)."""
        epoch = self.epoch
        if epoch is None:
            raise RuntimeError("the drop-in loader's task stream was opened outside iter()")
        self.stream.open(epoch)
        self.base_seed.note_before_draw()  # torch draws it right after opening the stream
        return self._task_stream(epoch)

    def begin(self, epoch: Epoch) -> None:
        """Once an epoch, before its first unit goes anywhere: torch's base-seed draw settled,
        then the index stream begun (:meth:`IndexStream.begin`)."""
        if epoch.begun:
            return
        epoch.begun = True
        self.base_seed.settle()
        self.stream.begin(epoch)

    def _task_stream(self, epoch: Epoch) -> Iterator[FetchTask]:
        self.begin(epoch)
        self.stream.snapshot_sampler(epoch)
        seed = epoch.seed
        while True:
            want = self.trips.bundle
            units = self.stream.pull(epoch, want)
            if units:
                yield FetchTask(epoch.pulled - len(units), tuple(units), seed)
            if len(units) < want:
                epoch.exhausted = True
                return

    def chain(self) -> str:
        """The sampler chain, for messages: ``"BatchSampler(RandomSampler)"``."""
        return str(self.stream.config["sampler"])

    # -- state ---------------------------------------------------------------------------------

    def state_at(self, rank: int, world_size: int, held_back: int) -> MapState:
        """The position ``held_back`` batches before the last handed out (timed for stats)."""
        began = clock()
        state = self._position_state(rank, world_size, held_back)
        if self.history:
            state = attrs.evolve(state, history=tuple(self.history))
        self.metrics.save(clock() - began)
        return state

    def record_skip(self, items: int) -> None:
        """Put on record that the last ``items`` batches handed out were skipped."""
        epoch = self.epoch
        assert epoch is not None  # (a batch was handed out)
        self.history.append({"epoch": epoch.number, "step": epoch.used - items, "skip": items})

    def _position_state(self, rank: int, world_size: int, held_back: int) -> MapState:
        epoch = self.epoch
        if self.pending is not None:
            return self.pending
        if epoch is None:
            if held_back:
                raise ValueError(f"held_back={held_back}: nothing was handed out yet")
            if self.pin is None:  # the job's start, as the next iter() takes it (pin.py)
                self.pin = Pin.now(
                    self.rng,
                    self.base_seed.generator,
                    persistent=self.persistent_workers,
                    workers=self.num_workers > 0,
                    watched=self.stream.watched,
                )
            return self.pin.state(rank, world_size, self.state_config, self.stream.code)
        used = epoch.used - held_back
        if used < 0:
            raise ValueError(
                f"held_back={held_back}: only {epoch.used} batch(es) were handed out in this "
                "epoch, so there is no position that many batches back"
            )
        if epoch.start is None:  # iter() made, nothing pulled yet: the stream starts now
            self.begin(epoch)
        job = self.job
        assert job is not None  # (set by the iter() that made the epoch)
        return self.stream.state_at(epoch, used, rank=rank, world_size=world_size, job=job)

    def decode_one(self, state: Any) -> MapState:
        return MapState.from_plain(state)

    def check(self, state: MapState) -> None:
        """``StateMismatchError`` for a state this loader's stream cannot continue."""
        check_restorable(state, self.stream)

    def plan_record(self, state: MapState) -> MapState:
        """``state`` checked (:meth:`check`), the user code's changes since its save reported
        (``on_code_change``: then its last batch's values are not checked, other code makes
        them), and carrying this loader's code fingerprints (a save before the next ``iter()``
        writes them)."""
        self.check(state)
        proof, code = state.proof, self.stream.code
        if state.code is not None and report_code_changes(
            code_config(state.code), code_config(code), self.on_code_change
        ):
            proof = attrs.evolve(proof, made="")
        return attrs.evolve(state, proof=proof, code=code)

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
        point_at_rank(sampler, rank, num_replicas)
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

    def names_job_position(self, config: dict[str, Any]) -> bool:
        """Whether a state of ``config`` names the job's position, whichever rank saved it:
        under a ``DistributedSampler`` every rank has used the same number of batches."""
        return "DistributedSampler" in str(config.get("sampler"))

    def restored_batches_used(self) -> int | None:
        """The batches of its epoch a restored state had used, until the next ``iter()``
        (what Lightning counts from, :mod:`.trainers`); None when nothing is pending."""
        pending = self.pending
        return pending.used if pending is not None and pending.started else None

    def apply_record(self, state: MapState) -> None:
        """Continue from ``state`` (checked by :meth:`plan_record`) at the next ``iter()``."""
        pin = Pin.of(state)
        self.shutdown()
        self.pin = pin
        self.history = list(state.history)
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
        self.history = []
        self.generation += 1

    def close(self) -> None:
        """Stop the workers, keeping the position: the next ``iter()`` continues the epoch."""
        if self.epoch is None or self.torch_iterator is None:
            self.shutdown()
            return
        # (the same process goes on: its global RNGs are where they belong, nothing to check,
        # nor a batch to re-make: it handed out its own)
        state = self.state_at(0, 1, 0)
        proof = attrs.evolve(state.proof, made="")
        self.apply_record(attrs.evolve(state, global_rngs_at_save=None, proof=proof))
        self.agreed = True  # the same job goes on: nothing to agree on again

    def shutdown(self) -> None:
        iterator = self.torch_iterator
        self.torch_iterator = None
        if iterator is not None:
            shut_down_workers_of(iterator)
        if self.transport is not None:
            self.transport.close()
        self.fetcher.transport = None

    def current_epoch(self) -> int:
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

    def is_current(self) -> bool:
        """Whether a ``next()`` continues the loader's stream (neither ended nor outdated)."""
        return not self._finished and self._generation == self._engine.generation

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
                epoch.hand_out()  # torch skips a failed batch too
                if isinstance(failure, ExceptionWrapper):
                    failure.reraise()
                raise failure
            try:
                result = next(self._torch_iterator)
            except StopIteration:
                self._finished = True
                epoch.ended = True
                raise
            engine.trips.count(result)
            epoch.note_made(result.first, result.made)
            decoding = clock()
            self._ready.extend(result.batches())
            self._decode_s += clock() - decoding
            self._failure = result.failure
        epoch.hand_out()
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


class _Trips:
    """The worker trips of a map-style engine: what each worker's trips made and took (``stats()``),
    and the next task's units (``bundle`` doubles while units are quick)."""

    def __init__(self, workers: int, items_per_transfer: int, max_bytes: int) -> None:
        self.counters = [dict.fromkeys(WORKER_FIELDS, 0.0) for _ in range(workers)]
        self.items_per_transfer = items_per_transfer
        self.max_bytes = max_bytes
        self.taken = 0
        self.bundle = 1
        self.born = clock()

    def new_epoch(self) -> None:
        self.taken = 0
        self.bundle = 1

    def count(self, result: FetchResult) -> None:
        """Count the trip of ``result`` and size the next task by what it cost: at most what
        fills ``BUNDLE_SECONDS`` or the transport's ``max_bytes``."""
        counters = self.counters[self.taken % len(self.counters)]
        self.taken += 1
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

    def poll(self) -> tuple[list[dict[str, float] | None], list[int]]:
        """Each worker's counters now (``LoaderMetrics``' poll; no queue depths)."""
        now = clock() - self.born
        return [{**c, "wall_s": now} for c in self.counters], []


def _internal_loader(
    loader: DataLoader[Any], fetcher: BatchFetcher, sampler: _TaskSampler
) -> WorkersDataLoader:
    """torch's ``DataLoader`` the engine runs: the user's worker, seeding and memory arguments
    over the batch fetcher, one task at a time from ``sampler``."""
    with warnings.catch_warnings():  # torch warned about num_workers once already
        warnings.simplefilter("ignore")
        return WorkersDataLoader(
            fetcher,
            batch_size=None,
            sampler=sampler,
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


def _length_of(loader: DataLoader) -> int | None:
    try:
        return len(index_sampler_of(loader))
    except TypeError:
        return None


def index_sampler_of(loader: DataLoader) -> Any:
    """What torch draws indices from: the batch sampler when batching, else the sampler."""
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
