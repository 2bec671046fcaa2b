"""Equal steps: every rank of a job takes the same number of steps in every epoch.

A data-parallel step is a collective: a rank that ends its epoch one step before the others
leaves them waiting in an all-reduce that never completes (with gloo, the pairs break and the
job dies). Ranks end unequal where their partitions hold unequal counts: partitions of unequal
lengths, or an epoch continued on another world size from a position it does not divide
(saved on 2 ranks after 8 items of 48, resumed on 3: 40 items left, 14 / 13 / 13).

The rule, in one sentence: **in every epoch each rank takes as many steps as the rank with the
most items; a rank with fewer cuts its last items (batches) along their first dimension into
smaller ones until it has as many**, so every sample comes exactly once and only a short
rank's last steps are smaller. The count is fixed where an epoch's assignment begins (its
start, or a restore onto another world size): every rank computes every rank's items from the
partitions' lengths and the job's position, so all agree without a message. A short rank cuts
its items in two once its items left are no more than the steps it lacks plus one round over
its partitions (its last item takes whatever is still lacking), so the short last batches of
its partitions, one row each, do not stop it.

Where the count is exact: at every epoch's start; after a restore onto another world size
from a position where every partition still had items (the job's stream
``G[k] = item k // P of partition k % P`` then says how many each partition gave). A resize
from the last steps of an epoch whose partitions hold unequal counts may leave a rank one item
over. Pipelines of unknown length (a filter) have no count and keep their natural ends.

Pure: no processes, no I/O. The engine (:mod:`.pipeline_engine`) applies it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from ..dataset import attach_restore_key, restore_key_of
from ..wrappers.unbatch import batch_length, take_rows
from .partitions import PartitionLayout

__all__ = [
    "Standing",
    "Tally",
    "consumed_by",
    "cut_for_equal_steps",
    "piece_bounds",
    "pieces_for",
    "split_item",
    "tally",
]


@attrs.frozen
class Tally:
    """Where a rank stands against the epoch's count: the items the job had left where the
    assignment began, this rank's items left, and the steps it still lacks (its extra
    pieces to cut)."""

    job_left: int
    items_left: int
    extra: int


def consumed_by(partition: int, position: int, consumed: int, num_partitions: int) -> int:
    """Items partition ``partition`` gave once the job consumed ``consumed`` items of the
    epoch and stands at global ``position`` (mod ``P``): the stream visits the partitions in
    turn, so each gave ``consumed // P`` and the last ``consumed % P`` visited one more."""
    rounds, over = divmod(consumed, num_partitions)
    return rounds + (1 if (position - 1 - partition) % num_partitions < over else 0)


def tally(lengths: Sequence[int], layout: PartitionLayout, rank: int, consumed: int) -> Tally:
    """Rank ``rank``'s tally where an assignment begins: ``lengths`` are every partition's
    items per epoch, ``layout`` the assignment (its ``start``: the job's position mod ``P``),
    ``consumed`` the items the job consumed in the epoch before it."""
    count = layout.num_partitions
    left = [
        max(0, length - consumed_by(p, layout.start, consumed, count))
        for p, length in enumerate(lengths)
    ]
    items = [sum(left[p] for p in layout.rank_partitions(r)) for r in range(layout.world_size)]
    return Tally(sum(left), items[rank], max(items) - items[rank])


def pieces_for(items_left: int, extra: int, partitions: int) -> int:
    """Into how many pieces a short rank that runs ``partitions`` partitions cuts its next
    item: two once its items left are no more than the steps it lacks plus one round over its
    partitions (whose last items may be short batches of one row), everything still lacking
    for its last item."""
    if extra <= 0 or items_left > extra + max(1, partitions):
        return 1
    return 1 + extra if items_left <= 1 else 2


def piece_bounds(rows: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` row ranges covering ``range(rows)`` in order, sizes differing by at most
    one, the larger first."""
    size, extra = divmod(rows, pieces)
    bounds, start = [], 0
    for piece in range(pieces):
        stop = start + size + (1 if piece < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_item(item: Any, pieces: int) -> list[Any] | None:
    """``item`` (a batch) cut into up to ``pieces`` smaller batches along its first dimension
    (as many as it has rows), each carrying the restore keys of its rows; ``None`` when it
    cannot be cut (not a batch, or one row)."""
    try:
        rows = batch_length(item)
    except (TypeError, ValueError):
        return None
    pieces = min(pieces, rows)
    if pieces < 2:
        return None
    keys = restore_key_of(item)
    out = []
    for start, stop in piece_bounds(rows, pieces):
        piece = take_rows(item, start, stop)
        if isinstance(keys, tuple) and len(keys) == rows:  # a batch's keys: one per row
            piece = attach_restore_key(piece, keys[start:stop])
        out.append(piece)
    return out


class Standing(Protocol):
    """Where a rank stands against the epoch's count (the engine's progress)."""

    job_left: int | None
    items_left: int
    extra: int
    per_rank: int
    epoch: int


def cut_for_equal_steps(sample: Any, progress: Standing) -> list[Any] | None:
    """``sample`` cut into pieces when the rank lacks steps against the epoch's count and its
    items left are few enough (:func:`pieces_for`); None to hand it out whole. An item that
    cannot be cut when it is the rank's last is handed out whole, with a warning: the rank
    then ends its epoch a step early."""
    if progress.job_left is None or progress.extra <= 0:
        return None
    pieces = pieces_for(progress.items_left, progress.extra, progress.per_rank)
    if pieces < 2:
        return None
    cut = split_item(sample, pieces)
    if cut is None and progress.items_left <= 1:
        warnings.warn(
            f"this rank's last item of epoch {progress.epoch} cannot be cut into the "
            f"{progress.extra + 1} steps the other ranks still take (not a batch, or too "
            "few rows): the rank ends its epoch early, and a data-parallel step that waits "
            "for it may hang. Batch the pipeline (BatchDataset), or give the partitions "
            "equal lengths",
            UserWarning,
            stacklevel=4,  # the user's next(): past next_sample and the iterator's __next__
        )
    return cut
