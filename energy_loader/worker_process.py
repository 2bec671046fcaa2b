"""The worker-process side of the loader: numbering, rolling checkpoints, the command thread.

Torch's DataLoader workers iterate a :class:`WorkerSideDataset`. In each worker process it

1. makes one copy of the pipeline for each logical partition the worker runs
   (:mod:`energy_loader.partitions`), binds it to that partition's
   :class:`~energy_loader.WorkerContext` and restores the partition's saved state, replaying
   its ``skip`` items without yielding them;
2. takes its partitions round-robin, one item at a time, skipping those that ended their
   epoch, and numbers every item it yields (``index`` counts up for the life of the worker
   process; an epoch's last item is an end marker, so the main process knows this worker is
   done);
3. takes rolling checkpoints (:class:`Snapshot`: the state of all its partitions) right after
   an item is made, every ``every_n`` items (and every ``every_sec`` seconds), and when a
   partition ends its epoch or a new epoch begins, and sends each one *with the next item*,
   together with which partition made that item. The main process keeps them in a
   :class:`PositionBook` per worker, so a save is answered there, from what was delivered,
   without a round trip to a worker that is busy making a sample;
4. runs a :class:`CommandServer` thread that answers the main process's requests for its
   counters (``loader.stats()``);
5. encodes every sample with the batch codec (:mod:`energy_loader.transport`) when the loader
   uses it, so that what torch's result queue carries is a small packet, not tensors;
6. sends its items in bundles of several (:mod:`energy_loader.bundles`): one trip through
   torch's queues for many cheap items.

Physical worker ``p`` runs *logical* worker ``(p + offset) % num_workers``. Torch always
starts its round-robin at physical worker 0, so a loader restored onto its own layout sets
``offset`` to the logical worker that was due next and the order of items is what it would
have been.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import multiprocessing.util
import os
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import attrs
import dill
from torch.utils.data import IterableDataset, get_worker_info

from .bundles import bundle_bytes, bundle_items
from .dataset import SavableDataset, attach_restore_key
from .errors import StateMismatchError
from .metrics import WorkerCounters, clock
from .partitions import clone_pipeline
from .state.rank_state import PartitionState, WorkerSlots
from .transport import WorkerTransport
from .worker import WorkerConfig, active_worker, enter_worker, leave_worker, set_process_worker

__all__ = [
    "CheckpointRing",
    "CheckpointSettings",
    "PositionBook",
    "RunPlan",
    "Snapshot",
    "WorkerItem",
    "WorkerSideDataset",
]


@attrs.frozen
class CheckpointSettings:
    """When workers checkpoint, and how many items may be in flight per worker."""

    every_n: int
    every_sec: float | None
    capacity: int
    in_flight: int
    gc_every_n: int | None
    gc_freeze: bool


# An item travelling from a worker to the main process: (logical worker id, item index, is end
# marker, sample or None, the worker's slot that made it or -1, the snapshots taken since the
# previous item as ((index, Snapshot), ...) or None).
WorkerItem = tuple[int, int, bool, Any, int, Any]


class CheckpointRing:
    """The rolling checkpoints of one worker: ``(index, state)`` pairs, oldest first.

    A checkpoint is dropped only when the next one is already at or before
    ``newest_index - in_flight``: the main process has received at least that far, so the
    next one covers every save it can still ask for. ``capacity`` bounds memory; optional
    (time-based) checkpoints are not taken when the ring is full.
    """

    def __init__(self, capacity: int, in_flight: int) -> None:
        self._entries: collections.deque[tuple[int, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._capacity = capacity
        self._in_flight = in_flight

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def add(self, index: int, state: Any, *, optional: bool = False) -> bool:
        """Record the state after item ``index``; returns whether it was kept."""
        with self._lock:
            entries = self._entries
            while len(entries) >= 2 and entries[1][0] <= index - self._in_flight:
                entries.popleft()
            self._dropped_through(entries[0][0] if entries else index)
            if optional and len(entries) >= self._capacity:
                return False
            entries.append((index, state))
            return True

    def _dropped_through(self, oldest: int) -> None:
        """Hook: every checkpoint before ``oldest`` is gone (called under the lock)."""

    def find(self, last_index: int) -> tuple[Any, int]:
        """The newest checkpoint at or before ``last_index`` and how many items follow it."""
        with self._lock:
            index, state = self._find(last_index)
        return state, last_index - index

    def _find(self, last_index: int) -> tuple[int, Any]:
        for index, state in reversed(self._entries):
            if index <= last_index:
                return index, state
        oldest = self._entries[0][0] if self._entries else None
        raise RuntimeError(
            f"no checkpoint at or before item {last_index} (oldest kept: {oldest}); "
            "n_checkpoints is too small for the prefetch depth"
        )

    def __len__(self) -> int:
        return len(self._entries)


@attrs.frozen
class Snapshot:
    """One rolling checkpoint of a worker: every partition's state, in the worker's order.

    ``skips`` are items of each partition still to be replayed on top of its state (nonzero
    only for the snapshot a restored worker starts from), ``done`` which partitions had ended
    their epoch, ``next`` whose turn came next.
    """

    states: tuple[dict[str, Any], ...]
    skips: tuple[int, ...]
    done: tuple[bool, ...]
    next: int

    @classmethod
    def at(cls, entries: Sequence[tuple[dict[str, Any], int, bool]], following: int) -> Snapshot:
        """The snapshot of a position: per partition (checkpoint, skip, done), then ``next``."""
        return cls(
            tuple(state for state, _, _ in entries),
            tuple(skip for _, skip, _ in entries),
            tuple(done for _, _, done in entries),
            following,
        )


# Where a worker stands: per partition (checkpoint, skip, done), then whose turn is next.
Position = tuple[list[tuple[dict[str, Any], int, bool]], int]


class PositionBook(CheckpointRing):
    """A worker's :class:`Snapshot` ring plus which partition made each recent item.

    Kept by the main process for each worker (fed by :meth:`receive` with what comes with the
    items), and by the in-process runner when the loader has no workers. ``events`` holds
    ``(index, slot)`` for every item; entries older than the oldest snapshot are dropped with
    it. A snapshot is also taken whenever a partition ends its epoch and when a new epoch
    begins, so a partition's ``done`` flag always comes from a snapshot taken after its end
    (its state then says so). :meth:`position_at` turns "the newest snapshot at or before
    ``last_index``" plus the items after it into each partition's checkpoint and replay count.
    """

    def __init__(self, capacity: int, in_flight: int) -> None:
        super().__init__(capacity, in_flight)
        self.events: collections.deque[tuple[int, int]] = collections.deque()
        # The index of the worker's last end marker: snapshots at or before it belong to an
        # epoch the worker has finished (main-process books only).
        self.boundary = -2

    def _dropped_through(self, oldest: int) -> None:
        events = self.events
        while events and events[0][0] <= oldest:
            events.popleft()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.events.clear()

    def receive(self, index: int, slot: int, snapshots: Any) -> None:
        """Record a worker's item ``index`` (made by ``slot``; -1 for an end marker) and the
        snapshots that came with it."""
        if snapshots:
            for taken_at, snapshot in snapshots:
                self.add(taken_at, snapshot)
        if slot >= 0:
            self.events.append((index, slot))
        else:
            self.boundary = index

    def position_at(self, last_index: int, *, epoch_ended: bool = True) -> Position:
        """Each partition's (checkpoint, skip, done) and the next slot after ``last_index``.

        ``epoch_ended=False``: the worker has not ended the rank's current epoch. If the
        newest snapshot is then one of an epoch it *has* ended (its next epoch's first
        snapshot comes with its first item of that epoch), every partition continues from
        its end into the current epoch: none is done in it yet, and the round-robin starts
        over, as a new epoch does.
        """
        with self._lock:
            index, snapshot = self._find(last_index)
            events = [e for e in self.events if index < e[0] <= last_index]
        skips, following = list(snapshot.skips), snapshot.next
        count = len(skips)
        for _, slot in events:
            skips[slot] += 1
            following = (slot + 1) % count
        if not epoch_ended and index <= self.boundary:
            return [(s, k, False) for s, k in zip(snapshot.states, skips)], 0
        return [(s, k, d) for s, k, d in zip(snapshot.states, skips, snapshot.done)], following


class CommandServer(threading.Thread):
    """Answers the main process's requests on one worker's command channel."""

    def __init__(
        self, channel: Connection, worker_id: int, counters: WorkerCounters | None = None
    ) -> None:
        super().__init__(name=f"energy_loader-commands-{worker_id}", daemon=True)
        self._channel = channel
        self._counters = counters

    def run(self) -> None:
        channel = self._channel
        while True:
            try:
                command, request_id, argument = channel.recv()
            except (EOFError, OSError):
                return
            try:
                reply = ("ok", request_id, self.handle(command, argument))
            except Exception:
                reply = ("error", request_id, traceback.format_exc())
            try:
                channel.send(reply)
            except (BrokenPipeError, OSError):
                return

    def handle(self, command: str, argument: Any) -> Any:
        if command == "ping":
            return os.getpid()
        if command == "stats" and self._counters is not None:
            return self._counters.read()
        raise ValueError(f"unknown worker command {command!r}")


def _exit_without_flushing_if_orphaned() -> None:
    """Let this worker process exit at once if its main process has died.

    Torch's worker notices a dead main process within seconds and returns, but on its way
    out multiprocessing joins the result queue's feeder thread, which waits to write what
    is left into the pipe. Nobody reads it any more, and a bundle of items can be larger
    than the pipe's buffer: the orphan would wait forever, holding its memory and any
    inherited stdout (a shell pipe or a parent's ``capture_output`` then never ends).
    A finalizer with priority >= 0 runs before that join: if the parent is gone, it ends
    the process there. A worker of a live loader exits as before.
    """
    parent = os.getppid()

    def exit_if_orphaned() -> None:
        if os.getppid() != parent:
            os._exit(0)

    multiprocessing.util.Finalize(None, exit_if_orphaned, exitpriority=10)


@attrs.frozen
class RunPlan:
    """What the workers of one rank run: partitions per logical worker, and restores.

    ``workers[w]`` lists the partitions logical worker ``w`` runs, whose turn is next and
    whether it already ended the current epoch; ``restores`` maps a partition to the state it
    continues from (``None``: every partition starts fresh).
    """

    num_partitions: int
    workers: tuple[WorkerSlots, ...]
    restores: dict[int, PartitionState] | None = None


_END = object()


class _Slot:
    """One partition in a runner: its pipeline copy, live iterator and epoch-end flag."""

    __slots__ = ("context", "done", "iterator", "partition", "pipeline")

    def __init__(self, partition: int, pipeline: SavableDataset) -> None:
        self.partition = partition
        self.pipeline = pipeline
        self.context = pipeline.context
        self.iterator: Iterator[Any] | None = None
        self.done = False


class _Runner:
    """The per-process driver of one (logical) worker: its partitions, round-robin."""

    def __init__(self, owner: WorkerSideDataset, physical_id: int) -> None:
        config, plan = owner.config, owner.plan
        workers = max(1, config.num_workers)
        self.logical_id = (physical_id + owner.offset) % workers
        assignment = plan.workers[self.logical_id]
        self.settings = owner.settings
        self.book = PositionBook(owner.settings.capacity, owner.settings.in_flight)
        self.counters = WorkerCounters()  # loader.stats(): busy time, bytes (metrics.py)
        self.slots: list[_Slot] = []
        for partition in assignment.partitions:
            pipeline = clone_pipeline(owner.pipeline)
            pipeline.bind(config.partition_context(partition, plan.num_partitions, self.logical_id))
            self.slots.append(_Slot(partition, pipeline))
        self.next = assignment.next
        self.index = -1
        self.last_checkpoint_index = -1
        self.last_checkpoint_time = time.monotonic()
        self.started = False
        self.skip_epoch = False
        self.live = 0
        restores = plan.restores
        self.restores = (
            None if restores is None else [restores[slot.partition] for slot in self.slots]
        )
        self.restored_done = assignment.done
        in_worker = get_worker_info() is not None
        # In a worker process the snapshots travel with the items to the main process, which
        # keeps the book; in the main process (no workers) the runner keeps it.
        self.outbox: list[tuple[int, Snapshot]] | None = [] if in_worker and owner.savable else None
        if in_worker:
            set_process_worker(self.slots[0].pipeline.context)
            _exit_without_flushing_if_orphaned()
            if self.settings.gc_freeze:
                # No collection first: walking torch's heap in every new worker costs
                # hundreds of milliseconds of start-up; freezing what exists is what matters.
                gc.freeze()
        # Until the partitions are restored and have replayed, the answer to "where do you
        # stand" is what the runner was started with: their checkpoints and replay counts. In
        # a worker process the main process's book starts from the same (see the loader).
        if self.outbox is None:
            self.book.add(-1, self._starting_snapshot())
        # Items leave the worker encoded by the batch codec, when the loader uses it.
        self.encode = None if owner.transport is None else owner.transport.encoder(physical_id)
        if owner.channels is not None:
            CommandServer(owner.channels[physical_id], self.logical_id, self.counters).start()

    def _starting_snapshot(self) -> Snapshot:
        """The partitions as the runner was started: fresh, or their restore states."""
        if self.restores is None:
            states = []
            for slot in self.slots:
                slot.pipeline.reset_state()
                states.append(slot.pipeline.save_state())
            return Snapshot(tuple(states), (0,) * len(states), (False,) * len(states), 0)
        return Snapshot.at([(r.checkpoint, r.skip, r.done) for r in self.restores], self.next)

    def snapshot(self) -> Snapshot:
        """Every partition's state now (iterating thread only, between items)."""
        slots = self.slots
        return Snapshot(
            tuple(slot.pipeline.save_state() for slot in slots),
            (0,) * len(slots),
            tuple(slot.done for slot in slots),
            self.next,
        )

    def position_at(self, last_index: int) -> Position:
        """Where each partition stands after item ``last_index`` (iterating thread).

        At the newest item that is a fresh snapshot, with nothing to replay; before it (a
        held-back save) the book answers as it does for the command thread.
        """
        if self.started and last_index == self.index:
            now = self.snapshot()
            return [(s, 0, d) for s, d in zip(now.states, now.done)], now.next
        return self.book.position_at(last_index)

    def _checkpoint(self, *, optional: bool = False) -> None:
        began = clock()
        outbox = self.outbox
        if outbox is not None:
            outbox.append((self.index, self.snapshot()))
            kept = True
        else:
            kept = self.book.add(self.index, self.snapshot(), optional=optional)
        if kept:
            self.last_checkpoint_index = self.index
            self.last_checkpoint_time = time.monotonic()
        self.counters.checkpoint_s += clock() - began

    def _shipped_snapshots(self) -> tuple[tuple[int, Snapshot], ...] | None:
        """The snapshots taken since the last item left, to travel with the next one."""
        outbox = self.outbox
        if not outbox:
            return None
        snapshots = tuple(outbox)
        outbox.clear()
        return snapshots

    def _start(self) -> None:
        """Restore (or reset) every partition and replay its items; opens their iterators."""
        self.started = True
        restores, self.restores = self.restores, None
        for position, slot in enumerate(self.slots):
            pipeline = slot.pipeline
            if restores is None:
                pipeline.reset_state()
                slot.iterator = pipeline.iter_keyed()
                continue
            with active_worker(slot.context):
                self._restore_slot(slot, restores[position])
        if restores is not None:
            self.skip_epoch = self.restored_done
            self._checkpoint()

    @staticmethod
    def _restore_slot(slot: _Slot, restore: PartitionState) -> None:
        pipeline = slot.pipeline
        pipeline.restore_state(restore.checkpoint)
        if restore.done:
            # Saved after the partition ended its epoch: its state says so, nothing to replay.
            slot.done = True
            return
        slot.iterator = iterator = pipeline.iter_keyed()
        for replayed in range(restore.skip):
            if next(iterator, _END) is _END:
                raise StateMismatchError(
                    f"partition {slot.partition}: the pipeline ended after {replayed} of "
                    f"the {restore.skip} samples to replay from its checkpoint; is the "
                    "pipeline deterministic (same data, functions and seed)?"
                )

    def _begin_epoch(self) -> None:
        for slot in self.slots:
            slot.iterator = slot.pipeline.iter_keyed()
            slot.done = False
        self.next = 0
        # Items from here on belong to the new epoch, where no partition has ended yet.
        self._checkpoint()

    def prepare_epoch(self) -> bool:
        """Start (or restore) the partitions, or begin their next epoch; False when this
        worker had already ended the epoch it was restored into (nothing to yield)."""
        if not self.started:
            self._start()
        else:
            self._begin_epoch()
        self.live = sum(not slot.done for slot in self.slots)
        if self.skip_epoch:
            self.skip_epoch = False
            return False
        return True

    def next_pair(self, *, snapshot_ends: bool = True) -> tuple[int, Any] | None:
        """The round-robin's next ``(slot position, (key, sample))``; None when every
        partition has ended its epoch. A partition found ended is marked (and, with
        ``snapshot_ends``, recorded in a snapshot).

        The partition's context is current around its next() only: a ContextVar token held
        across yields would be reset whenever an abandoned generator is collected, inside some
        other loader's context.
        """
        slots = self.slots
        count = len(slots)
        while self.live:
            position = self.next
            slot = slots[position]
            self.next = (position + 1) % count
            if slot.done:
                continue
            token = enter_worker(slot.context)
            try:
                pair = next(slot.iterator, _END)  # type: ignore[arg-type]
            finally:
                leave_worker(token)
            if pair is _END:
                slot.done = True
                self.live -= 1
                if snapshot_ends:
                    self._checkpoint()  # a partition's end is always in a snapshot
                continue
            return position, pair
        return None

    def run_epoch(self, savable: bool) -> Iterator[Any]:
        """One loader epoch of this worker: numbered items, then an end marker."""
        if not self.prepare_epoch():
            return
        settings, logical, encode = self.settings, self.logical_id, self.encode
        every_sec, gc_every = settings.every_sec, settings.gc_every_n
        # A snapshot saves every partition of the worker, so with k partitions one is taken
        # every k/2 * every_n items of the worker (measured at k = 4: every_n alone cost 12%
        # of the throughput; k * every_n made restores 1.5x slower). A partition then advances
        # about every_n / 2 of its own items between snapshots, the worker k/2 * every_n.
        every_n = settings.every_n * max(1, len(self.slots) // 2)
        counters = self.counters
        # Without workers the runner keeps the book; with them the main process does.
        events = self.book.events if self.outbox is None else None
        began = clock()  # busy from here to each yield; idle while torch holds the generator
        sample: Any
        while (step := self.next_pair()) is not None:
            position, (key, sample) = step
            self.index += 1
            if events is not None:
                events.append((self.index, position))
            if self.index - self.last_checkpoint_index >= every_n:
                self._checkpoint()
            elif (
                every_sec is not None and time.monotonic() - self.last_checkpoint_time >= every_sec
            ):
                self._checkpoint(optional=True)
            if gc_every is not None and self.index % gc_every == 0:
                gc.collect()
            sample = attach_restore_key(sample, key)
            if encode is not None:
                encoding = clock()
                sample = encode(sample)
                counters.bytes += sample.nbytes
                counters.encode_s += clock() - encoding
            counters.items += 1
            counters.produce_s += clock() - began
            if savable:
                yield (logical, self.index, False, sample, position, self._shipped_snapshots())
            else:
                yield sample
            began = clock()
        if savable:
            self.index += 1
            self._checkpoint()
            yield (logical, self.index, True, None, -1, self._shipped_snapshots())


class WorkerSideDataset(IterableDataset[Any]):
    """What torch's DataLoader iterates: the pipeline plus the worker protocol around it.

    With ``savable=False`` (``BasicDataLoader``) items are plain samples and no checkpoints
    are kept. Under spawn/forkserver the pipeline travels to the workers serialized with dill
    (a recipe, never a state), so lambdas and closures work.
    """

    def __init__(
        self,
        pipeline: SavableDataset,
        config: WorkerConfig,
        settings: CheckpointSettings,
        plan: RunPlan,
        *,
        savable: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.config = attrs.evolve(config, data_parallel_group=None)
        self.settings = settings
        self.plan = plan
        self.savable = savable
        self.channels: list[Connection] | None = None
        self.transport: WorkerTransport | None = None
        # Items travel in bundles of up to items_per_transfer (energy_loader.bundles); the
        # main process's per-worker caps, in shared memory, while workers run.
        self.items_per_transfer = 1
        self.bundle_limits: Any = None
        self.offset = 0
        self._runner: _Runner | None = None
        self._runner_pid = -1
        # True only while the owning loader makes torch's iterator (and so in the workers it
        # starts): anything else iterating this dataset is a DataLoader built around it.
        self.owner_iterating = False

    def runner(self) -> _Runner:
        """This process's runner, created on first use in each process."""
        if self._runner is None or self._runner_pid != os.getpid():
            info = get_worker_info()
            self._runner = _Runner(self, info.id if info is not None else 0)
            self._runner_pid = os.getpid()
        return self._runner

    @property
    def local_runner(self) -> _Runner | None:
        """The runner of this process if it has one (the main process's, with 0 workers)."""
        return self._runner if self._runner_pid == os.getpid() else None

    def drop_runner(self) -> None:
        """Forget the in-process runner (the main process's, when ``num_workers == 0``)."""
        self._runner = None

    @contextlib.contextmanager
    def iterated_by_owner(self) -> Iterator[None]:
        """Around the owning loader's ``DataLoader.__iter__``: the iteration it starts (in
        this process or in the workers it forks or spawns) is the loader's own."""
        self.owner_iterating = True
        try:
            yield
        finally:
            self.owner_iterating = False

    def __iter__(self) -> Iterator[Any]:
        if not self.owner_iterating:
            raise TypeError(
                "a DataLoader other than its SavableDataLoader is iterating the loader's "
                "internal dataset (did accelerator.prepare(loader) or a framework rebuild the "
                "loader from loader.dataset?). Its items are worker messages, not your "
                "batches, and its position would not be saved. With Hugging Face Accelerate "
                "use energy_loader.integrations.accelerate.prepare_loader(accelerator, "
                "loader) instead of accelerator.prepare(loader); see docs/integrations.md"
            )
        runner = self.runner()
        items = runner.run_epoch(self.savable)
        info = get_worker_info()
        if not self.savable or info is None:
            return items
        arenas = () if self.transport is None else self.transport.arenas
        return bundle_items(
            items,
            self.bundle_limits,
            runner.logical_id,
            info.id,
            self.items_per_transfer,
            bundle_bytes(arenas[0].size if arenas else None),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["pipeline"] = dill.dumps(self.pipeline, recurse=True)
        state["_runner"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["pipeline"] = dill.loads(state["pipeline"])
        self.__dict__.update(state)
