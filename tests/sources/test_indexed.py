"""IndexedSource: sharding, per-epoch shuffles, O(1) memory, positions as numbers."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.sources import FeistelPermutation
from energy_loader.testing import check_resume
from energy_loader.worker import WorkerContext
from tests.helpers import make_sample


@given(n=st.integers(0, 3000), key=st.integers(0, 2**64 - 1))
def test_feistel_permutation_is_a_bijection(n: int, key: int) -> None:
    permutation = FeistelPermutation(n, key)
    assert sorted(permutation[i] for i in range(n)) == list(range(n))


def test_permutations_differ_by_key_and_are_not_the_identity() -> None:
    a = [FeistelPermutation(1000, 1)[i] for i in range(1000)]
    b = [FeistelPermutation(1000, 2)[i] for i in range(1000)]
    assert a != b and a != list(range(1000))
    # Roughly uniform: the first half of the order holds about half of the low indices.
    assert 200 < sum(1 for v in a[:500] if v < 500) < 300


def test_ten_to_the_ten_samples_shuffle_in_constant_memory() -> None:
    source = el.IndexedSource.from_fn(10**10, make_index_only, shuffle=True, seed=3)
    tracemalloc.start()
    iterator = iter(source)
    first = [next(iterator)["index"] for _ in range(1000)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert len(set(first)) == 1000 and max(first) > 10**9
    state = source.save_state()
    assert state["position"] == 1000 and len(json.dumps(state)) < 100


def make_index_only(index: int) -> dict:
    return {"index": index}


@pytest.mark.parametrize(("world", "workers", "length"), [(1, 3, 10), (2, 2, 17), (3, 1, 5)])
def test_shards_are_disjoint_and_cover_the_epoch(world: int, workers: int, length: int) -> None:
    seen: list[int] = []
    for rank in range(world):
        for worker in range(workers):
            source = el.IndexedSource.from_fn(length, make_sample, shuffle=True, seed=5)
            partition, partitions = rank * workers + worker, world * workers
            source.bind(WorkerContext(partition=partition, num_partitions=partitions, seed=0))
            shard = [s["index"] for s in source]
            assert len(shard) == len(source)
            seen += shard
    assert sorted(seen) == list(range(length))


def test_the_ordinal_salts_the_shuffle() -> None:
    # Two identical shuffled sources in one pipeline get ordinals 0 and 1 from bind();
    # the ordinal is part of the shuffle key, so their orders differ.
    first = el.IndexedSource.from_fn(50, make_sample, shuffle=True, seed=9)
    second = el.IndexedSource.from_fn(50, make_sample, shuffle=True, seed=9)
    first.bind(WorkerContext())
    second.bind(WorkerContext())
    second._ordinal = 1
    assert [s["index"] for s in first] != [s["index"] for s in second]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_exact_with_and_without_shuffle(workers: int) -> None:
    for shuffle in (False, True):
        check_resume(
            lambda shuffle=shuffle: el.IndexedSource.from_fn(
                23, make_sample, shuffle=shuffle, seed=4
            ),
            num_workers=workers,
            epochs=2,
        )


def test_map_style_dataset_and_bad_arguments() -> None:
    source = el.IndexedSource(["a", "b", "c"])
    assert list(source) == ["a", "b", "c"]
    assert source.restore_sample((1,)) == "b"
    with pytest.raises(TypeError, match="needs map-style data"):
        el.IndexedSource(iter([1, 2]))
    with pytest.raises(ValueError, match="`length` must be >= 0"):
        el.IndexedSource.from_fn(-1, make_sample)
    with pytest.raises(TypeError, match="`fn` must be callable"):
        el.IndexedSource.from_fn(3, "make_sample")
    with pytest.raises(TypeError, match="`shuffle` must be True or False"):
        el.IndexedSource.from_fn(3, make_sample, shuffle="yes")
    with pytest.raises(ValueError, match="`seed` must be >= 0"):
        el.IndexedSource.from_fn(3, make_sample, seed=-2)
    with pytest.raises(ValueError, match="outside range"):
        source.restore_sample((3,))
