"""The payload format: one pickle protocol-5 stream plus its out-of-band buffers, each 64-byte
aligned (``sizes``: the stream's length, then each buffer's); :func:`unpack` rebuilds an item as
views of the payload. See docs/transport.md, "What the codec does".
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

ALIGN = 64


def offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each part of a payload starts (stream first, buffers aligned) and the total."""
    starts: list[int] = []
    end = 0
    for size in sizes:
        start = -(-end // ALIGN) * ALIGN if starts else 0
        starts.append(start)
        end = start + size
    return starts, end


def fill(target: memoryview, parts: Sequence[memoryview], starts: Sequence[int]) -> None:
    """Copy each part into ``target`` at its start."""
    for part, start in zip(parts, starts):
        target[start : start + part.nbytes] = part


def unpack(payload: Any, sizes: Sequence[int]) -> Any:
    """Rebuild the item from a payload: views of ``payload``, no copies of buffers."""
    starts, _ = offsets(sizes)
    with memoryview(payload) as view:
        buffers = [view[start : start + size] for start, size in zip(starts[1:], sizes[1:])]
        return pickle.loads(view[: sizes[0]], buffers=buffers)


# Dtypes travel by name (a memoized string, cheaper to pickle than a torch.dtype).
DTYPE_NAMES = {
    value: name
    for name, value in vars(torch).items()
    if isinstance(value, torch.dtype) and not name.startswith("_")
}

# Dtypes whose tensors ``Tensor.numpy()`` accepts; the others travel as raw bytes.
_NUMPY_DTYPES = frozenset([
    torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
    torch.uint32, torch.uint64, torch.float16, torch.float32, torch.float64, torch.complex64,
    torch.complex128,
])  # fmt: skip


_NO_BYTES = np.empty(0, dtype=np.uint8)


def pinned_buffer(size: int) -> np.ndarray | None:
    """``size`` bytes of pinned memory as a numpy array, or None without an accelerator."""
    if not torch.accelerator.is_available():
        return None
    return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()


def rebuild_tensor(buffer: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    if buffer.nbytes == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    flat = torch.frombuffer(buffer, dtype=getattr(torch, dtype))
    return flat.view(*shape) if shape else flat.view(())  # view(*ints): the fast argument path


def _rebuild_tensor_with_attributes(
    buffer: memoryview, dtype: str, shape: tuple[int, ...], attributes: dict[str, Any]
) -> Any:
    tensor = rebuild_tensor(buffer, dtype, shape)
    tensor.__dict__.update(attributes)
    return tensor


#: A pickler hook for tensors sent by reference: a reduction, or None to send the bytes.
ByReference = Callable[[torch.Tensor], Any]


def _reduce_tensor(tensor: torch.Tensor, by_reference: ByReference | None) -> Any:
    """Plain dense CPU tensors as an out-of-band buffer; others keep torch's reduction.

    ``by_reference`` may claim a plain tensor first (one collated into the worker's arena)."""
    if (
        tensor.device.type != "cpu"
        or tensor.layout is not torch.strided
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.is_nested
    ):
        return NotImplemented
    if by_reference is not None:
        reference = by_reference(tensor)
        if reference is not None:
            return reference
    data = tensor.resolve_conj().resolve_neg().contiguous()
    dtype = tensor.dtype
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        return NotImplemented
    if data.numel() == 0:
        array = _NO_BYTES
    elif dtype in _NUMPY_DTYPES:
        array = data.numpy()
    else:  # dtypes numpy lacks (bfloat16, float8, ...): their raw bytes
        array = data.reshape(-1).view(torch.uint8).numpy()
    # numpy's stubs declare the buffer protocol only on Python 3.12+
    arguments = (pickle.PickleBuffer(array), name, tuple(data.shape))  # type: ignore[arg-type]
    attributes = tensor.__dict__
    if attributes:
        return _rebuild_tensor_with_attributes, (*arguments, dict(attributes))
    return rebuild_tensor, arguments


def _reduce_array(array: np.ndarray) -> Any:
    """Non-contiguous arrays as contiguous copies, so that they too go out of band."""
    flags = array.flags
    if flags.c_contiguous or flags.f_contiguous or array.dtype.hasobject:
        return NotImplemented  # numpy's own protocol-5 reduction (out of band when contiguous)
    return np.ascontiguousarray(array).__reduce_ex__(5)


class Pickler(pickle.Pickler):
    """Protocol 5 with out-of-band tensors/arrays and torch's queue reductions for the rest."""

    def __init__(
        self,
        file: io.BytesIO,
        buffers: list[pickle.PickleBuffer],
        by_reference: ByReference | None = None,
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._file = file
        self._by_reference = by_reference
        self._registered = (-1, -1)

    def dump(self, obj: Any) -> None:
        # The queue's reductions as of now: a library that user code imports late (and that
        # registers its own, as tensordict does) is honoured, as on torch's queue. Building
        # the table costs ~5 us, so it is rebuilt only when a registration was added.
        extra = reduction.ForkingPickler._extra_reducers  # type: ignore[attr-defined]
        registered = (len(copyreg.dispatch_table), len(extra))
        if registered != self._registered:
            self.dispatch_table = reduction.ForkingPickler(self._file).dispatch_table
            self._registered = registered
        super().dump(obj)

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor:
            return _reduce_tensor(obj, self._by_reference)
        if kind is np.ndarray:
            return _reduce_array(obj)
        return NotImplemented
