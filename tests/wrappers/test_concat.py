"""ConcatDataset: order, epochs, early end, state, validation, exact resume."""

from __future__ import annotations

import pytest

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import AddNoise, MakeSample
from energy_loader.wrappers import ConcatDataset
from tests.helpers import WORKERS_0_AND_2


def _source(length: int, seed: int = 0, shuffle: bool = True) -> el.IndexedSource:
    return el.IndexedSource.from_fn(length, MakeSample(), shuffle=shuffle, seed=seed)


def _keys(dataset: el.SavableDataset) -> list[tuple]:
    return [sample[el.RESTORE_KEY] for sample in dataset]


def test_inner_datasets_come_one_after_another_each_epoch_reshuffled() -> None:
    concat = ConcatDataset(_source(4, 1), _source(3, 2), _source(2, 3))
    assert len(concat) == 9
    first, second = _keys(concat), _keys(concat)
    for keys in (first, second):
        assert [k[0] for k in keys] == [0] * 4 + [1] * 3 + [2] * 2
        assert sorted(k[1][0] for k in keys[:4]) == [0, 1, 2, 3]
    assert first != second, "every inner dataset reshuffles in the next epoch"


def test_state_names_the_current_inner_dataset() -> None:
    concat = ConcatDataset(_source(4, 1), _source(3, 2))
    iterator = iter(concat)
    for _ in range(5):
        next(iterator)
    state = concat.save_state()
    assert state["current"] == 1
    assert [s["phase"] for s in state["inners"]] == ["ended", "running"]
    assert set(state) == {"phase", "epoch", "current", "inners"}


def test_an_outer_limit_ends_the_current_inner_epoch_and_restarts_at_the_first() -> None:
    concat = ConcatDataset(_source(4, 1, shuffle=False), _source(3, 2, shuffle=False))
    limited = el.LimitDataset(concat, 6)
    assert _keys(limited) == [(0, (i,)) for i in range(4)] + [(1, (0,)), (1, (1,))]
    assert _keys(limited) == [(0, (i,)) for i in range(4)] + [(1, (0,)), (1, (1,))]


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_is_exact(workers: int) -> None:
    def build() -> ConcatDataset:
        return ConcatDataset(
            el.MapDataset(_source(9, 1), AddNoise()),
            el.ShuffleBufferDataset(_source(7, 2), 3),
            el.BatchDataset(_source(1, 3), 2),
        )

    check_resume(build, num_workers=workers, epochs=3)


def test_resume_under_an_outer_limit_and_repeat() -> None:
    check_resume(
        lambda: el.RepeatDataset(
            el.LimitDataset(ConcatDataset(_source(5, 1), _source(5, 2)), 7), 2
        ),
        num_workers=0,
        epochs=3,
    )


def test_restore_sample_and_bad_keys() -> None:
    concat = ConcatDataset(_source(3, 1), el.MapDataset(_source(3, 2), AddNoise()))
    samples = list(concat)
    rebuilt = concat.restore_sample(samples[4][el.RESTORE_KEY])
    assert rebuilt["noise"] == samples[4]["noise"]
    for bad in [(2, (0,)), ("0", (0,)), (0,)]:
        with pytest.raises(ValueError, match="restore keys are"):
            concat.restore_sample(bad)


def test_bad_states_are_reported_with_their_path() -> None:
    concat = ConcatDataset(_source(3, 1), _source(3, 2))
    next(iter(concat))
    state = concat.save_state()
    with pytest.raises(el.StateFormatError, match=r"state.inners: holds 1 states"):
        ConcatDataset(_source(3, 1), _source(3, 2)).restore_state(
            {**state, "inners": state["inners"][:1]}
        )
    with pytest.raises(el.StateFormatError, match=r"state.current"):
        ConcatDataset(_source(3, 1), _source(3, 2)).restore_state({**state, "current": 9})


def test_constructor_rejects_bad_arguments() -> None:
    source = _source(3)
    with pytest.raises(ValueError, match="at least one inner dataset"):
        ConcatDataset()
    with pytest.raises(TypeError, match="separate arguments"):
        ConcatDataset([source, _source(2)])
    with pytest.raises(TypeError, match="inner dataset 1 must be a SavableDataset"):
        ConcatDataset(source, range(3))
    with pytest.raises(ValueError, match="inner datasets 0 and 1 share"):
        ConcatDataset(source, source)
