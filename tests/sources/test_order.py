"""The per-epoch global order of the unit-reading sources: the vectorised walk a reader uses
gives, position for position, what the one-position lookup gives."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from energy_loader.rng import stable_hash
from energy_loader.sources import FeistelPermutation, _order
from energy_loader.sources._order import EpochOrder, span


@given(
    samples=st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda s: sum(s) > 0),
    seed=st.integers(0, 2**32),
    shuffle=st.booleans(),
    shuffle_units=st.booleans(),
    partitions=st.integers(1, 7),
    stride=st.integers(1, 9),
    start=st.integers(0, 600),
)
def test_walk_equals_one_lookup_per_position(
    samples, seed, shuffle, shuffle_units, partitions, stride, start
):
    order = EpochOrder(samples, seed, shuffle, partitions, shuffle_units=shuffle_units)
    start = start % order.total
    expected = [order.key(p) for p in range(start, order.total, stride)]
    assert list(order.walk(start, stride)) == expected
    if stride == 1 and start == 0:
        assert sorted(expected) == sorted((u, r) for u, n in enumerate(samples) for r in range(n))


@given(
    samples=st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda s: sum(s) > 0),
    seed=st.integers(0, 2**32),
    shuffle=st.booleans(),
    partitions=st.integers(1, 7),
    start=st.integers(0, 300),
    length=st.integers(0, 300),
)
def test_ranges_of_the_order_are_its_spans_taken_as_a_ring(
    samples, seed, shuffle, partitions, start, length
):
    # With one partition, global position q is Q[q]: the reference for a range of Q.
    order = EpochOrder(samples, seed, shuffle, partitions)
    whole = [EpochOrder(samples, seed, shuffle, 1).key(q) for q in range(order.total)]
    walked = list(order.walk_range(start, start + length))
    assert walked == [whole[q % order.total] for q in range(start, start + length)]
    # Span p of Q is what a strided reader of partition p reads.
    spans = [span(order.total, partitions, p) for p in range(partitions)]
    assert [stop - begin for begin, stop in spans] == [
        order.total // partitions + (p < order.total % partitions) for p in range(partitions)
    ]
    for partition, (begin, stop) in enumerate(spans):
        assert list(order.walk_range(begin, stop)) == list(order.walk(partition, partitions))


def test_rows_are_permuted_per_unit_with_the_documented_key():
    order = EpochOrder([5, 9, 3], seed=11, shuffle=True, partitions=1, shuffle_units=False)
    walked = list(order.walk(0, 1))
    expected = [
        (unit, FeistelPermutation(size, stable_hash(11, unit))[row])
        for unit, size in enumerate([5, 9, 3])
        for row in range(size)
    ]
    assert walked == expected


@pytest.mark.parametrize("array_rows", [0, 8, 1 << 20])
def test_units_too_large_for_a_permutation_array_walk_the_same(monkeypatch, array_rows):
    # Units above the size limit are permuted block by block; below it, through an array.
    samples = [5, 9, 30, 3, 17]
    expected = list(EpochOrder(samples, 3, True, 4).walk(1, 2))
    monkeypatch.setattr(_order, "_MAX_ARRAY_ROWS", array_rows)
    monkeypatch.setattr(_order, "_MAX_CACHED_ARRAYS", 2)
    assert list(EpochOrder(samples, 3, True, 4).walk(1, 2)) == expected
