"""Code that changed between a save and a restore is never silent.

A user function's config entry carries a fingerprint of its code (``fn_code``,
``predicate_code``, ...). A restore whose functions kept their names but changed their code (a
fixed bug) continues with a ``CodeChangedWarning`` naming them, or refuses with
``on_code_change="refuse"``. The oracle is a function whose code object is swapped by hand,
as an edit of the file between two runs would.
"""

from __future__ import annotations

import functools
import warnings

import pytest

import energy_loader as el
from energy_loader.dataset import code_fingerprint
from energy_loader.testing.strategies import MakeSample
from tests.helpers import indices, resealed


def _plus_one(sample: dict) -> dict:
    return {**sample, "y": sample["index"] + 1}


def _plus_two(sample: dict) -> dict:
    return {**sample, "y": sample["index"] + 2}


def _plus_one_index(index: int) -> dict:
    return {"index": index, "y": index + 1}


def _plus_two_index(index: int) -> dict:
    return {"index": index, "y": index + 2}


_ORIGINAL_INDEX_CODE = _plus_one_index.__code__

_ORIGINAL_CODE = _plus_one.__code__


class _Scale:
    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __call__(self, sample: dict) -> dict:
        return {**sample, "y": sample["index"] * self.factor}


@pytest.fixture(autouse=True)
def _original_code():
    yield
    _plus_one.__code__ = _ORIGINAL_CODE


def _pipeline() -> el.SavableDataset:
    source = el.IndexedSource.from_fn(60, MakeSample(), shuffle=True, seed=5)
    return el.BatchDataset(el.MapDataset(source, _plus_one), batch_size=4)


def _saved(steps: int = 3) -> tuple[dict, list[list[int]]]:
    loader = el.SavableDataLoader(_pipeline())
    iterator = iter(loader)
    for _ in range(steps):
        next(iterator)
    return loader.save_state_rank(), [indices(batch) for batch in iterator]


def test_the_fingerprint_follows_the_code_not_the_name() -> None:
    before = code_fingerprint(_plus_one)
    assert code_fingerprint(_plus_one) == before
    _plus_one.__code__ = _plus_two.__code__
    assert code_fingerprint(_plus_one) != before
    assert code_fingerprint(lambda s: s) != code_fingerprint(lambda s: [s])
    # A callable object by its class and its plain-data attributes; a partial by its function
    # and arguments.
    assert code_fingerprint(_Scale(2)) == code_fingerprint(_Scale(2))
    assert code_fingerprint(_Scale(2)) != code_fingerprint(_Scale(3))
    assert code_fingerprint(functools.partial(_plus_two)) != code_fingerprint(_plus_two)
    assert code_fingerprint(len) == code_fingerprint(len)  # a builtin: its name only


def test_a_restore_with_changed_code_warns_naming_the_function_and_continues() -> None:
    state, rest = _saved()
    _plus_one.__code__ = _plus_two.__code__
    loader = el.SavableDataLoader(_pipeline())
    with pytest.warns(el.CodeChangedWarning, match=r"MapDataset\.fn"):
        loader.restore_state_rank(state)
    batches = list(loader)
    assert [indices(batch) for batch in batches] == rest  # the same position
    assert all(int(y) == int(i) + 2 for b in batches for i, y in zip(b["index"], b["y"]))


def test_from_fn_is_user_code_whose_change_warns_naming_it() -> None:
    def build() -> el.SavableDataset:
        return el.BatchDataset(el.IndexedSource.from_fn(60, _plus_one_index), batch_size=4)

    saving = el.SavableDataLoader(build())
    iterator = iter(saving)
    for _ in range(3):
        next(iterator)
    state = saving.save_state_rank()
    _plus_one_index.__code__ = _plus_two_index.__code__
    try:
        with pytest.warns(el.CodeChangedWarning, match=r"BatchDataset > IndexedSource\.from_fn "):
            el.SavableDataLoader(build()).restore_state_rank(state)
    finally:
        _plus_one_index.__code__ = _ORIGINAL_INDEX_CODE


def test_on_code_change_refuse_refuses_naming_the_function() -> None:
    state, _ = _saved()
    _plus_one.__code__ = _plus_two.__code__
    loader = el.SavableDataLoader(_pipeline(), on_code_change="refuse")
    with pytest.raises(el.StateMismatchError, match=r"MapDataset\.fn.*on_code_change='warn'"):
        loader.restore_state_rank(state)


def test_unchanged_code_and_states_without_fingerprints_restore_quietly() -> None:
    state, rest = _saved()
    older = resealed(state)
    del older["config"]["inner"]["fn_code"]  # a state saved before fingerprints
    del older["config"]["inner"]["inner"]["from_fn_code"]  # ... and before from_fn's
    older = resealed(older)
    for saved in (state, older):
        loader = el.SavableDataLoader(_pipeline())
        with warnings.catch_warnings():
            warnings.simplefilter("error", el.CodeChangedWarning)
            loader.restore_state_rank(saved)
        assert [indices(batch) for batch in loader] == rest


def test_on_code_change_takes_warn_or_refuse() -> None:
    with pytest.raises(ValueError, match="on_code_change"):
        el.SavableDataLoader(_pipeline(), on_code_change="ignore")


def test_the_warning_comes_through_state_dict_leaves_and_rank_files(tmp_path) -> None:
    loader = el.SavableDataLoader(_pipeline())
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    leaves = loader.state_dict()
    el.save_state_rank_file(loader, tmp_path)
    rest = [indices(batch) for batch in iterator]
    _plus_one.__code__ = _plus_two.__code__
    for restore in (
        lambda fresh: fresh.load_state_dict(leaves),
        lambda fresh: el.restore_state_rank_file(fresh, tmp_path),
    ):
        fresh = el.SavableDataLoader(_pipeline())
        with pytest.warns(el.CodeChangedWarning, match=r"MapDataset\.fn"):
            restore(fresh)
        assert [indices(batch) for batch in fresh] == rest
