"""In a worker process: one logical worker's partitions, round-robin, numbered and snapshotted.

Torch's DataLoader workers iterate a :class:`WorkerSideDataset`, which in each worker process
makes one copy of the pipeline per logical partition it runs and restores each (replaying its
``skip`` items); takes them round-robin, one item at a time, numbering every item (an epoch's
last is an end marker); takes rolling snapshots of all its partitions right after an item,
every ``every_n`` items or ``every_sec`` seconds and at epoch boundaries, and sends each *with
the next item* with the item's partition and proof, so that the main process's
:class:`PositionBook` answers a save without a round trip; answers counter requests from a
:class:`CommandServer` thread; encodes items with the batch codec and sends them in bundles.

Physical worker ``p`` runs logical worker ``(p + offset) % num_workers``: torch always starts
its round-robin at physical worker 0, so a restore onto its own layout sets ``offset`` to the
logical worker that was due next. Design: docs/design.md, "The worker checkpoint protocol".
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Iterator
from typing import Any

from torch.utils.data import get_worker_info

from ..dataset import SavableDataset, attach_restore_key
from ..errors import StateMismatchError
from ..metrics import WorkerCounters, clock
from ..state.changes import values_before
from ..state.digests import checkpoint_digest, content_digest, key_digest
from ..state.fingerprint import user_code, user_functions
from ..state.positions import Position, PositionBook, Snapshot
from ..state.rank_state import PartitionState
from ..worker import active_worker, enter_worker, leave_worker, set_process_worker
from .commands import CommandServer, exit_without_flushing_if_orphaned
from .protocol import END_SLOT, RunnerOwner, WorkerItem


def _holds_dataset(value: Any) -> bool:
    if isinstance(value, SavableDataset):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_dataset(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_dataset(item) for item in value.values())
    return False


def clone_pipeline(pipeline: SavableDataset) -> SavableDataset:
    """A copy of the pipeline's recipe for another partition: dataset nodes (and the containers
    holding them) are copied without their cursors, everything else (functions, data, caches) is
    shared, so ``k`` partitions cost ``k`` small recipe objects."""
    memo: dict[int, Any] = {}
    for dataset in pipeline.walk():
        for name, value in vars(dataset).items():
            if name == "_cursor":  # dropped by __getstate__ anyway: never copy its buffers
                continue
            if not _holds_dataset(value):
                memo[id(value)] = value
    clone = copy.deepcopy(pipeline, memo)
    for dataset in clone.walk():
        dataset._cursor = None
    return clone


_END = object()


class Slot:
    """One partition in a runner: its pipeline copy, live iterator and epoch-end flag."""

    __slots__ = ("context", "done", "iterator", "partition", "pipeline")

    def __init__(self, partition: int, pipeline: SavableDataset) -> None:
        self.partition = partition
        self.pipeline = pipeline
        self.context = pipeline.context
        self.iterator: Iterator[Any] | None = None
        self.done = False


class Runner:
    """The per-process driver of one (logical) worker: its partitions, round-robin."""

    def __init__(self, owner: RunnerOwner, physical_id: int) -> None:
        config, plan = owner.config, owner.plan
        workers = max(1, config.num_workers)
        self.logical_id = (physical_id + owner.offset) % workers
        assignment = plan.workers[self.logical_id]
        self.settings = owner.settings
        self.book = PositionBook(owner.settings.capacity, owner.settings.in_flight)
        self.counters = WorkerCounters()  # loader.stats(): busy time, bytes (metrics.py)
        self.slots: list[Slot] = []
        for partition in assignment.partitions:
            pipeline = clone_pipeline(owner.pipeline)
            pipeline.bind(config.partition_context(partition, plan.num_partitions, self.logical_id))
            self.slots.append(Slot(partition, pipeline))
        self.next = assignment.next
        self.index = -1
        self.era = 0  # epochs begun since the runner started (Snapshot.era)
        self.last_checkpoint_index = -1
        self.last_checkpoint_time = time.monotonic()
        self.started = False
        self.skip_epoch = False
        self.live = 0
        restores = plan.restores
        self.verify = plan.verify
        self.restores = (
            None if restores is None else [restores[slot.partition] for slot in self.slots]
        )
        self.restored_done = assignment.done
        in_worker = get_worker_info() is not None
        # In a worker process the snapshots travel with the items to the main process, which
        # keeps the book; in the main process (no workers) the runner keeps it.
        self.outbox: list[tuple[int, Snapshot]] | None = [] if in_worker and owner.savable else None
        if in_worker:
            # A worker beyond the rank's partitions idles: it still needs a context.
            set_process_worker(
                self.slots[0].pipeline.context if self.slots else config.context(self.logical_id)
            )
            exit_without_flushing_if_orphaned()
            if self.settings.gc_freeze:
                # No collection first: walking torch's heap in every new worker costs
                # hundreds of milliseconds of start-up; freezing what exists is what matters.
                gc.freeze()
        # Until the partitions are restored and have replayed, the answer to "where do you
        # stand" is what the runner was started with: their checkpoints and replay counts. In
        # a worker process the main process's book starts from the same (see the loader).
        if self.outbox is None:
            self.book.start(self._starting_snapshot())
        # Items leave the worker encoded by the batch codec, when the loader uses it.
        self.encode = None if owner.transport is None else owner.transport.encoder(physical_id)
        if owner.channels is not None:
            CommandServer(owner.channels[physical_id], self.logical_id, self.counters).start()

    def _starting_snapshot(self) -> Snapshot:
        """The partitions as the runner was started: fresh, or their restore states."""
        if self.restores is not None:
            return Snapshot(tuple(self.restores), self.next)
        entries = []
        for slot in self.slots:
            slot.pipeline.reset_state()
            entries.append(PartitionState(slot.partition, slot.pipeline.save_state()))
        return Snapshot(tuple(entries), 0)

    def snapshot(self) -> Snapshot:
        """Every partition's position now (iterating thread only, between items). In a worker
        process the checkpoints' digests are computed here, off the training loop's thread."""
        digests = self.outbox is not None
        entries = []
        for slot in self.slots:
            state = slot.pipeline.save_state()
            check = checkpoint_digest(state) if digests else None
            entries.append(PartitionState(slot.partition, state, 0, slot.done, None, check))
        return Snapshot(tuple(entries), self.next, self.era)

    def position_at(self, last_index: int) -> Position:
        """Where each partition stands after item ``last_index`` (iterating thread): the book's
        newest snapshot at or before it plus the items since, so a restore re-makes the last one."""
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
            restore = restores[position]
            with active_worker(slot.context), values_before(pipeline, restore.changes):
                self._restore_slot(slot, restore, self.verify)
        if restores is not None:
            self.skip_epoch = self.restored_done
            self._checkpoint()

    @staticmethod
    def _restore_slot(slot: Slot, restore: PartitionState, verify: bool) -> None:
        pipeline = slot.pipeline
        pipeline.restore_state(restore.checkpoint)
        if restore.done:
            # Saved after the partition ended its epoch: its state says so, nothing to replay.
            slot.done = True
            return
        slot.iterator = iterator = pipeline.iter_keyed()
        pair: Any = None
        for replayed in range(restore.skip):
            pair = next(iterator, _END)
            if pair is _END and replayed >= restore.skip - restore.replay_slack:
                return  # the saved epoch's short last batch, re-made smaller: its end is next
            if pair is _END:
                raise StateMismatchError(_ended_early(slot, restore, replayed))
        if not verify or not restore.skip:
            return
        # The proof: the last item replayed is the last one the saving loader handed out...
        key, sample = pair
        if restore.last is not None and (found := key_digest(key)) != restore.last:
            raise StateMismatchError(
                f"partition {slot.partition}: the restore replayed {restore.skip} item(s) from "
                f"its checkpoint, but the last one (restore key {_shown(key)}, key digest "
                f"{found}) is not the one the saving loader handed out there (key digest "
                f"{restore.last}): the pipeline does not make the same items again (a "
                "function, filter or source that changed, or that depends on something besides "
                "the sample and its seed, such as the clock or an unseeded generator). Where it "
                f"can come from: {_where_from(slot)}. Restore with the pipeline that saved the "
                "state, or pass verify_restore=False to continue anyway"
            )
        # ... and it holds the same values (digested as run_epoch digests them).
        if restore.made is not None and (made := content_digest(sample)) != restore.made:
            raise StateMismatchError(_other_values(slot, restore, key, made))

    def _begin_epoch(self) -> None:
        self.era += 1
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
        """The round-robin's next ``(slot position, (key, sample))``; None when every partition has
        ended its epoch. The partition's context is current around its next() only: a ContextVar
        token held across yields would be reset when an abandoned generator is collected."""
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
        book = self.book if self.outbox is None else None
        # The values' digest a save records with each partition's last item, for its restore
        # to check: made here, in a worker process off the training loop's thread, or without
        # workers before the user holds the item (and could change it in place).
        prove = savable and self.verify
        began = clock()  # busy from here to each yield; idle while torch holds the generator
        sample: Any
        while (step := self.next_pair()) is not None:
            position, (key, sample) = step
            self.index += 1
            made = content_digest(sample) if prove else None
            if book is not None:
                book.record(self.index, position, key, made)
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
                yield WorkerItem(
                    logical, self.index, False, sample, position, self._shipped_snapshots(), made
                )
            else:
                yield sample
            began = clock()
        if savable:
            self.index += 1
            self._checkpoint()
            yield WorkerItem(logical, self.index, True, None, END_SLOT, self._shipped_snapshots())


def _shown(key: Any) -> str:
    """A restore key for a message, cut short."""
    shown = repr(key)
    return shown if len(shown) <= 160 else shown[:150] + " ...)"


def _where_from(slot: Slot) -> str:
    """The stages that run the user's code and the sources, for a refusal's message."""
    functions, sources = user_code(slot.pipeline.config())
    stages = ", ".join(functions) if functions else "none"
    return (
        f"the stages that run your code ({stages}) and the data the sources read "
        f"({', '.join(sources)})"
    )


def _unseeded(slot: Slot) -> str:
    """For a refusal's message: the user functions that run without per-sample seeds, whose
    random draws a restore does not re-make, and the fix (empty where there are none)."""
    unseeded = [f.call() for f in user_functions(slot.pipeline.config()) if f.unseeded]
    if not unseeded:
        return ""
    calls = ", ".join(unseeded)
    if len(unseeded) == 1:
        runs, fix = "runs", f"If it draws random numbers, build {calls}"
    else:
        runs, fix = "run", "Build the ones that draw random numbers"
    return (
        f"{calls} {runs} without per-sample seeds (seed_per_sample=False), so a restore does "
        "not re-make random numbers drawn there: its replay draws from another point of the "
        "generator, in another worker on another world size or num_workers. "
        f"{fix} with seed_per_sample=True so that a restore re-makes them on any layout (a "
        "state saved without it restores only into a pipeline without it). "
    )


def _ended_early(slot: Slot, restore: PartitionState, replayed: int) -> str:
    """The refusal of a partition whose pipeline ended before its items to replay did."""
    return (
        f"partition {slot.partition}: the restore expected {restore.skip} item(s) to replay "
        f"from its checkpoint, but the pipeline ended after {replayed}: it makes fewer items "
        f"from the same checkpoint than the saving run did. Where it can come from: "
        f"{_where_from(slot)}. Usual causes: a filter's predicate or a function that changed "
        "since the save or draws from a generator nobody seeds; a data file that lost "
        f"records. {_unseeded(slot)}Restore with the pipeline (and data) that saved the state"
    )


def _other_values(slot: Slot, restore: PartitionState, key: Any, made: str) -> str:
    """The refusal of a partition that re-made its last item with other values (``made``:
    their digest now)."""
    if restore.last is not None:
        what = (
            f"re-made the last item the saving loader handed out there (restore key "
            f"{_shown(key)}), but with other values than it had then: the pipeline makes the "
            "same item differently"
        )
    else:
        what = (
            "re-made its last item with other values than the one the saving loader handed "
            "out there (its items carry no restore key: it may also be another item)"
        )
    return (
        f"partition {slot.partition}: the restore replayed {restore.skip} item(s) from its "
        f"checkpoint and {what} (values digest {restore.made} saved, {made} now). Where it "
        f"can come from: {_where_from(slot)}. Usual causes: a "
        "function that changed since the save, or that reads the clock, a generator nobody "
        "seeds or a global counter; a data file edited in place; float results that differ "
        f"with the number of threads. {_unseeded(slot)}Restore with the pipeline (and data) "
        "that saved the state, or pass verify_restore=False to continue anyway"
    )
