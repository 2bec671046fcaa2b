"""Where a worker stands: its rolling snapshots and the bookkeeping that reads a position off them.

Both sides of the process boundary use these. A worker process takes a :class:`Snapshot` of its
partitions every few items and sends them with its items; the main process files them in one
:class:`PositionBook` per worker and reads each save off it (``position_at``), with no message
to the worker. A loader without workers runs its runner in the main process, which keeps its
own book. Nothing here talks to a process, a queue or a pipeline: it is pure bookkeeping over
plain-data states.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import attrs

from .digests import last_digest
from .rank_state import PartitionState


class CheckpointRing:
    """The rolling checkpoints of one worker: ``(index, state)`` pairs, oldest first; one is dropped
    only once the next is at or before ``newest_index - in_flight`` (every save the main process can
    still ask for stays covered)."""

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
    """One rolling checkpoint of a worker: each of its partitions' position, in the worker's order,
    then ``next``, whose turn came next; ``era``: the worker's epoch it was taken in."""

    partitions: tuple[PartitionState, ...]
    next: int
    # How many epochs the worker had begun since it started: snapshots of one era belong to
    # one epoch of its partitions.
    era: int = 0

    def __reduce__(self) -> tuple[Any, ...]:
        # A worker sends one every few items: its records' fields as rows, one call to rebuild.
        rows = tuple(
            (e.partition, e.checkpoint, e.skip, e.done, e.last, e.checkpoint_check, e.made)
            + ((0, e.changes) if e.changes else ())  # changes a restore declared (rare)
            for e in self.partitions
        )
        return _snapshot, (rows, self.next, self.era)

    @classmethod
    def at(cls, position: Position) -> Snapshot:
        """The snapshot of a position (where a worker starts)."""
        partitions, following = position
        return cls(tuple(partitions), following)


def _snapshot(rows: tuple[tuple[Any, ...], ...], following: int, era: int) -> Snapshot:
    """A :class:`Snapshot` from the rows its ``__reduce__`` sent."""
    return Snapshot(tuple(PartitionState(*row) for row in rows), following, era)


# Where a worker stands: each of its partitions' position, then whose turn is next.
Position = tuple[list[PartitionState], int]
# One item in a book: its index, the slot that made it, its restore key, its made digest.
Event = tuple[int, int, Any, str | None]


class PositionBook(CheckpointRing):
    """A worker's :class:`Snapshot` ring plus which partition made each recent item (``events``:
    ``(index, slot, key, made)``), kept by the main process per worker or by the in-process runner.
    Snapshots at every partition's epoch end make ``done`` reliable."""

    def __init__(self, capacity: int, in_flight: int) -> None:
        super().__init__(capacity, in_flight)
        self.events: collections.deque[Event] = collections.deque()
        # The index of the worker's last end marker: snapshots at or before it belong to an
        # epoch the worker has finished (main-process books only).
        self.boundary = -2
        # Each slot's last item's restore key and made digest so far: what a snapshot filed
        # now records.
        self._lasts: list[Any] = []
        self._mades: list[str | None] = []

    def start(self, snapshot: Snapshot) -> None:
        """File where the worker starts (before its first item, index -1): its partitions'
        last keys and made digests are the book's from here on."""
        self._lasts = [entry.last for entry in snapshot.partitions]
        self._mades = [entry.made for entry in snapshot.partitions]
        super().add(-1, (snapshot, tuple(self._lasts), tuple(self._mades)))

    def add(self, index: int, state: Any, *, optional: bool = False) -> bool:
        """File snapshot ``state`` taken after item ``index`` with each partition's last key and
        made digest as the book knows them now (a worker sends neither)."""
        count = len(state.partitions)
        if len(self._lasts) != count:
            self._lasts = [None] * count
            self._mades = [None] * count
        filed = (state, tuple(self._lasts), tuple(self._mades))
        return super().add(index, filed, optional=optional)

    def _dropped_through(self, oldest: int) -> None:
        events = self.events
        while events and events[0][0] <= oldest:
            events.popleft()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.events.clear()

    def record(self, index: int, slot: int, key: Any, made: str | None = None) -> None:
        """Item ``index`` was made by ``slot``, carried restore key ``key`` (or None), and its
        values' digest as made was ``made`` (None: not computed)."""
        self.events.append((index, slot, key, made))
        lasts = self._lasts
        if slot < len(lasts):
            lasts[slot] = key
            self._mades[slot] = made

    def receive(
        self, index: int, slot: int, snapshots: Any, key: Any = None, made: str | None = None
    ) -> None:
        """Record a worker's item ``index`` (slot -1: an end marker) and the snapshots that came
        with it: those taken before the item are filed before it, one taken right after it after it.
        """
        for taken_at, snapshot in snapshots or ():
            if taken_at < index:
                self.add(taken_at, snapshot)
        if slot >= 0:
            self.record(index, slot, key, made)
        else:
            self.boundary = index
        for taken_at, snapshot in snapshots or ():
            if taken_at >= index:
                self.add(taken_at, snapshot)

    def position_at(self, last_index: int, *, epoch_ended: bool = True) -> Position:
        """Each partition's position and the next slot after ``last_index``, as a save writes them;
        with ``epoch_ended=False`` a snapshot of an ended epoch continues into the current one."""
        with self._lock:
            index, (snapshot, filed_lasts, filed_mades) = self._find(last_index)
            events = [e for e in self.events if index < e[0] <= last_index]
            earlier = [
                (i, s[0]) for i, s in self._entries if i < index and s[0].era == snapshot.era
            ]
            before = [e for e in self.events if e[0] <= index] if earlier else []
        entries, following = snapshot.partitions, snapshot.next
        count = len(entries)
        skips = [entry.skip for entry in entries]
        lasts, mades = list(filed_lasts), list(filed_mades)
        for _, slot, key, made in events:
            skips[slot] += 1
            lasts[slot] = key
            mades[slot] = made
            following = (slot + 1) % count
        restart = not epoch_ended and index <= self.boundary
        states = [
            PartitionState(
                e.partition,
                e.checkpoint,
                skip,
                False if restart else e.done,
                last_digest(last),
                e.checkpoint_check,
                made,
                changes=e.changes,  # the checkpoint still predates them
            )
            for e, skip, last, made in zip(entries, skips, lasts, mades)
        ]
        if restart:
            return states, 0
        for slot, state in enumerate(states):
            if (
                not state.skip
                and not state.done
                and (state.last is not None or state.made is not None)
            ):
                states[slot] = _remade(slot, state, earlier, before + events) or state
        return states, following


def _remade(
    slot: int, state: PartitionState, earlier: list[tuple[int, Snapshot]], events: list[Event]
) -> PartitionState | None:
    """``slot``'s position from the newest earlier snapshot of its epoch before its last item, so a
    restore re-makes that item to check it; None when none is kept."""
    items = [index for index, made_by, _, _ in events if made_by == slot]
    if not items:
        return None
    last_item = items[-1]
    for taken_at, snapshot in reversed(earlier):
        if taken_at < last_item:
            entry = snapshot.partitions[slot]
            if entry.done:
                return None
            skip = entry.skip + sum(index > taken_at for index in items)
            return attrs.evolve(
                state,
                checkpoint=entry.checkpoint,
                skip=skip,
                done=False,
                checkpoint_check=entry.checkpoint_check,
            )
    return None
