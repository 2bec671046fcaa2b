"""Damaged states: always StateFormatError or StateMismatchError, never a hang, no harm done."""

from __future__ import annotations

import copy
import io
import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.state import load_checkpoint, save_checkpoint
from tests.helpers import indices, reference_pipeline, resealed

STATE_ERRORS = (el.StateFormatError, el.StateMismatchError)


def _loader(workers: int) -> el.SavableDataLoader:
    # Frequent worker checkpoints, so that the saved ones hold a filled shuffle buffer.
    options = {"checkpoint_every_n_samples": 2} if workers else {}
    return el.SavableDataLoader(reference_pipeline(400, 20, 4), num_workers=workers, **options)


def _saved(workers: int) -> tuple[dict[str, Any], list[list[int]]]:
    loader = _loader(workers)
    iterator = iter(loader)
    for _ in range(17):
        next(iterator)
    state = loader.save_state_rank()
    rest = [indices(b) for b in iterator]
    return state, rest


@pytest.fixture(scope="module")
def saved_in_process() -> tuple[dict[str, Any], list[list[int]]]:
    return _saved(0)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a node inside a nested state."""
    out = [prefix]
    if isinstance(value, dict):
        for name, item in value.items():
            out += _paths(item, (*prefix, name))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out += _paths(item, (*prefix, index))
    return out


def _get(value: Any, path: tuple) -> Any:
    for part in path:
        value = value[part]
    return value


_WRONG_TYPES = st.sampled_from(["text", 3.5, None, [], {}, -7, True, [[1]], {"x": 1}])


@st.composite
def damaged(draw: st.DrawFn, state: dict[str, Any]) -> dict[str, Any]:
    """A state with one node replaced by a value of another type, or removed."""
    broken = copy.deepcopy(state)
    paths = [p for p in _paths(broken) if p]
    path = draw(st.sampled_from(paths))
    parent, leaf = _get(broken, path[:-1]), path[-1]
    original = parent[leaf]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[leaf]
        return broken
    replacement = draw(_WRONG_TYPES.filter(lambda v: type(v) is not type(original)))
    if isinstance(original, int) and not isinstance(original, bool) and isinstance(parent, list):
        replacement = draw(st.sampled_from([-1, 10**12, "1"]))  # a key index out of range
    parent[leaf] = replacement
    return broken


@settings(max_examples=60)
@given(data=st.data())
def test_damaged_states_raise_state_errors_and_leave_the_loader_usable(
    data: st.DataObject, saved_in_process
) -> None:
    state, rest = saved_in_process
    broken = data.draw(damaged(state))
    loader = el.SavableDataLoader(reference_pipeline(400, 20, 4))
    try:
        loader.load_state_dict(broken)
    except STATE_ERRORS:
        pass
    else:
        # Accepted: the damage only removed/changed something restore may legitimately
        # ignore (e.g. a config string). It must then still continue exactly.
        assert [indices(b) for b in loader] == rest
        return
    loader.restore_state_rank(state)
    assert [indices(b) for b in loader] == rest


@st.composite
def edited(draw: st.DrawFn, state: dict[str, Any]) -> dict[str, Any]:
    """A state with one value changed to another of its own type: what a flipped digit, a
    hand edit or a field of another save spliced in looks like (well formed, wrong)."""
    broken = copy.deepcopy(state)
    paths = [p for p in _paths(broken) if p and not isinstance(_get(broken, p), (dict, list))]
    path = draw(st.sampled_from(paths))
    parent, leaf = _get(broken, path[:-1]), path[-1]
    original = parent[leaf]
    if isinstance(original, bool):
        parent[leaf] = not original
    elif isinstance(original, int):
        parent[leaf] = original + draw(st.sampled_from([-1, 1, 2, 7]))
    elif isinstance(original, float):
        parent[leaf] = original + 0.5
    elif isinstance(original, str):
        parent[leaf] = original[:-1] + ("0" if original[-1:] != "0" else "1")
    else:  # None: a value where there was none
        parent[leaf] = 0
    return broken


@settings(max_examples=60)
@given(data=st.data())
def test_a_value_changed_anywhere_in_a_state_is_refused_or_continues_exactly(
    data: st.DataObject, saved_in_process
) -> None:
    """No silent divergence: whatever single value of a saved state changes, the restore
    raises or yields exactly what the uninterrupted run yielded next."""
    state, rest = saved_in_process
    broken = data.draw(edited(state))
    loader = el.SavableDataLoader(reference_pipeline(400, 20, 4))
    try:
        loader.load_state_dict(broken)
        resumed = [indices(b) for b in loader]
    except STATE_ERRORS:
        return
    assert resumed == rest


@pytest.mark.parametrize(
    "garbage",
    [None, 0, "x", b"\x80\x04", [], {}, {"format": "energy_loader.rank_state"}, [{"a": 1}]],
)
def test_things_that_are_not_states(garbage) -> None:
    loader = el.SavableDataLoader(reference_pipeline(100, 4, 4))
    with pytest.raises(el.StateFormatError):
        loader.load_state_dict(garbage)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["version", "other_pipeline", "workers", "key_range"])
def test_damaged_states_with_workers_fail_before_any_worker_starts(damage: str) -> None:
    state, rest = _saved(2)
    broken = copy.deepcopy(state)
    expected: type[Exception] = el.StateFormatError
    if damage == "version":
        broken["version"] = 99
    elif damage == "other_pipeline":
        broken["config"]["batch_size"] = 5
        broken = resealed(broken)  # a state of another pipeline, not an edited one
        expected = el.StateMismatchError
    elif damage == "workers":
        broken["workers"].pop()
    else:
        buffered = broken["partitions"][1]["checkpoint"]["inner"]["indices"]
        buffered[0] = 10**9
    loader = _loader(2)
    with pytest.raises(expected):
        loader.restore_state_rank(broken)
    assert loader._iterator is None, "no worker may have been started for a bad state"
    loader.restore_state_rank(state)
    assert [indices(b) for b in loader] == rest


@settings(max_examples=40)
@given(cut=st.integers(min_value=0), flip=st.integers(min_value=0))
def test_truncated_or_flipped_checkpoint_files(tmp_path_factory, cut: int, flip: int) -> None:
    directory = tmp_path_factory.mktemp("fuzz")
    path = save_checkpoint(directory / "c.pt", {"loader": {"a": [1, 2, 3]}, "step": 4})
    data = bytearray(path.read_bytes())
    data = data[: cut % len(data)] if cut % 3 else data
    if data:
        data[flip % len(data)] ^= 0x5A
    path.write_bytes(bytes(data))
    try:
        payload = load_checkpoint(path)
    except el.StateFormatError:
        return
    # A flip in zip padding or metadata that torch ignores leaves the payload intact.
    assert payload == {"loader": {"a": [1, 2, 3]}, "step": 4}


def test_states_survive_json_and_weights_only_torch_round_trips(saved_in_process) -> None:
    state, _ = saved_in_process
    assert json.loads(json.dumps(state)) == json.loads(json.dumps(state))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state
