"""The default collate function: stack tensors and arrays, keep lists of everything else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..dataset import RESTORE_KEY

__all__ = ["default_collate"]


def default_collate(samples: Sequence[Any]) -> Any:
    """Combine a list of samples into one batch.

    Dicts are collated per key (a ``__restore_key__`` entry is dropped: the batch gets its
    own); tuples per position; tensors with equal shapes are stacked with ``torch.stack`` and
    numpy arrays with ``numpy.stack``; anything else (numbers, strings, ragged tensors,
    lists) becomes a list.
    """
    if not samples:
        return []
    first = samples[0]
    if isinstance(first, Mapping):
        return {
            name: default_collate([s[name] for s in samples])
            for name in first
            if name != RESTORE_KEY
        }
    if isinstance(first, torch.Tensor):
        if all(isinstance(s, torch.Tensor) and s.shape == first.shape for s in samples):
            return torch.stack(list(samples))
        return list(samples)
    if isinstance(first, np.ndarray):
        if all(isinstance(s, np.ndarray) and s.shape == first.shape for s in samples):
            return np.stack(samples)
        return list(samples)
    if type(first) is tuple and all(type(s) is tuple and len(s) == len(first) for s in samples):
        return tuple(default_collate(list(column)) for column in zip(*samples))
    return list(samples)
