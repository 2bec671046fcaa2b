"""GroupBatchDataset: buckets per key, per-key sizes, leftovers, plain keys, exact resume."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import torch

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import AddNoise, GroupOf, MakeSample
from energy_loader.wrappers import GroupBatchDataset
from tests.helpers import WORKERS_0_AND_2


def _source(length: int = 30, seed: int = 5, shuffle: bool = True) -> el.IndexedSource:
    return el.IndexedSource.from_fn(length, MakeSample(), shuffle=shuffle, seed=seed)


def _pair_key(sample: dict[str, Any]) -> tuple[str, int]:
    return ("even" if sample["index"] % 2 == 0 else "odd", sample["index"] % 3)


def test_batches_hold_one_group_and_every_sample_once() -> None:
    grouped = GroupBatchDataset(_source(), GroupOf(3), 4)
    batches = list(grouped)
    assert all(len({i % 3 for i in b["index"].tolist()}) == 1 for b in batches)
    assert sorted(i for b in batches for i in b["index"].tolist()) == list(range(30))
    sizes = Counter(len(b["index"]) for b in batches)
    assert sizes == Counter({4: 6, 2: 3}), "10 per group: two full batches and a leftover of 2"
    assert [len(b["index"]) for b in batches[-3:]] == [2, 2, 2], "leftovers come last"


def test_full_buckets_are_emitted_as_soon_as_they_fill() -> None:
    grouped = GroupBatchDataset(_source(12, shuffle=False), GroupOf(2), 3)
    assert [b["index"].tolist() for b in grouped] == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]


def test_per_key_batch_sizes_and_dropped_leftovers() -> None:
    grouped = GroupBatchDataset(
        _source(20, shuffle=False), GroupOf(2), 4, batch_sizes={1: 3}, leftovers="drop"
    )
    batches = [b["index"].tolist() for b in grouped]
    assert batches == [[1, 3, 5], [0, 2, 4, 6], [7, 9, 11], [8, 10, 12, 14], [13, 15, 17]]


def test_leftovers_are_emitted_oldest_bucket_first() -> None:
    grouped = GroupBatchDataset(_source(7, shuffle=False), GroupOf(3), 5)
    assert [b["index"].tolist() for b in grouped] == [[0, 3, 6], [1, 4], [2, 5]]


def test_tuple_group_keys_survive_a_json_round_trip_of_the_state() -> None:
    def build() -> GroupBatchDataset:
        return GroupBatchDataset(_source(), _pair_key, 3)

    grouped = build()
    iterator = iter(grouped)
    next(iterator)
    state = json.loads(json.dumps(grouped.save_state()))
    assert all(isinstance(group, list) for group, _ in state["buckets"])
    rest = [b["index"].tolist() for b in iterator]
    restored = build()
    restored.restore_state(state)
    assert [b["index"].tolist() for b in restored] == rest


def test_key_fn_must_return_plain_values() -> None:
    grouped = GroupBatchDataset(_source(), lambda s: s["x"], 2)
    with pytest.raises(TypeError, match="must be str, int, finite float, bool, None or tuples"):
        list(grouped)


def test_state_holds_keys_per_bucket_not_samples() -> None:
    grouped = GroupBatchDataset(_source(300), GroupOf(3), 64)
    iterator = iter(grouped)
    next(iterator)
    state = grouped.save_state()
    assert set(state) == {"phase", "epoch", "inner_done", "inner", "buckets"}
    assert sum(len(keys) for _, keys in state["buckets"]) == state["inner"]["position"] - 64
    assert len(json.dumps(state)) < 2500


@pytest.mark.parametrize("leftovers", ["emit", "drop"])
@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_is_exact(workers: int, leftovers: str) -> None:
    def build() -> el.SavableDataset:
        source = el.MapDataset(_source(41), AddNoise())
        return GroupBatchDataset(source, GroupOf(3), 4, batch_sizes={0: 2}, leftovers=leftovers)

    check_resume(build, num_workers=workers, epochs=2)


def test_restore_sample_rebuilds_the_batch() -> None:
    grouped = GroupBatchDataset(el.MapDataset(_source(), AddNoise()), GroupOf(2), 3)
    for batch in grouped:
        rebuilt = grouped.restore_sample(batch[el.RESTORE_KEY])
        assert torch.equal(rebuilt["noise"], batch["noise"])
        assert torch.equal(rebuilt["index"], batch["index"])


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("key", 2), {}, TypeError, "`key_fn` must be callable"),
        ((GroupOf(2), 0), {}, ValueError, "`batch_size` must be positive"),
        ((GroupOf(2), 2), {"batch_sizes": [(0, 2)]}, TypeError, "`batch_sizes` must be a mapping"),
        ((GroupOf(2), 2), {"batch_sizes": {0: 0}}, ValueError, r"`batch_sizes\[0\]` must be"),
        ((GroupOf(2), 2), {"batch_sizes": {frozenset([1]): 2}}, TypeError, "plain group keys"),
        ((GroupOf(2), 2), {"leftovers": "keep"}, ValueError, "'emit'.*'drop'"),
        ((GroupOf(2), 2), {"collate_fn": 3}, TypeError, "`collate_fn` must be callable"),
    ],
)
def test_constructor_rejects_bad_arguments(args, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        GroupBatchDataset(_source(), *args, **kwargs)
