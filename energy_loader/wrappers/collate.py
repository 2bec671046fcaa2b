"""The default collate function: ``torch.utils.data.default_collate``, tolerant of ragged data.

Makes the batches torch's ``DataLoader`` makes, but keeps samples as a list where torch raises
(ragged data). Stacked tensors come from :func:`energy_loader.transport.batch_tensor`, so in
a loader worker a large batch is stacked straight into the shared-memory arena.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch

from ..dataset import RESTORE_KEY
from ..transport import batch_tensor

__all__ = ["collate_keeping_tuples", "default_collate"]

# numpy dtype kinds torch cannot hold: bytes, str, object, void (structured), datetimes.
_NON_NUMERIC_KINDS = frozenset("SUOVMm")


def _torch_dtypes_of_numpy() -> dict[np.dtype[Any], torch.dtype]:
    """The (native byte order) numpy dtypes ``torch.from_numpy`` takes, and what it makes."""
    found = {}
    for kind in np.sctypeDict.values():
        dtype = np.dtype(kind)
        try:
            found[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        except (TypeError, ValueError):
            continue
    return found


_TORCH_DTYPES = _torch_dtypes_of_numpy()


def default_collate(samples: Sequence[Any]) -> Any:
    """Combine a list of samples into one batch, as ``torch.utils.data.default_collate`` does.

    Mappings lose their ``__restore_key__`` entry; where torch raises (ragged tensors, sequences
    of different lengths, other objects) the samples stay a list. The full table is in
    docs/wrappers.md, "BatchDataset". Example::

        default_collate([{"x": torch.ones(2), "y": 1}, {"x": torch.zeros(2), "y": 0}])
        # {"x": tensor([[1., 1.], [0., 0.]]), "y": tensor([1, 0])}
        default_collate([torch.ones(1), torch.ones(2)])  # [tensor([1.]), tensor([1., 1.])]
    """
    return _collate(samples, False)


def collate_keeping_tuples(samples: Sequence[Any]) -> Any:
    """:func:`default_collate`, but tuple samples give a *tuple* of collated columns: the
    default of :class:`BatchDataset` and :class:`GroupBatchDataset`, as
    :class:`UnbatchDataset` splits them.
    """
    return _collate(samples, True)


def _collate(given: Sequence[Any], tuples: bool) -> Any:
    if not given:
        return []
    samples = list(given)
    first = samples[0]
    if isinstance(first, torch.Tensor):
        return _collate_tensors(samples)
    if isinstance(first, np.ndarray):
        return _collate_arrays(samples)
    if isinstance(first, (np.bool_, np.number)):
        return _attempt(torch.as_tensor, samples)
    if isinstance(first, float):
        return _attempt(lambda batch: torch.tensor(batch, dtype=torch.float64), samples)
    if isinstance(first, int):
        return _attempt(torch.tensor, samples)
    if isinstance(first, (str, bytes)):
        return samples if tuples else given  # torch leaves the batch as it was given
    if isinstance(first, Mapping):
        return _collate_mappings(samples, tuples)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        if _same_lengths(samples) and all(type(s) is type(first) for s in samples):
            return type(first)(*(_collate(col, tuples) for col in zip(*samples)))
        return samples
    if isinstance(first, Sequence):
        return _collate_sequences(samples, tuples)
    return samples


def _collate_tensors(samples: list[Any]) -> Any:
    first = samples[0]
    if first.is_nested or first.layout != torch.strided:
        return samples
    if all(
        isinstance(s, torch.Tensor) and s.layout == torch.strided and s.shape == first.shape
        for s in samples
    ):
        return _stack_tensors(samples)
    return samples


def _stack_tensors(samples: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(samples)``, into :func:`batch_tensor` memory where that gives the same: plain
    CPU tensors of one dtype without grad (``out=`` would not promote or record autograd).
    """
    first = samples[0]
    dtype = first.dtype
    plain = all(
        type(s) is torch.Tensor
        and s.dtype == dtype
        and s.device.type == "cpu"
        and not s.requires_grad
        for s in samples
    )
    if not plain:
        return torch.stack(samples)
    return torch.stack(samples, out=batch_tensor((len(samples), *first.shape), dtype))


def _collate_arrays(samples: list[Any]) -> Any:
    first = samples[0]
    if first.dtype.kind in _NON_NUMERIC_KINDS:
        return samples
    if all(
        isinstance(s, np.ndarray) and s.shape == first.shape and s.dtype == first.dtype
        for s in samples
    ):
        return _stack_arrays(samples)
    if all(isinstance(s, np.ndarray) and s.shape == first.shape for s in samples):
        # Mixed dtypes: torch.stack promotes them, as torch's collate does.
        return _attempt(lambda batch: torch.stack([torch.as_tensor(s) for s in batch]), samples)
    return samples


def _stack_arrays(samples: list[np.ndarray]) -> torch.Tensor:
    """Arrays of one shape and dtype stacked into one fresh (writable, contiguous) tensor."""
    first = samples[0]
    dtype = _TORCH_DTYPES.get(first.dtype)
    if dtype is None:  # e.g. non-native byte order: torch's own verdict, as before
        return torch.from_numpy(np.stack(samples))
    batch = batch_tensor((len(samples), *first.shape), dtype)
    np.stack(samples, out=batch.numpy())
    return batch


def _attempt(make_tensor: Callable[[list[Any]], torch.Tensor], samples: list[Any]) -> Any:
    """``make_tensor(samples)``, or the samples as a list when torch cannot make one tensor."""
    try:
        return make_tensor(samples)
    except (TypeError, RuntimeError, ValueError, OverflowError):
        return samples


def _collate_mappings(samples: list[Any], tuples: bool) -> Any:
    first = samples[0]
    names = [name for name in first if name != RESTORE_KEY]
    if not all(isinstance(s, Mapping) and all(n in s for n in names) for s in samples):
        return samples
    columns = {name: _collate([s[name] for s in samples], tuples) for name in names}
    if type(first) is dict:
        return columns
    try:
        if isinstance(first, MutableMapping):
            clone = copy.copy(first)
            clone.pop(RESTORE_KEY, None)
            clone.update(columns)
            return clone
        return type(first)(columns)
    except TypeError:
        return columns


def _same_lengths(samples: list[Any]) -> bool:
    size = len(samples[0])
    return all(isinstance(s, Sequence) and len(s) == size for s in samples)


def _collate_sequences(samples: list[Any], tuples: bool) -> Any:
    if not _same_lengths(samples):
        return samples
    columns = [_collate(col, tuples) for col in zip(*samples)]
    if tuples and isinstance(samples[0], tuple):
        return tuple(columns)
    return columns
