"""Per-sample seeds: the shortcut for one-integer keys gives the general fold's values, and the
values are those earlier releases drew (a restore across an upgrade draws the same)."""

from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

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
