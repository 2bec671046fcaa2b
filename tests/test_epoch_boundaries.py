"""An epoch whose items have all been taken is over, whether or not its end was reported.

The reference is a torch DataLoader's epoch sequence: ``list(loader)`` once per epoch. Consumers
that stop after exactly the epoch's items (Lightning, ``zip``, ``islice``, ``range(len(...))``),
that break early and come back, or that pull ``StopIteration`` must all see that sequence,
also when the loader is saved and restored anywhere, epoch boundaries included.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.testing.compare import first_difference
from energy_loader.testing.strategies import PipelineSpec, pipelines
from tests.helpers import indices


def _issue_pipeline() -> el.SavableDataset:
    source = el.IndexedSource.from_fn(96, lambda i: {"index": i}, shuffle=True, seed=1)
    return el.BatchDataset(source, batch_size=8)


def _flat(batches: list[Any]) -> list[int]:
    return [i for batch in batches for i in indices(batch)]


@pytest.mark.parametrize("workers", [0, 2])
def test_taking_len_items_ends_the_epoch(workers: int) -> None:
    reference = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    epochs = [_flat(list(reference)) for _ in range(3)]
    assert all(sorted(epoch) == list(range(96)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # a new shuffle every epoch

    loader = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    n = len(loader)
    assert n == 12
    first = list(itertools.islice(iter(loader), n))
    second = list(iter(loader))
    third = [batch for _, batch in zip(range(n), loader)]
    assert [_flat(first), _flat(second), _flat(third)] == epochs


@pytest.mark.parametrize("workers", [0, 2])
def test_a_break_with_items_left_continues_the_epoch(workers: int) -> None:
    reference = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    epochs = [_flat(list(reference)) for _ in range(2)]
    loader = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    got = []
    for batch in loader:
        got.append(batch)
        if len(got) == 5:
            break
    got += list(loader)  # the rest of epoch 0, then StopIteration
    got += list(loader)  # epoch 1
    assert _flat(got) == epochs[0] + epochs[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_the_last_item_restores_to_epoch_over(workers: int) -> None:
    reference = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    epochs = [_flat(list(reference)) for _ in range(2)]
    loader = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    first = list(itertools.islice(iter(loader), len(loader)))
    state = json.loads(json.dumps(loader.save_state_rank()))
    restored = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    restored.restore_state_rank(state)
    assert _flat(first) == epochs[0]
    assert _flat(list(restored)) == epochs[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_held_back_saves_the_position_before_the_last_items(workers: int) -> None:
    loader = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    iterator = iter(loader)
    taken = [next(iterator) for _ in range(6)]
    state = loader.save_state_rank(held_back=2)
    restored = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    restored.restore_state_rank(state)
    rest = list(restored)
    assert _flat(taken[:4] + rest) == _flat(taken + list(iterator))
    with pytest.raises(ValueError, match="at most 2"):
        loader.save_state_rank(held_back=3)
    fresh = el.SavableDataLoader(_issue_pipeline(), num_workers=workers)
    with pytest.raises(ValueError, match="only 0 item"):
        fresh.save_state_rank(held_back=1)


# -- the property ----------------------------------------------------------------------------


def _epochs(spec: PipelineSpec, workers: int, count: int) -> list[list[Any]]:
    loader = el.SavableDataLoader(spec.build(), num_workers=workers)
    return [list(loader) for _ in range(count)]


@st.composite
def _consumers(draw: st.DrawFn, sizes: list[int]) -> list[tuple[str, int, bool]]:
    """Per epoch: how the consumer takes it, where it stops early, and whether it saves."""
    plan = []
    for size in sizes:
        how = draw(st.sampled_from(["exactly_len", "break_then_rest", "until_stop"]))
        cut = draw(st.integers(0, size))
        plan.append((how, cut, draw(st.booleans())))
    return plan


@settings(max_examples=10)
@given(
    data=st.data(),
    spec=pipelines(max_length=30, max_depth=4),
    workers=st.integers(0, 3),
)
def test_any_consumer_sees_the_torch_epoch_sequence(
    data: st.DataObject, spec: PipelineSpec, workers: int
) -> None:
    expected = _epochs(spec, workers, 3)
    plan = data.draw(_consumers([len(epoch) for epoch in expected]), label="consumers")
    loader = el.SavableDataLoader(spec.build(), num_workers=workers)

    def maybe_restore(save: bool) -> None:
        nonlocal loader
        if save:
            state = json.loads(json.dumps(loader.save_state_rank()))
            loader._shutdown_workers()
            loader = el.SavableDataLoader(spec.build(), num_workers=workers)
            loader.restore_state_rank(state)

    got: list[Any] = []
    for epoch, (how, cut, save) in zip(expected, plan):
        if how == "exactly_len":  # a sized consumer: zip/islice/Lightning
            got += list(itertools.islice(iter(loader), len(epoch)))
            maybe_restore(save)
        elif how == "break_then_rest":
            got += list(itertools.islice(iter(loader), cut))
            maybe_restore(save)
            got += list(itertools.islice(iter(loader), len(epoch) - cut))
        else:
            got += list(loader)
            maybe_restore(save)
    want = [item for epoch in expected for item in epoch]
    assert len(got) == len(want)
    for position, (a, b) in enumerate(zip(want, got)):
        assert first_difference(a, b) is None, f"item {position}: {first_difference(a, b)}"


def test_epoch_is_the_epoch_of_the_last_item() -> None:
    loader = el.SavableDataLoader(_issue_pipeline())
    assert loader.epoch == 0
    first = list(itertools.islice(iter(loader), len(loader)))
    assert loader.epoch == 0 and len(first) == 12
    state = loader.save_state_rank()
    next(iter(loader))
    assert loader.epoch == 1
    restored = el.SavableDataLoader(_issue_pipeline())
    restored.restore_state_rank(state)
    next(iter(restored))
    assert restored.epoch == 1
    list(restored)  # the rest of epoch 1, then its end
    assert restored.epoch == 2
