"""The per-epoch global order shared by the sources that read units of samples (shards, tar
files, windows of Parquet row groups): O(units) memory, O(log units) per lookup. The rule
(units and their samples in per-epoch orders, cut into P spans; position ``g`` is sample
``g // P`` of span ``g % P``): docs/sources/sharded.md, "The global order and canonical
partitions". :meth:`EpochOrder.walk` computes ``(unit, row)`` pairs a block at a time.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import numpy as np

from ..rng import stable_hash
from .permutation import FeistelPermutation

_MAX_CACHED_PERMUTATIONS = 256

#: Units with at most this many samples get their row permutation as an array (8 bytes a
#: sample); at most ``_MAX_CACHED_ARRAYS`` such arrays are kept (``row_arrays`` of
#: :class:`EpochOrder`: a reader that never goes back to a unit needs one).
_MAX_ARRAY_ROWS = 1 << 20
_MAX_CACHED_ARRAYS = 16

#: Positions :meth:`EpochOrder.walk` computes at once: enough to amortise numpy's per-call
#: cost, few enough that a reader which stops early (a restore, a save) wastes little.
_WALK_BLOCK = 512


def span(total: int, partitions: int, partition: int) -> tuple[int, int]:
    """``[start, stop)`` of span ``partition`` when Q of ``total`` samples is cut into
    ``partitions`` (step 2 above: the first ``total % partitions`` spans hold one more)."""
    quotient, remainder = divmod(total, partitions)
    start = partition * quotient + min(partition, remainder)
    return start, start + quotient + (partition < remainder)


class EpochOrder:
    """Global position -> ``(unit, row)`` for one epoch. ``samples[u]``: unit ``u``'s samples;
    ``seed`` already folds in the source's seed, stream salt and epoch."""

    def __init__(
        self,
        samples: Sequence[int],
        seed: int,
        shuffle: bool,
        partitions: int,
        *,
        shuffle_units: bool = True,
        row_arrays: int = _MAX_CACHED_ARRAYS,
    ) -> None:
        self.samples = list(samples)
        self.total = sum(self.samples)
        self.partitions = partitions
        self.seed = seed
        self.row_arrays = row_arrays
        self.shuffle = shuffle
        units = len(self.samples)
        if shuffle and shuffle_units and units > 1:
            permutation = FeistelPermutation(units, stable_hash(seed, "shards"))
            self.order = [permutation[i] for i in range(units)]
        else:
            self.order = list(range(units))
        self.starts: list[int] = []
        running = 0
        for unit in self.order:
            self.starts.append(running)
            running += self.samples[unit]
        self._order_array = np.asarray(self.order, dtype=np.int64)
        self._starts_array = np.asarray(self.starts, dtype=np.int64)
        self._rows: dict[int, FeistelPermutation] = {}
        self._row_arrays: dict[int, np.ndarray] = {}

    def locate(self, position: int) -> tuple[int, int]:
        """``(unit, offset in the unit's per-epoch order)`` of global ``position``."""
        partitions, total = self.partitions, self.total
        span, step = position % partitions, position // partitions
        q = span * (total // partitions) + min(span, total % partitions) + step
        slot = bisect.bisect_right(self.starts, q) - 1
        return self.order[slot], q - self.starts[slot]

    def row(self, unit: int, offset: int) -> int:
        """The row of ``unit`` that comes at ``offset`` of its per-epoch order."""
        return self._permutation(unit)[offset] if self.shuffle else offset

    def _permutation(self, unit: int) -> FeistelPermutation:
        permutation = self._rows.get(unit)
        if permutation is None:
            if len(self._rows) > _MAX_CACHED_PERMUTATIONS:
                self._rows.clear()
            permutation = FeistelPermutation(self.samples[unit], stable_hash(self.seed, unit))
            self._rows[unit] = permutation
        return permutation

    def _shuffled_rows(self, unit: int, offsets: np.ndarray) -> np.ndarray:
        """:meth:`row` of an ``int64`` array of offsets into ``unit``."""
        if self.samples[unit] > _MAX_ARRAY_ROWS:
            return self._permutation(unit).take(offsets.astype(np.uint64)).astype(np.int64)
        rows = self._row_arrays.get(unit)
        if rows is None:
            if len(self._row_arrays) >= self.row_arrays:
                del self._row_arrays[next(iter(self._row_arrays))]  # the oldest
            every = np.arange(self.samples[unit], dtype=np.uint64)
            rows = self._permutation(unit).take(every).astype(np.int64)
            self._row_arrays[unit] = rows
        return rows[offsets]

    def keys(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(units, rows)`` of an ``int64`` array of global positions: :meth:`key`, vectorised."""
        partitions, total = self.partitions, self.total
        span, step = positions % partitions, positions // partitions
        q = span * (total // partitions) + np.minimum(span, total % partitions) + step
        return self.sequence_keys(q)

    def sequence_keys(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(units, rows)`` of an ``int64`` array of positions in Q (``0 <= q < total``)."""
        slots = np.searchsorted(self._starts_array, q, side="right") - 1
        units = self._order_array[slots]
        rows = q - self._starts_array[slots]
        if self.shuffle and len(units):
            if units[0] == units[-1] and (units == units[0]).all():  # the common case
                return units, self._shuffled_rows(int(units[0]), rows)
            for unit in np.unique(units).tolist():
                chosen = units == unit
                rows[chosen] = self._shuffled_rows(unit, rows[chosen])
        return units, rows

    def blocks(self, position: int, stride: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """:meth:`keys` of positions ``position, position + stride, ...`` to the epoch's end, a
        block of ``_WALK_BLOCK`` positions at a time."""
        while position < self.total:
            stop = min(self.total, position + stride * _WALK_BLOCK)
            positions = np.arange(position, stop, stride, dtype=np.int64)
            yield self.keys(positions)
            position += stride * len(positions)

    def walk(self, position: int, stride: int) -> Iterator[tuple[int, int]]:
        """``(unit, row)`` of positions ``position, position + stride, ...`` to the epoch's end."""
        for units, rows in self.blocks(position, stride):
            yield from zip(units.tolist(), rows.tolist())

    def walk_range(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """``(unit, row)`` of Q positions ``start, ..., stop - 1`` taken modulo ``total`` (Q as a
        ring: a range may run past its end into its start), a block at a time."""
        total = self.total
        while start < stop:
            end = min(stop, start + _WALK_BLOCK)
            units, rows = self.sequence_keys(np.arange(start, end, dtype=np.int64) % total)
            yield from zip(units.tolist(), rows.tolist())
            start = end

    def key(self, position: int) -> tuple[int, int]:
        """``(unit, row)`` of global ``position``."""
        unit, offset = self.locate(position)
        return unit, self.row(unit, offset)
