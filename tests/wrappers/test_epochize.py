"""EpochizeDataset: fixed-length epochs that continue the stream, exact resume."""

from __future__ import annotations

import pytest

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import AddNoise, MakeSample
from energy_loader.wrappers import BlendDataset, EpochizeDataset
from tests.helpers import WORKERS_0_AND_2


def _source(length: int, seed: int = 0, shuffle: bool = False) -> el.IndexedSource:
    return el.IndexedSource.from_fn(length, MakeSample(), shuffle=shuffle, seed=seed)


def _epochs(dataset: el.SavableDataset, count: int) -> list[list[int]]:
    return [[sample["index"] for sample in dataset] for _ in range(count)]


def test_each_epoch_continues_where_the_last_one_stopped() -> None:
    epochized = EpochizeDataset(el.RepeatDataset(_source(10)), 4)
    assert _epochs(epochized, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5]]
    assert len(epochized) == 4


def test_a_finite_inner_dataset_rolls_over_into_its_next_epoch() -> None:
    epochized = EpochizeDataset(_source(5, seed=3, shuffle=True), 3)
    stream = [i for epoch in _epochs(epochized, 4) for i in epoch]
    assert sorted(stream[:5]) == sorted(stream[5:10]) == [0, 1, 2, 3, 4]
    assert stream[:5] != stream[5:10], "the inner dataset reshuffles at its own epoch end"


def test_an_epoch_boundary_on_the_inner_epoch_boundary() -> None:
    epochized = EpochizeDataset(_source(4), 4)
    assert _epochs(epochized, 3) == [[0, 1, 2, 3]] * 3


def test_an_inner_epoch_without_samples_is_an_error_not_a_hang() -> None:
    epochized = EpochizeDataset(el.LimitDataset(_source(5), 0), 3)
    with pytest.raises(el.EnergyLoaderError, match="yielded no sample in a whole epoch"):
        list(epochized)


def test_state_holds_counts_and_the_inner_state() -> None:
    epochized = EpochizeDataset(_source(5), 3)
    _epochs(epochized, 1)
    iterator = iter(epochized)
    next(iterator)
    state = epochized.save_state()
    assert {k: state[k] for k in ("phase", "epoch", "count", "pass_count")} == {
        "phase": "running",
        "epoch": 1,
        "count": 1,
        "pass_count": 4,
    }
    assert state["inner"]["position"] == 4


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_is_exact(workers: int) -> None:
    check_resume(
        lambda: EpochizeDataset(el.MapDataset(_source(7, 1, shuffle=True), AddNoise()), 5),
        num_workers=workers,
        epochs=4,
    )


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_of_an_epochized_endless_blend(workers: int) -> None:
    def build() -> EpochizeDataset:
        blend = BlendDataset(
            (el.RepeatDataset(_source(6, 1, shuffle=True)), 2.0),
            (el.RepeatDataset(el.ShuffleBufferDataset(_source(5, 2), 3)), 1.0),
        )
        return EpochizeDataset(el.BatchDataset(blend, 3), 4)

    check_resume(build, num_workers=workers, epochs=3)


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`length` must be positive"):
        EpochizeDataset(_source(3), 0)
    with pytest.raises(TypeError, match="`length` must be an integer"):
        EpochizeDataset(_source(3), 2.5)
    with pytest.raises(TypeError, match="wraps a SavableDataset"):
        EpochizeDataset([1, 2, 3], 2)
