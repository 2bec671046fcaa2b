"""Digests of restore keys: the shortcut for a batch of ``(index,)`` keys gives ``repr``'s
digest, and the digests states already hold (a proof is checked against them). Digests of
an item's values (``content_digest``): one per value in every process, every part counted,
large parts read at a stride."""

from __future__ import annotations

import copy
import datetime
import enum
import os
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from energy_loader.state.digests import RESTORE_KEY, _pickled, content_digest, digest, key_digest

_INDEX = st.one_of(st.integers(-(2**70), 2**70), st.booleans())
_KEYS = st.one_of(
    st.lists(st.tuples(_INDEX), max_size=40).map(tuple),
    st.lists(st.one_of(st.tuples(_INDEX), st.tuples(_INDEX, _INDEX)), max_size=6).map(tuple),
    st.lists(st.lists(st.integers(), min_size=1, max_size=1), max_size=4).map(tuple),
    st.tuples(st.integers()),
    st.text(max_size=3),
)


@given(key=_KEYS)
def test_a_key_digest_is_the_digest_of_its_repr(key: object) -> None:
    assert key_digest(key) == digest("key", key)


def test_key_digests_are_those_states_already_hold() -> None:
    # Values from the commit before the shortcut (ce66494).
    batch = tuple((i * 7919 % 60000,) for i in range(32))
    assert key_digest(batch) == "ffcfd5142bf08de5"
    assert key_digest(((3,), (-1,), (2**70,))) == "053a3beb1948f4f0"


# -- the digest of an item's values (the proof of what a pipeline made) -----------------------


class Point(NamedTuple):
    x: int
    y: float


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


class Opaque:
    """An object of a type the digest does not read: it counts by its type's name only."""

    def __init__(self, value: int) -> None:
        self.value = value


def made_item(*, sets: bool = True) -> dict:
    """An item of every kind the digest reads, built the same way in any process; without
    ``sets`` it is one the digest pickles rather than walks (a set's order is the process's)."""
    generator = torch.Generator().manual_seed(3)
    image = torch.randint(0, 255, (8, 3, 64, 64), dtype=torch.uint8, generator=generator)
    item = {
        "image": image,
        "channels_last": image.permute(0, 2, 3, 1),  # not contiguous
        "half": torch.linspace(0, 1, 50).to(torch.bfloat16),
        "grad": torch.ones(3, requires_grad=True),
        "array": np.arange(600, dtype=np.float32).reshape(20, 30).T,
        "tags": {"b", "a", "c"},  # a set: its iteration order depends on the hash seed
        "frozen": frozenset({("x", 1), ("y", 2)}),
        "point": Point(1, 2.5),
        "text": "é" * 100_000,  # sampled
        "bytes": bytes(range(256)) * 10,
        "ints": list(range(5000)),  # sampled
        "big": 2**200,
        "float": -0.0,
        "flags": (True, None, 1.5),
        "when": datetime.date(2024, 2, 29),
        "colour": Colour.BLUE,
        "scalar": np.int16(7),
        "opaque": Opaque(1),
        "small": np.arange(12, dtype=np.int32).reshape(3, 4).T,  # read in full, a view
        "small_tensor": torch.arange(10),
        "__restore_key__": ((1,), (2,)),
    }
    if not sets:
        del item["tags"], item["frozen"]
    return item


