"""Counter-based randomness for the library's own components, and per-sample seeding.

:class:`CounterRng` (a salted seed and a counter through SplitMix64: a state of two integers)
drives shuffles, buffer picks and blends; :func:`seed_globals_for_sample` reseeds the global
generators from (pipeline seed, wrapper position, restore key) before user functions.
"""

from __future__ import annotations

import _random
import contextlib
import functools
import random
import threading
import zlib
from collections.abc import Hashable, Iterator

import numpy as np
import torch

__all__ = [
    "kept_rng_state",
    "kept_rng_state_if_seeded",
    "CounterRng",
    "fold_key",
    "mix64",
    "mix64_array",
    "sample_seed",
    "sample_seed_base",
    "seed_globals_for_sample",
    "stable_hash",
]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(value: int) -> int:
    """SplitMix64 finaliser: a bijection on 64-bit integers with good avalanche."""
    z = (value + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix64_array(values: np.ndarray) -> np.ndarray:
    """:func:`mix64` of every element of a ``uint64`` array (wrapping arithmetic)."""
    z = values + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stable_hash(*parts: Hashable) -> int:
    """A 64-bit hash of plain values, the same in every process and run (``hash()`` of a ``str`` is
    salted per process): CRC32 of the ``repr`` plus one mixing round (~1.5 us).
    """
    text = repr(parts).encode()
    return mix64(zlib.crc32(text) | (len(text) << 32))


def fold_key(base: int, key: Hashable) -> int:
    """Mix a restore key into ``base``: integers directly (fast), anything else by repr."""
    if type(key) is tuple:
        value = mix64(base ^ len(key))
        for part in key:
            value = fold_key(value, part)
        return value
    if type(key) is int and 0 <= key <= _MASK64:
        return mix64(base ^ key)
    return mix64(base ^ stable_hash(key))


_BLOCK = 256


class CounterRng:
    """A random stream whose whole state is ``(seed, counter)``: draw ``k`` is
    ``mix64(seed ^ mix64(k))``, so the counter resumes it exactly. Draws are computed with numpy
    in blocks of 256 (~0.2 us a draw instead of ~1 us); the values do not depend on the blocks.
    """

    __slots__ = ("_block", "_block_start", "counter", "seed")

    def __init__(self, seed: int, counter: int = 0) -> None:
        self.seed = seed & _MASK64
        self.counter = counter
        self._block: list[int] = []
        self._block_start = 0

    def next_u64(self) -> int:
        """The next 64-bit draw."""
        offset = self.counter - self._block_start
        if not 0 <= offset < len(self._block):
            self._block_start, offset = self.counter, 0
            counters = np.arange(self.counter, self.counter + _BLOCK, dtype=np.uint64)
            draws = mix64_array(np.uint64(self.seed) ^ mix64_array(counters))
            self._block = draws.tolist()
        self.counter += 1
        return self._block[offset]

    def below(self, bound: int) -> int:
        """A draw in ``range(bound)``; bias is below 2**-40 for bounds under 2**24."""
        return self.next_u64() % bound

    def uniform(self) -> float:
        """A float in ``[0, 1)`` with 53 random bits."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


_PY_RANDOM = random._inst  # type: ignore[attr-defined]
_PY_SEED = _random.Random.seed
_TORCH_GENERATOR = torch.default_generator


@functools.lru_cache(maxsize=1024)
def sample_seed_base(seed: int, position: int) -> int:
    """The part of a per-sample seed that is fixed for one wrapper (cached)."""
    return stable_hash("sample", seed, position)


@functools.lru_cache(maxsize=1024)
def _one_int_key_base(seed: int, position: int) -> int:
    """``fold_key``'s value for a one-element key before the element is mixed in (cached)."""
    return mix64(sample_seed_base(seed, position) ^ 1)


def sample_seed(seed: int, position: int, key: Hashable) -> int:
    """The 64-bit seed of one sample: ``fold_key(sample_seed_base(seed, position), key)``; a
    one-integer key takes a shortcut to the same value (~0.7 us instead of ~1.6 us).
    """
    if type(key) is tuple and len(key) == 1:
        index = key[0]
        if type(index) is int and 0 <= index <= _MASK64:
            return mix64(_one_int_key_base(seed, position) ^ index)
    return fold_key(sample_seed_base(seed, position), key)


def seed_globals_for_sample(seed: int, position: int, key: Hashable) -> None:
    """Seed python ``random``, numpy's global RNG and torch's default CPU generator.

    From (pipeline ``seed``, wrapper ``position``, restore ``key``) only; ~10 us (not
    ``torch.manual_seed``, which would also seed every CUDA device: ~180 us).
    """
    keeping = _KEEPING.scope
    if keeping is not None and not keeping:
        keeping.append(_global_states())  # the first seeding in a lazy scope: what to put back
    value = sample_seed(seed, position, key)
    _PY_SEED(_PY_RANDOM, value)
    # Random.seed also resets gauss_next; typeshed does not declare it
    _PY_RANDOM.gauss_next = None  # type: ignore[attr-defined]
    np.random.seed(value & 0xFFFFFFFF)
    _TORCH_GENERATOR.manual_seed(value)


def _global_states() -> tuple[object, object, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _put_back(states: tuple[object, object, torch.Tensor]) -> None:
    random.setstate(states[0])  # type: ignore[arg-type]
    np.random.set_state(states[1])  # type: ignore[arg-type]
    torch.set_rng_state(states[2])


@contextlib.contextmanager
def kept_rng_state() -> Iterator[None]:
    """Put the global ``random``, ``numpy`` and ``torch`` RNG states back on exit, for work done on
    the training process's behalf (a drop-in's dataset peeked ahead). ~80 us (numpy's get/set
    state); :func:`kept_rng_state_if_seeded` costs nothing until a sample is seeded.
    """
    saved = _global_states()
    try:
        yield
    finally:
        _put_back(saved)


class _Keeping(threading.local):
    """The innermost open :func:`kept_rng_state_if_seeded` scope of this thread: an empty list
    until :func:`seed_globals_for_sample` first runs in it, then the states to put back."""

    scope: list[tuple[object, object, torch.Tensor]] | None = None


_KEEPING = _Keeping()


class kept_rng_state_if_seeded:  # lower case: a context manager used as `with f():`
    """Put the global RNG states back on exit if the library seeded them per sample inside.

    States are saved at the first seeding: an item that seeds nothing costs nothing (a class, not
    a ``contextlib`` generator, which cost more than the rest at one scope per item).
    """

    __slots__ = ("outer", "scope")

    def __enter__(self) -> None:
        self.outer = _KEEPING.scope
        self.scope: list[tuple[object, object, torch.Tensor]] = []
        _KEEPING.scope = self.scope

    def __exit__(self, *exc_info: object) -> None:
        _KEEPING.scope = self.outer
        if self.scope:
            _put_back(self.scope[0])
