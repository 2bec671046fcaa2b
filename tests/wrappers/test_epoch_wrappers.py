"""RepeatDataset and LimitDataset: epoch boundaries and exact resume across them."""

from __future__ import annotations

import pytest

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import MakeSample
from tests.helpers import WORKERS_0_AND_2


def _source(length: int = 7, shuffle: bool = True) -> el.IndexedSource:
    return el.IndexedSource.from_fn(length, MakeSample(), shuffle=shuffle, seed=8)


def _indices(dataset) -> list[int]:
    return [s["index"] for s in dataset]


def test_repeat_n_runs_n_reshuffled_inner_epochs_per_epoch() -> None:
    repeated = _indices(el.RepeatDataset(_source(), 3))
    assert len(repeated) == 21
    thirds = [repeated[i * 7 : (i + 1) * 7] for i in range(3)]
    assert all(sorted(t) == list(range(7)) for t in thirds)
    assert thirds[0] != thirds[1]
    assert len(el.RepeatDataset(_source(), 3)) == 21


def test_endless_repeat_keeps_going_and_refuses_an_empty_inner_epoch() -> None:
    endless = iter(el.RepeatDataset(_source()))
    assert len([next(endless) for _ in range(50)]) == 50
    with pytest.raises(el.EnergyLoaderError, match="yielded no sample in a whole epoch"):
        next(iter(el.RepeatDataset(el.LimitDataset(_source(), 0))))
    with pytest.raises(TypeError, match="endless"):
        len(el.RepeatDataset(_source()))


def test_limit_takes_the_first_n_of_each_inner_epoch() -> None:
    limited = el.LimitDataset(_source(10), 4)
    first, second = _indices(limited), _indices(limited)
    assert len(first) == len(second) == 4
    assert first != second, "the inner epoch restarts (reshuffled) in every limited epoch"
    assert len(limited) == 4
    assert _indices(el.LimitDataset(_source(3), 10)) != []


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_repeat_and_limit_resume_exactly(workers: int) -> None:
    check_resume(
        lambda: el.LimitDataset(el.RepeatDataset(_source(9), 2), 13), num_workers=workers, epochs=3
    )
    check_resume(
        lambda: el.RepeatDataset(el.LimitDataset(_source(9), 4), 3), num_workers=workers, epochs=2
    )


def test_constructors_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`repeats` must be positive"):
        el.RepeatDataset(_source(), 0)
    with pytest.raises(ValueError, match="`length` must be >= 0"):
        el.LimitDataset(_source(), -1)
