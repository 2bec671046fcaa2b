"""default_collate: the batches torch's default_collate makes, and lists where torch fails."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate as torch_collate

import energy_loader as el
from energy_loader.wrappers.collate import collate_keeping_tuples

Pair = namedtuple("Pair", ["left", "right"])

_TORCH_DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]
_NUMPY_DTYPES = [np.float32, np.float64, np.int64, np.int16, np.uint8, np.bool_]


def _leaf_schemas() -> st.SearchStrategy[tuple[Any, ...]]:
    shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)
    return st.one_of(
        st.tuples(st.just("tensor"), shapes, st.sampled_from(_TORCH_DTYPES)),
        st.tuples(st.just("array"), shapes, st.sampled_from(_NUMPY_DTYPES)),
        st.tuples(st.just("npscalar"), st.sampled_from(_NUMPY_DTYPES)),
        st.just(("int",)),
        st.just(("float",)),
        st.just(("bool",)),
        st.just(("str",)),
    )


_schemas = st.recursive(
    _leaf_schemas(),
    lambda inner: st.one_of(
        st.tuples(st.just("dict"), st.dictionaries(st.sampled_from("abcd"), inner, min_size=1)),
        st.tuples(st.just("tuple"), st.lists(inner, min_size=1, max_size=3).map(tuple)),
        st.tuples(st.just("list"), st.lists(inner, min_size=1, max_size=3).map(tuple)),
        st.tuples(st.just("pair"), st.tuples(inner, inner)),
    ),
    max_leaves=6,
)


def _values(schema: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    """Samples that all follow ``schema`` (so torch's collate accepts a list of them)."""
    kind = schema[0]
    if kind in ("tensor", "array"):
        _, shape, dtype = schema
        size = int(np.prod(shape))
        numbers = st.lists(st.integers(0, 100), min_size=size, max_size=size)
        if kind == "array":
            return numbers.map(lambda v: np.array(v).astype(dtype).reshape(shape))
        return numbers.map(lambda v: torch.tensor(v).to(dtype).reshape(shape))
    if kind == "npscalar":
        return st.integers(0, 100).map(schema[1])
    if kind == "int":
        return st.integers(-(2**40), 2**40)
    if kind == "float":
        return st.floats(allow_nan=False, allow_infinity=False, width=64)
    if kind == "bool":
        return st.booleans()
    if kind == "str":
        return st.text(max_size=4)
    if kind == "dict":
        return st.fixed_dictionaries({name: _values(s) for name, s in schema[1].items()})
    parts = st.tuples(*(_values(s) for s in schema[1]))
    if kind == "list":
        return parts.map(list)
    if kind == "pair":
        return parts.map(lambda p: Pair(*p))
    return parts


_batches = _schemas.flatmap(lambda schema: st.lists(_values(schema), min_size=1, max_size=4))


def _assert_same(ours: Any, theirs: Any, path: str = "batch") -> None:
    """Same structure, types, dtypes, shapes and values; list and tuple count as one kind
    (torch gives a list for tuple samples and a tuple for a column of strings in a tuple)."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{path}: {type(ours)} is not a tensor"
        assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: shape {ours.shape} != {theirs.shape}"
        assert torch.equal(ours, theirs), f"{path}: values differ"
    elif isinstance(theirs, dict):
        assert type(ours) is type(theirs) and ours.keys() == theirs.keys(), path
        for name in theirs:
            _assert_same(ours[name], theirs[name], f"{path}[{name!r}]")
    elif hasattr(theirs, "_fields"):
        assert type(ours) is type(theirs), f"{path}: {type(ours)} != {type(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, f"{path}.{theirs._fields[i]}")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, f"{path}[{i}]")
    else:
        assert type(ours) is type(theirs) and ours == theirs, f"{path}: {ours!r} != {theirs!r}"


@settings(max_examples=150, deadline=None)
@given(_batches)
def test_equals_torch_default_collate_where_torch_accepts(samples: list[Any]) -> None:
    _assert_same(el.default_collate(samples), torch_collate(samples))


def test_tuple_samples_give_a_list_of_columns_as_torch() -> None:
    batch = el.default_collate([(torch.ones(2), 1), (torch.zeros(2), 0)])
    assert type(batch) is list and batch[1].tolist() == [1, 0]
    assert type(torch_collate([(torch.ones(2), 1), (torch.zeros(2), 0)])) is list


def test_a_string_column_of_tuple_samples_stays_a_tuple_as_torch() -> None:
    samples = [("a", 1), ("b", 2)]
    assert el.default_collate(samples)[0] == torch_collate(samples)[0] == ("a", "b")


def test_batch_dataset_keeps_tuple_columns_in_a_tuple_for_unbatch() -> None:
    samples = [(torch.ones(2), 1), (torch.zeros(2), 0)]
    batch = collate_keeping_tuples(samples)
    assert type(batch) is tuple and batch[1].tolist() == [1, 0]


def test_restore_key_entries_are_dropped() -> None:
    samples = [{"x": i, el.RESTORE_KEY: (i,)} for i in range(3)]
    assert list(el.default_collate(samples)) == ["x"]


@pytest.mark.parametrize(
    "samples",
    [
        [torch.zeros(1), torch.zeros(2)],
        [np.zeros(3), np.zeros((1, 3))],
        [[1, 2], [3]],
        [(1, 2), (3,)],
        [2**70, 1],
        [np.array(["a"]), np.array(["b"])],
        [torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)] * 2,
    ],
    ids=["tensors", "arrays", "lists", "tuples", "overflow", "str-arrays", "nested"],
)
def test_kept_as_a_list_where_torch_raises(samples: list[Any]) -> None:
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        torch_collate(samples)
    batch = el.default_collate(samples)
    assert type(batch) is list and len(batch) == len(samples)
    assert all(a is b for a, b in zip(batch, samples))


def test_ragged_entries_inside_dicts_stay_lists_and_the_rest_collates() -> None:
    samples = [{"ids": torch.arange(n), "tokens": list(range(n)), "n": n} for n in (1, 2, 3)]
    batch = el.default_collate(samples)
    assert [t.tolist() for t in batch["ids"]] == [[0], [0, 1], [0, 1, 2]]
    assert batch["tokens"] == [[0], [0, 1], [0, 1, 2]]
    assert torch.equal(batch["n"], torch.tensor([1, 2, 3]))


def test_other_objects_stay_a_list_and_empty_input_gives_an_empty_list() -> None:
    objects = [object(), object()]
    assert el.default_collate(objects) == objects
    assert el.default_collate([]) == []
