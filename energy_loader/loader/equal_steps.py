"""Equal steps: every rank of a job takes the same number of steps in every epoch.

A rank that ends its epoch one step before the others leaves them waiting in an all-reduce.
Ranks end unequal where their partitions hold unequal counts, or where an epoch continues on
another world size from a position it does not divide (8 of 48 items on 2 ranks, resumed on
3: 14 / 13 / 13). The rule: **in every epoch each rank takes as many steps as the rank with
the most items; a rank with fewer cuts its last items (batches) along their first dimension
until it has as many**, so every sample comes exactly once. The count is fixed where an
epoch's assignment begins (its start, or a restore onto another world size), from the
partitions' lengths and the job's position, so all ranks agree without a message. A resize
from the last steps of an epoch of unequal partitions may leave a rank one item over; a
pipeline of unknown length (a filter) keeps its natural ends (docs/distributed.md).

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


@attrs.frozen
class Tally:
    """Where a rank stands against the epoch's count: the job's items left where the assignment
    began, this rank's items left, and the steps it lacks (extra pieces to cut)."""

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
    """Into how many pieces a short rank running ``partitions`` partitions cuts its next item: two
    once its items left are at most its lacking steps plus one round, all lacking at its last."""
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
    """``item`` (a batch) cut into up to ``pieces`` batches along its first dimension, each with its
    rows' restore keys; ``None`` when it cannot be cut (not a batch, or one row)."""
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
    """``sample`` cut into pieces when the rank lacks steps and has few items left
    (:func:`pieces_for`); None to hand it out whole (a last item that cannot be cut, with a
    warning)."""
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
