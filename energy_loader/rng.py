"""Counter-based randomness for the library's own components, and per-sample seeding.

The library never stores a Mersenne-Twister dump in a state. Its own random choices (shuffle
orders, buffer picks, blend draws) come from :class:`CounterRng`: a 64-bit seed and a counter
fed through the SplitMix64 finaliser. The state is two integers, restoring is exact, and the
stream of one component is independent of every other component's because each one mixes its
own salt (its class name and ordinal in the pipeline) into the seed.

User functions draw from the *global* generators (``random``, ``numpy.random``, torch's default
CPU generator). :func:`seed_globals_for_sample` reseeds all three from (pipeline seed, wrapper
position, sample restore key) before a user function runs, so the function's draws are a pure
function of the sample's key: identical after a restore, identical when a shuffle buffer
rebuilds the sample from its key, and independent of how samples are spread over workers.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Hashable

import numpy as np
import torch

__all__ = ["CounterRng", "mix64", "seed_globals_for_sample", "stable_hash"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(value: int) -> int:
    """SplitMix64 finaliser: a bijection on 64-bit integers with good avalanche."""
    z = (value + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stable_hash(*parts: Hashable) -> int:
    """A 64-bit hash of plain values that is the same in every process and every run.

    Python's ``hash()`` of a ``str`` is salted per process, so it cannot seed anything that
    must agree between a worker and its restarted successor. ``repr`` of ints, strings and
    tuples of them is stable, and CRC32 of it plus one round of mixing is cheap (~1.5 us).
    """
    text = repr(parts).encode()
    return mix64(zlib.crc32(text) | (len(text) << 32))


class CounterRng:
    """A random stream whose whole state is ``(seed, counter)``.

    Draw ``k`` is ``mix64(seed ^ mix64(k))``: no draw depends on an earlier one, so saving
    the counter is enough to resume the stream exactly.
    """

    __slots__ = ("counter", "seed")

    def __init__(self, seed: int, counter: int = 0) -> None:
        self.seed = seed & _MASK64
        self.counter = counter

    def next_u64(self) -> int:
        """The next 64-bit draw."""
        value = mix64(self.seed ^ mix64(self.counter))
        self.counter += 1
        return value

    def below(self, bound: int) -> int:
        """A draw in ``range(bound)``; bias is below 2**-40 for bounds under 2**24."""
        return self.next_u64() % bound

    def uniform(self) -> float:
        """A float in ``[0, 1)`` with 53 random bits."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


def seed_globals_for_sample(seed: int, position: int, key: Hashable) -> None:
    """Seed python ``random``, numpy's global RNG and torch's default CPU generator.

    Costs ~15 us per call on the reference machine (``random.seed`` ~8 us, numpy ~4 us, the
    torch generator ~2 us, the hash ~1.5 us). Uses ``torch.default_generator.manual_seed``
    rather than ``torch.manual_seed``, which would also seed every CUDA device (~180 us).
    """
    value = stable_hash(seed, position, key)
    random.seed(value)
    np.random.seed(value & 0xFFFFFFFF)
    torch.default_generator.manual_seed(value)
