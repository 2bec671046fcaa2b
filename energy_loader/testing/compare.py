"""Structural equality of samples (tensors, arrays, dicts, lists), with a path to the difference."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["first_difference", "samples_equal"]


def first_difference(a: Any, b: Any, path: str = "sample") -> str | None:
    """``None`` when equal, else a sentence naming where ``a`` and ``b`` first differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        return None if torch.equal(a, b) else f"{path}: tensor values differ"
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            return f"{path}: arrays differ"
        return None
    if _is_tensordict(a) or _is_tensordict(b):
        if not (_is_tensordict(a) and _is_tensordict(b)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if tuple(a.batch_size) != tuple(b.batch_size):
            return f"{path}: batch_size {tuple(a.batch_size)} vs {tuple(b.batch_size)}"
        return first_difference(a.to_dict(), b.to_dict(), path)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for name in a:
            found = first_difference(a[name], b[name], f"{path}[{name!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"
        for index, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{index}]")
            if found:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    if type(a) is not type(b) or a != b:
        return f"{path}: {a!r} vs {b!r}"
    return None


def _is_tensordict(value: Any) -> bool:
    """TensorDict (optional dependency) without importing it: duck-typed by its API."""
    return hasattr(value, "batch_size") and hasattr(value, "to_dict") and hasattr(value, "keys")


def samples_equal(a: Any, b: Any) -> bool:
    """Whether two samples are equal, tensors and arrays compared by value."""
    return first_difference(a, b) is None
