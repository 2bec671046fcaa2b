"""MapDataset and FilterDataset: per-sample seeding, pass-through state, validation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import AddNoise, DropMultiples, MakeSample


def _source(length: int = 30) -> el.IndexedSource:
    return el.IndexedSource.from_fn(length, MakeSample(), shuffle=True, seed=2)


def _draws(sample: dict) -> dict:
    return {**sample, "draws": (random.random(), float(np.random.rand()), float(torch.rand(())))}


def test_random_draws_are_a_function_of_the_restore_key() -> None:
    first = {s["index"]: s["draws"] for s in el.MapDataset(_source(), _draws)}
    second = {s["index"]: s["draws"] for s in el.MapDataset(_source(), _draws)}
    assert first == second
    assert len({d for d in first.values()}) == len(first)
    pipeline = el.MapDataset(_source(), _draws)
    assert pipeline.restore_sample((7,))["draws"] == first[7]


def test_seed_per_sample_false_leaves_the_global_rngs_alone() -> None:
    random.seed(123)
    expected = random.random()
    random.seed(123)
    list(el.MapDataset(_source(3), lambda s: s, seed_per_sample=False))
    assert random.random() == expected


def test_random_draws_do_not_depend_on_the_worker_layout() -> None:
    def draws(workers: int) -> dict[int, tuple]:
        loader = el.SavableDataLoader(el.MapDataset(_source(), _draws), num_workers=workers)
        return {s["index"]: s["draws"] for s in loader}

    assert draws(0) == draws(2)


@pytest.mark.parametrize("workers", [0, 2])
def test_map_and_filter_resume_exactly(workers: int) -> None:
    check_resume(
        lambda: el.FilterDataset(el.MapDataset(_source(), AddNoise()), DropMultiples(3)),
        num_workers=workers,
    )


def test_filter_keeps_what_the_predicate_accepts_and_passes_state_through() -> None:
    pipeline = el.FilterDataset(el.IndexedSource.from_fn(10, MakeSample()), DropMultiples(3))
    assert [s["index"] for s in pipeline] == [1, 2, 4, 5, 7, 8]
    assert pipeline.save_state() == pipeline.dataset.save_state()


def test_errors_in_user_functions_name_the_wrapper_and_the_key() -> None:
    def explode(sample: dict) -> dict:
        raise KeyError("boom")

    with pytest.raises(KeyError) as info:
        list(el.MapDataset(_source(3), explode))
    assert any("in MapDataset for restore key" in note for note in info.value.__notes__)


def test_constructors_reject_bad_arguments() -> None:
    with pytest.raises(TypeError, match="`fn` must be callable"):
        el.MapDataset(_source(), 3)
    with pytest.raises(TypeError, match="`predicate` must be callable"):
        el.FilterDataset(_source(), None)
    with pytest.raises(TypeError, match="`seed_per_sample` must be True or False"):
        el.MapDataset(_source(), _draws, seed_per_sample=1)
