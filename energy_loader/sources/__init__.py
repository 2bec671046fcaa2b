"""Where samples come from: savable, sharded, per-epoch shuffled sources."""

from .indexed import IndexedSource
from .permutation import FeistelPermutation

__all__ = ["FeistelPermutation", "IndexedSource"]
