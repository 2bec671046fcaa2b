"""Per-sample seeds: the shortcut for one-integer keys gives the general fold's values, and the
values are those earlier releases drew (a restore across an upgrade draws the same)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.rng import fold_key, sample_seed, sample_seed_base, seed_globals_for_sample

_KEYS = st.one_of(
    st.tuples(st.integers(-(2**65), 2**65)),
    st.tuples(st.booleans()),
    st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 9)),
    st.tuples(st.text(max_size=4)),
    st.integers(0, 2**64 - 1),
)


@given(seed=st.integers(0, 2**32), position=st.integers(0, 2**64 - 1), key=_KEYS)
def test_a_sample_seed_is_the_fold_of_its_key(seed: int, position: int, key: object) -> None:
    assert sample_seed(seed, position, key) == fold_key(sample_seed_base(seed, position), key)


def test_the_seeded_draws_are_those_of_earlier_releases() -> None:
    # Values from the release before the shortcut (commit 891d253), seed 7, salt 12345, (41,).
    assert sample_seed(7, 12345, (41,)) == 6142629147771140719
    seed_globals_for_sample(7, 12345, (41,))
    draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    assert draws == (0.5905798470945213, 0.05238807501157661, 0.41134727001190186)


def _draws_everywhere(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "noise": (torch.rand(()).item(), random.random(), float(np.random.rand()))}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("loader_type", [el.SavableDataLoader, el.BasicDataLoader])
def test_a_pipeline_leaves_the_training_generators_where_they_were(loader_type, workers):
    """The training's python, numpy and torch generators (dropout draws from torch's) are the
    training's: an epoch of a pipeline whose stages draw from all three, in this process or
    in workers, leaves them as they were."""
    source = el.IndexedSource.from_fn(12, lambda i: {"i": i}, shuffle=True, seed=1)
    pipeline = el.MapDataset(source, _draws_everywhere)
    loader = loader_type(pipeline, batch_size=4, num_workers=workers)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    before = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        assert sorted(i for batch in loader for i in batch["i"].tolist()) == list(range(12))
    finally:
        loader.close()
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1][1])
    assert torch.equal(torch.get_rng_state(), before[2])


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_the_generators_are_put_back_where_the_library_seeded_them_and_only_there() -> None:
    from energy_loader.rng import kept_rng_state_if_seeded

    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    expected = _draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    with kept_rng_state_if_seeded():
        with kept_rng_state_if_seeded():  # nested scopes: the inner one puts back its own
            seed_globals_for_sample(0, 1, (7,))
            _draws()
        seed_globals_for_sample(0, 1, (8,))
        _draws()
    assert _draws() == expected
    # Where nothing seeded them, an unseeded draw stays drawn (as under torch's DataLoader
    # without workers): the scope saved nothing to put back.
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    with kept_rng_state_if_seeded():
        first = _draws()
    assert first == expected
    assert _draws() != expected
