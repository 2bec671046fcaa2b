"""BlendDataset: weighted mixing, exhaustion policies, validation, exact resume."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

import energy_loader as el
from energy_loader.testing import check_resume, samples_equal
from energy_loader.testing.strategies import AddNoise, MakeSample
from energy_loader.wrappers import BlendDataset
from tests.helpers import WORKERS_0_AND_2


def _source(length: int, seed: int = 0, shuffle: bool = True) -> el.IndexedSource:
    return el.IndexedSource.from_fn(length, MakeSample(), shuffle=shuffle, seed=seed)


def _endless(length: int, seed: int) -> el.RepeatDataset:
    return el.RepeatDataset(el.IndexedSource.from_fn(length, int, seed=seed))


def _mix(blend: BlendDataset, draws: int) -> Counter[int]:
    blend.bind(el.WorkerContext(seed=1234))
    return Counter(key[0] for key, _ in itertools.islice(blend.iter_keyed(), draws))


def test_mix_of_100k_draws_is_within_one_percent_of_the_weights() -> None:
    weights = (0.5, 0.3, 0.15, 0.05)
    blend = BlendDataset(*((_endless(7 + i, i), w) for i, w in enumerate(weights)))
    counts = _mix(blend, 100_000)
    for index, weight in enumerate(weights):
        share = counts[index] / 100_000
        assert abs(share - weight) < 0.01, (index, share, weight)
        assert abs(share - weight) / weight < 0.05, (index, share, weight)


def test_weights_need_not_sum_to_one_and_zero_weights_are_never_drawn() -> None:
    blend = BlendDataset((_endless(5, 0), 3), (_endless(5, 1), 0), (_endless(5, 2), 1))
    counts = _mix(blend, 4000)
    assert counts[1] == 0
    assert 0.72 < counts[0] / 4000 < 0.78


def test_the_mix_depends_on_the_seed_and_differs_between_epochs() -> None:
    def order(seed: int, epochs: int = 1) -> list[list[int]]:
        blend = BlendDataset((_source(20, 1), 1.0), (_source(20, 2), 1.0), on_exhausted="drop")
        blend.bind(el.WorkerContext(seed=seed))
        return [[key[0] for key, _ in blend.iter_keyed()] for _ in range(epochs)]

    assert order(5) == order(5)
    assert order(5) != order(6)
    first, second = order(5, epochs=2)
    assert first != second


def test_on_exhausted_drop_reads_every_inner_dataset_to_its_end() -> None:
    blend = BlendDataset((_source(10, 1), 5.0), (_source(4, 2), 1.0), on_exhausted="drop")
    assert len(blend) == 14
    for _ in range(2):
        keys = [s[el.RESTORE_KEY] for s in blend]
        assert sorted(keys) == sorted(
            [(0, (i,)) for i in range(10)] + [(1, (i,)) for i in range(4)]
        )


def test_on_exhausted_end_ends_the_epoch_and_restarts_every_inner_epoch() -> None:
    blend = BlendDataset((_source(3, 1, shuffle=False), 1.0), (_source(50, 2, shuffle=False), 1.0))
    blend.bind(el.WorkerContext(seed=3))
    for _ in range(3):
        keys = [key for key, _ in blend.iter_keyed()]
        small = [k for k in keys if k[0] == 0]
        assert len(small) == 3, "the epoch ends when the small inner dataset is drawn once more"
        big = [k[1][0] for k in keys if k[0] == 1]
        assert big == list(range(len(big))), "the big inner dataset starts its epoch afresh"
    with pytest.raises(TypeError, match="no len"):
        len(blend)


def test_state_is_small_and_names_the_counter_and_the_inner_states() -> None:
    blend = BlendDataset((_source(1000, 1), 1.0), (_source(1000, 2), 1.0))
    iterator = iter(blend)
    for _ in range(500):
        next(iterator)
    state = blend.save_state()
    assert set(state) == {"phase", "epoch", "counter", "done", "inners"}
    assert state["counter"] == 500 and state["done"] == [False, False]
    assert len(state["inners"]) == 2
    assert len(json.dumps(state)) < 300


@pytest.mark.parametrize("on_exhausted", ["end", "drop"])
@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_is_exact(workers: int, on_exhausted: str) -> None:
    def build() -> BlendDataset:
        return BlendDataset(
            (el.MapDataset(_source(17, 1), AddNoise()), 2.0),
            (_source(9, 2), 1.0),
            (el.ShuffleBufferDataset(_source(12, 3), 4), 0.5),
            on_exhausted=on_exhausted,
        )

    check_resume(build, num_workers=workers, epochs=3)


def test_restore_sample_rebuilds_from_the_right_inner_dataset() -> None:
    blend = BlendDataset((el.MapDataset(_source(8, 1), AddNoise()), 1.0), (_source(8, 2), 1.0))
    for sample in blend:
        rebuilt = blend.restore_sample(sample[el.RESTORE_KEY])
        expected = {k: v for k, v in sample.items() if k != el.RESTORE_KEY}
        assert samples_equal(rebuilt, expected)
    with pytest.raises(ValueError, match=r"\(i, inner_key\)"):
        blend.restore_sample((5, (1,)))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((), {}, ValueError, "at least one inner dataset"),
        (("not a pair",), {}, TypeError, r"\(dataset, weight\) pairs"),
        (((_source(3), "heavy"),), {}, TypeError, "weight of inner dataset 0 must be a number"),
        (((_source(3), -1.0),), {}, ValueError, ">= 0"),
        (((_source(3), float("nan")),), {}, ValueError, "finite"),
        (((_source(3), 0), (_source(3), 0.0)), {}, ValueError, "at least one weight must be > 0"),
        (((["x"], 1.0),), {}, TypeError, "must be a SavableDataset"),
        (((_source(3), 1.0),), {"on_exhausted": "stop"}, ValueError, "'end'.*'drop'"),
    ],
)
def test_constructor_rejects_bad_arguments(args, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        BlendDataset(*args, **kwargs)


def test_one_dataset_object_cannot_be_blended_twice() -> None:
    source = _source(5)
    with pytest.raises(ValueError, match="share the same IndexedSource"):
        BlendDataset((source, 1.0), (el.MapDataset(source, AddNoise()), 1.0))