@pytest.mark.parametrize("sets", [True, False], ids=["walked", "pickled"])
def test_equal_values_have_one_digest_in_every_process(sets: bool) -> None:
    # Another process, with its own string hashing (this one's is drawn at random).
    code = (
        "from energy_loader.state.digests import content_digest\n"
        "from tests.state.test_digests import made_item\n"
        f"print(content_digest(made_item(sets={sets})))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "1"}
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert other.stdout.strip() == content_digest(made_item(sets=sets))
    assert (_pickled(made_item(sets=sets)) is None) == sets  # the two ways are both tested
    assert content_digest(made_item(sets=sets)) == content_digest(
        copy.deepcopy(made_item(sets=sets))
    )


def test_a_list_of_arrays_counts_each_array_its_order_and_its_container() -> None:
    """Documents batched as a list of token arrays: hashed array by array."""
    documents = [np.arange(5, dtype=np.uint16), np.arange(12, dtype=np.int32).reshape(3, 4)]
    as_views = [documents[0], np.ascontiguousarray(documents[1].T).T]  # not contiguous
    assert content_digest(as_views) == content_digest(documents)
    assert content_digest(tuple(documents)) != content_digest(documents)
    assert content_digest(documents[::-1]) != content_digest(documents)
    reshaped = [documents[0], documents[1].reshape(4, 3)]
    assert content_digest(reshaped) != content_digest(documents)
    changed = [documents[0], documents[1].copy()]
    changed[1][2, 3] += 1
    assert content_digest(changed) != content_digest(documents)
    objects = [np.array(["a", 1], dtype=object)]
    assert content_digest(objects) != content_digest([np.array(["a", 2], dtype=object)])


def test_objects_shared_or_not_have_one_digest() -> None:
    """The pickled digest depends on the values only: not on whether two parts are one
    object, nor on whether a string was interned."""
    sample = {"text": "".join(["ab", "c"]), "ids": [1, 2]}
    shared = [sample, sample]
    equal = [{"text": "abc", "ids": [1, 2]}, {"text": "abc", "ids": [1, 2]}]
    assert content_digest(shared) == content_digest(equal)


def test_the_order_of_entries_counts() -> None:
    assert content_digest({"a": 1, "b": 2}) != content_digest({"b": 2, "a": 1})
    assert content_digest({"a": 1, RESTORE_KEY: (3,)}) != content_digest(
        {"a": 1, RESTORE_KEY: (4,)}
    )


def _changed(name: str, item: dict) -> dict:
    item = copy.deepcopy(item)
    value = item[name]
    if name == "image":
        value[5] = 255 - value[5]  # one image of the batch, every pixel
    elif name == "channels_last":
        item[name] = value.clone()
        item[name][:, 20:40, 20:40, :] = 0  # a patch in the middle of each image
    elif name in ("half", "grad", "array"):
        item[name] = value * 2
    elif name == "text":
        item[name] = value[:50_000] + "e" * 50_000  # the second half
    elif name == "bytes":
        item[name] = value[:-1] + b"x"
    elif name in ("small", "small_tensor"):
        item[name] = value.copy() if name == "small" else value.clone()
        item[name][-1, ...] += 1  # the last row only
    elif name == "ints":
        item[name] = [v + 1 for v in value]
    else:
        item[name] = {
            "tags": {"a", "b", "d"},
            "frozen": frozenset({("x", 1), ("y", 3)}),
            "point": Point(1, 2.0),
            "big": 2**200 + 1,
            "float": 0.0,
            "flags": (True, None, 1),
            "when": datetime.date(2024, 3, 1),
            "colour": Colour.RED,
            "scalar": np.int32(7),
            "opaque": object(),
        }[name]
    return item


@pytest.mark.parametrize(
    ("name", "sets"),
    [
        (name, sets)
        for sets in (True, False)
        for name in made_item(sets=sets)
        if name != RESTORE_KEY
    ],
)
def test_every_part_of_an_item_counts(name: str, sets: bool) -> None:
    item = made_item(sets=sets)
    assert content_digest(_changed(name, item)) != content_digest(item)


def test_other_types_count_by_their_type_only() -> None:
    """What the digest cannot see (documented): an object's attributes, never its repr,
    which may hold an address that differs between processes."""
    assert content_digest(Opaque(1)) == content_digest(Opaque(2))
    assert content_digest(Opaque(1)) != content_digest(object())
    assert content_digest([1, 2]) != content_digest((1, 2)) != content_digest(Point(1, 2))
    assert content_digest(1) != content_digest(1.0) != content_digest(True)


def test_a_view_counts_as_its_values_and_a_cycle_ends() -> None:
    image = made_item()["image"]
    assert content_digest(image.permute(0, 2, 3, 1)) == content_digest(
        image.permute(0, 2, 3, 1).contiguous()
    )
    array = np.arange(600).reshape(20, 30)
    assert content_digest(array.T) == content_digest(np.ascontiguousarray(array.T))
    complex_values = torch.tensor([1 + 2j, 3 - 1j])
    assert content_digest([complex_values.conj()]) == content_digest(
        [complex_values.conj().resolve_conj()]
    )
    assert content_digest({"w": torch.ones(3, requires_grad=True)}) == content_digest(
        {"w": torch.ones(3)}
    )
    looped: list = [1]
    looped.append(looped)
    assert content_digest(looped) == content_digest(looped)


def test_a_large_batch_is_read_at_a_stride() -> None:
    """A guard against a blocking bug, not a speed target: the digest of a 256 x 3 x 224 x 224
    uint8 batch (measured in tens of microseconds; the budget is 1 ms) stays below 10 ms."""
    batch = {"image": torch.zeros(256, 3, 224, 224, dtype=torch.uint8), "label": torch.arange(256)}
    content_digest(batch)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        content_digest(batch)
        times.append(time.perf_counter() - began)
    assert sorted(times)[2] < 0.01


_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.binary(max_size=20),
        st.lists(st.integers(-100, 100), max_size=30).map(torch.tensor),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(st.text(max_size=5), inner, max_size=5),
    ),
    max_leaves=20,
)


@given(value=_VALUES)
def test_a_copy_has_the_digest_of_the_original(value: object) -> None:
    assert content_digest(copy.deepcopy(value)) == content_digest(value)
    assert content_digest([value, value]) == content_digest([value, copy.deepcopy(value)])
