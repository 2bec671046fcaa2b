"""Epoch semantics, restore keys and direct iteration of savable datasets (docs/concepts.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import energy_loader as el
from energy_loader.dataset import attach_restore_key
from tests.helpers import make_sample


def _source(length: int = 5, shuffle: bool = False) -> el.IndexedSource:
    return el.IndexedSource.from_fn(length, make_sample, shuffle=shuffle, seed=1)


def _indices(dataset) -> list[int]:
    return [s["index"] for s in dataset]


def test_each_iter_is_one_epoch_and_the_next_iter_the_next_epoch() -> None:
    source = _source(6, shuffle=True)
    first, second = _indices(source), _indices(source)
    assert sorted(first) == sorted(second) == list(range(6))
    assert first != second
    assert source.save_state()["epoch"] == 1


def test_saved_after_last_sample_before_end_restores_to_an_empty_epoch_then_the_next() -> None:
    source = _source(4, shuffle=True)
    iterator = iter(source)
    epoch0 = [next(iterator)["index"] for _ in range(4)]
    state = json.loads(json.dumps(source.save_state()))
    fresh = _source(4, shuffle=True)
    fresh.restore_state(state)
    assert _indices(fresh) == []
    reference = _source(4, shuffle=True)
    _indices(reference)
    assert _indices(fresh) == _indices(reference)
    assert sorted(epoch0) == list(range(4))


def test_saved_after_the_end_was_reported_restores_to_the_next_epoch() -> None:
    source = _source(4, shuffle=True)
    _indices(source)
    state = source.save_state()
    assert state["phase"] == "ended"
    fresh = _source(4, shuffle=True)
    fresh.restore_state(state)
    reference = _source(4, shuffle=True)
    _indices(reference)
    assert _indices(fresh) == _indices(reference)


def test_a_broken_off_iteration_continues_where_it_stopped() -> None:
    source = _source(6)
    iterator = iter(source)
    assert [next(iterator)["index"] for _ in range(2)] == [0, 1]
    assert _indices(source) == [2, 3, 4, 5]


def test_reset_state_starts_over() -> None:
    source = _source(3)
    _indices(source)
    source.reset_state()
    assert source.save_state()["epoch"] == 0
    assert _indices(source) == [0, 1, 2]


def test_restore_keys_ride_on_dicts_and_attributes_but_never_modify_the_source_data() -> None:
    stored = [{"value": i} for i in range(3)]
    source = el.IndexedSource(stored)
    out = list(source)
    assert [s[el.RESTORE_KEY] for s in out] == [(0,), (1,), (2,)]
    assert all(el.RESTORE_KEY not in s for s in stored)
    tensor = attach_restore_key(torch.zeros(2), (5,))
    assert el.restore_key_of(tensor) == (5,)
    array = attach_restore_key(np.zeros(2), (5,))
    assert el.restore_key_of(array) is None
    assert attach_restore_key(7, (1,)) == 7


def test_batch_keys_are_the_tuple_of_sample_keys_and_restore_sample_rebuilds_the_batch() -> None:
    pipeline = el.BatchDataset(el.MapDataset(_source(5), lambda s: {**s, "y": s["x"] * 2}), 2)
    batches = list(pipeline)
    assert [b[el.RESTORE_KEY] for b in batches] == [((0,), (1,)), ((2,), (3,)), ((4,),)]
    rebuilt = pipeline.restore_sample(batches[1][el.RESTORE_KEY])
    assert torch.equal(rebuilt["y"], batches[1]["y"])
    assert rebuilt["index"].tolist() == batches[1]["index"].tolist() == [2, 3]


def test_config_names_types_parameters_and_functions() -> None:
    pipeline = el.BatchDataset(el.MapDataset(_source(5), make_sample), 3, drop_last=True)
    config = pipeline.config()
    assert config["type"] == "BatchDataset"
    assert config["batch_size"] == 3 and config["drop_last"] is True
    assert config["inner"]["fn"] == "tests.helpers.make_sample"
    assert config["inner"]["inner"]["type"] == "IndexedSource"
    json.dumps(config)


def test_wrappers_refuse_what_is_not_a_savable_dataset() -> None:
    with pytest.raises(TypeError, match="wraps a SavableDataset"):
        el.MapDataset([1, 2, 3], make_sample)
