"""What the main process knows of one rank's epoch: per worker, the last item handed out.

:class:`Progress` is the main-process bookkeeping a save is computed from (with the workers'
snapshots, :mod:`energy_loader.state.positions`): for each logical worker the number of the
last item the user received and whether it ended the epoch, which worker is due next, and the
epoch's counters. :class:`Mark` is that position right after one item, kept for the last few
items so a save can reach back (``held_back``). Not thread-safe: the iterating thread only.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import attrs

from .equal_steps import Tally
from .partitions import next_worker

if TYPE_CHECKING:
    from .planner import RestorePlan

# How many delivered items a save may hold back (``save_state_rank(held_back=n)``): the rolling
# checkpoints keep that many more items per worker.
MAX_HELD_BACK = 2


@attrs.frozen
class Mark:
    """Where the rank stood right after handing out one item (for held-back saves), or one
    piece of an item split for equal steps (:mod:`.equal_steps`): then the position is still
    before that item, and ``pieces`` of it were handed out."""

    last_index: tuple[int, ...]
    done: tuple[bool, ...]
    next_worker: int
    delivered: int
    pieces: int = 0
    items_left: int = 0
    extra: int = 0


class Progress:
    """What the main process knows about each logical worker's stream and the epoch."""

    def __init__(self, workers: int, per_rank: int) -> None:
        # The rank's partitions, split over the workers (see partitions.next_worker).
        self.per_rank = per_rank
        self.last_index = [-1] * workers
        self.done = [False] * workers
        self.next_worker = 0
        self.epoch = 0
        self.in_epoch = False
        self.epoch_ended = False
        # Steps this rank took in the epoch: items handed out, and pieces of split ones.
        self.delivered = 0
        self.start = 0
        # Equal steps (equal_steps.py): the items the job had left where the epoch's
        # assignment began (None: no count, a pipeline of unknown length), this rank's items
        # left, the steps it lacks, and the pieces of the next item already handed out.
        self.job_left: int | None = None
        self.items_left = 0
        self.extra = 0
        self.pieces = 0
        # What was skipped or changed on purpose (energy_loader.state.changes), oldest first.
        self.history: list[dict[str, Any]] = []
        # The position after each of the last items handed out, and before the first one.
        self.marks: collections.deque[Mark] = collections.deque(maxlen=MAX_HELD_BACK + 1)
        self.marks.append(self.mark())

    @classmethod
    def from_plan(cls, plan: RestorePlan) -> Progress:
        """The progress a restored loader starts from (nothing handed out since)."""
        progress = cls(len(plan.workers), sum(len(w.partitions) for w in plan.workers))
        progress.done = [w.done for w in plan.workers]
        progress.next_worker = plan.next_worker
        progress.epoch = plan.epoch
        progress.in_epoch = plan.in_epoch
        progress.epoch_ended = plan.epoch_ended
        progress.delivered = plan.delivered
        progress.start = plan.start
        progress.count(plan.tally)
        progress.pieces = plan.pieces
        progress.history = list(plan.history)
        progress.marks.clear()
        progress.marks.append(progress.mark())
        return progress

    def skipped(self, items: int) -> None:
        """Put on record that the last ``items`` items handed out were skipped (``loader.skip``)."""
        entry = {"epoch": self.epoch, "step": self.delivered - items, "skip": items}
        self.history.append(entry)

    def start_epoch(self, start: int) -> None:
        """The next epoch begins, its partition assignment starting at ``start``."""
        self.epoch += 1
        self.done = [False] * len(self.done)
        self.epoch_ended = False
        self.next_worker = 0
        self.delivered = 0
        self.start = start
        self.count(None)
        self.marks.clear()
        self.marks.append(self.mark())

    def end_epoch(self) -> None:
        """Every item of the epoch has been handed out and the end reported."""
        self.in_epoch = False
        self.epoch_ended = True
        self.next_worker = 0

    def handed_out(self, worker: int, index: int, slot: int, is_end: bool) -> None:
        """Record logical worker ``worker``'s item ``index`` (made by its ``slot``), or its end
        marker, as received."""
        self.last_index[worker] = index
        if is_end:
            self.next_worker = (worker + 1) % len(self.done)
            self.done[worker] = True
            return
        self.next_worker = next_worker(worker, slot, self.per_rank, len(self.done))
        self.delivered += 1
        if self.job_left is not None:
            self.items_left -= 1
            if self.pieces:  # the last piece of a cut item: its other pieces were extra steps
                self.extra -= self.pieces
        self.pieces = 0
        self.marks.append(self.mark())

    def handed_out_piece(self) -> None:
        """Record one piece of a cut item, all but its last, as handed out: a step, with the
        position still before the item."""
        self.delivered += 1
        self.pieces += 1
        self.marks.append(self.mark())

    def count(self, tally: Tally | None) -> None:
        """Count the epoch's steps from ``tally`` (None: no count)."""
        self.job_left = None if tally is None else tally.job_left
        self.items_left = 0 if tally is None else tally.items_left
        self.extra = 0 if tally is None else tally.extra
        self.pieces = 0

    def tally(self, mark: Mark) -> Tally | None:
        """The tally as of ``mark`` (a position this epoch's count applies to)."""
        if self.job_left is None:
            return None
        return Tally(self.job_left, mark.items_left, mark.extra)

    def saved_fields(self, mark: Mark, held_back: int) -> dict[str, Any]:
        """The rank state's fields of the epoch's progress as of ``mark``, ``held_back``
        items before the last one handed out (:meth:`.planner.Planner.rank_state`)."""
        return {
            "epoch": self.epoch,
            "in_epoch": self.in_epoch or held_back > 0,
            "epoch_ended": self.epoch_ended and held_back == 0,
            "delivered": mark.delivered,
            "start": self.start,
            "next_worker": mark.next_worker,
            "done": mark.done,
            "tally": self.tally(mark),
            "pieces": mark.pieces,
            "history": self.history,
        }

    @property
    def fresh(self) -> bool:
        """Nothing was iterated, ended or restored yet (restores are the caller's to check)."""
        return self.epoch == 0 and not self.in_epoch and not self.epoch_ended

    def mark(self) -> Mark:
        return Mark(
            tuple(self.last_index),
            tuple(self.done),
            self.next_worker,
            self.delivered,
            self.pieces,
            self.items_left,
            self.extra,
        )

    def held_back(self, count: int) -> Mark:
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
