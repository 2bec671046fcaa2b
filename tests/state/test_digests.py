"""Digests of restore keys: the shortcut for a batch of ``(index,)`` keys gives ``repr``'s
digest, and the digests states already hold (a proof is checked against them)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from energy_loader.state.digests import digest, key_digest

_INDEX = st.one_of(st.integers(-(2**70), 2**70), st.booleans())
_KEYS = st.one_of(
    st.lists(st.tuples(_INDEX), max_size=40).map(tuple),
    st.lists(st.one_of(st.tuples(_INDEX), st.tuples(_INDEX, _INDEX)), max_size=6).map(tuple),
    st.lists(st.lists(st.integers(), min_size=1, max_size=1), max_size=4).map(tuple),
    st.tuples(st.integers()),
    st.text(max_size=3),
)


@given(key=_KEYS)
def test_a_key_digest_is_the_digest_of_its_repr(key: object) -> None:
    assert key_digest(key) == digest("key", key)


def test_key_digests_are_those_states_already_hold() -> None:
    # Values from the commit before the shortcut (ce66494).
    batch = tuple((i * 7919 % 60000,) for i in range(32))
    assert key_digest(batch) == "ffcfd5142bf08de5"
    assert key_digest(((3,), (-1,), (2**70,))) == "053a3beb1948f4f0"
