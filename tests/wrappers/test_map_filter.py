"""MapDataset and FilterDataset: per-sample seeding, pass-through state, validation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import AddNoise, DropMultiples, MakeSample
from tests.helpers import WORKERS_0_AND_2


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


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
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


# -- one seeding for a seeded read and the map or filter right above it ------------------------


class DrawingReads:
    """A dataset object whose ``__getitem__`` draws from python ``random`` and torch."""

    def __init__(self, length: int = 30) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return {"index": index, "read": (random.random(), float(torch.rand(())))}


class QuietReads(DrawingReads):
    """The same samples read without drawing anything."""

    def __getitem__(self, index: int) -> dict:
        return {"index": index}


def _seeded_like(pipeline: el.SavableDataset, scope: el.SavableDataset, index: int) -> tuple:
    """What ``DrawingReads`` then ``_draws`` give for ``index`` after one seeding of ``scope``
    (the module-level seeding function, not the pipeline's code path)."""
    from energy_loader.rng import seed_globals_for_sample

    seed_globals_for_sample(pipeline.context.seed, scope.stream_salt(), (index,))
    read = DrawingReads()[index]["read"]
    return read, _draws({})["draws"]


def test_a_map_right_on_a_seeded_source_seeds_once_for_the_read_and_its_function() -> None:
    pipeline = el.MapDataset(el.IndexedSource(DrawingReads(), shuffle=True, seed=2), _draws)
    got = {s["index"]: (s["read"], s["draws"]) for s in pipeline}
    assert got == {i: _seeded_like(pipeline, pipeline, i) for i in range(30)}
    assert pipeline.restore_sample((7,))["draws"] == got[7][1]
    # the read and the function draw different numbers from the one seeding
    assert all(read[0] != draws[0] for read, draws in got.values())


def test_a_read_that_draws_nothing_leaves_the_maps_draws_as_over_an_unseeded_source() -> None:
    over_object = el.MapDataset(el.IndexedSource(QuietReads(), shuffle=True, seed=2), _draws)
    over_fn = el.MapDataset(
        el.IndexedSource.from_fn(30, QuietReads().__getitem__, shuffle=True, seed=2), _draws
    )
    assert [(s["index"], s["draws"]) for s in over_object] == [
        (s["index"], s["draws"]) for s in over_fn
    ]


def test_reads_keep_their_own_seeding_where_no_seeding_wrapper_sits_right_above() -> None:
    def reads(pipeline: el.SavableDataset) -> dict[int, tuple]:
        return {s["index"]: s["read"] for s in pipeline}

    def source() -> el.IndexedSource:
        return el.IndexedSource(DrawingReads(), shuffle=True, seed=2)

    alone = reads(source())
    assert reads(el.MapDataset(source(), _draws, seed_per_sample=False)) == alone
    assert reads(el.MapDataset(source().shuffle_buffer(4), _draws)) == alone
    assert reads(el.MapDataset(source(), _draws)) != alone  # the map's seeding took the read


def test_a_second_wrapper_on_the_same_source_seeds_for_itself() -> None:
    source = el.IndexedSource(DrawingReads(), shuffle=True, seed=2)
    first = el.MapDataset(source, _draws)
    second = el.MapDataset(source, _draws)
    got = {s["index"]: (s["read"], s["draws"]) for s in second}
    for index, (read, draws) in got.items():
        assert read == _seeded_like(first, first, index)[0]  # read under the first's seed
        from energy_loader.rng import seed_globals_for_sample

        seed_globals_for_sample(second.context.seed, second.stream_salt(), (index,))
        assert draws == _draws({})["draws"]


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_shared_seeding_resumes_exactly_through_a_shuffle_buffer_and_a_filter(workers: int) -> None:
    def build() -> el.SavableDataset:
        source = el.IndexedSource(DrawingReads(40), shuffle=True, seed=2)
        kept = el.FilterDataset(source, lambda s: random.random() < 0.7)
        mapped = el.MapDataset(el.IndexedSource(DrawingReads(40), seed=4), _draws)
        return el.ConcatDataset(kept, mapped).shuffle_buffer(6).batch(4)

    check_resume(build, num_workers=workers)
