"""A seeded bijection of ``range(n)`` in O(1) memory (numpy would need 80 GB for 10**10).

Four keyed Feistel rounds over two halves of ``half_bits`` permute ``range(4**half_bits)``;
values at or above ``n`` go through again (cycle walking), under 4 times on average.
"""

from __future__ import annotations

import numpy as np

from ..rng import mix64, mix64_array

__all__ = ["FeistelPermutation"]

_ROUNDS = 4


class FeistelPermutation:
    """``perm[i]`` for ``i in range(n)``, a bijection determined by ``key``."""

    __slots__ = ("_half", "_keys", "_mask", "n")

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"`n` must be non-negative (got {n})")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._half = (bits + 1) // 2
        self._mask = (1 << self._half) - 1
        self._keys = tuple(mix64(key ^ mix64(r + 1)) for r in range(_ROUNDS))

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range({self.n})")
        half, mask, keys = self._half, self._mask, self._keys
        value = index
        while True:
            left, right = value >> half, value & mask
            for round_key in keys:
                left, right = right, left ^ (mix64(round_key ^ right) & mask)
            value = (left << half) | right
            if value < self.n:
                return value

    def take(self, positions: np.ndarray) -> np.ndarray:
        """``perm[p]`` for every position in a ``uint64`` array, vectorised (~0.1 us each)."""
        half, mask = np.uint64(self._half), np.uint64(self._mask)
        values = positions.astype(np.uint64, copy=True)
        pending = np.arange(len(values))
        while len(pending):
            current = values[pending]
            left, right = current >> half, current & mask
            for round_key in self._keys:
                left, right = right, left ^ (mix64_array(np.uint64(round_key) ^ right) & mask)
            current = (left << half) | right
            values[pending] = current
            pending = pending[current >= np.uint64(self.n)]
        return values

    def __len__(self) -> int:
        return self.n
