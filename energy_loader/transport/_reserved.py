"""Collating straight into a worker's arena (:func:`batch_tensor`), and sending such tensors by
reference (:class:`ReferenceReducer` in the worker, :class:`Adoption` in the main process).
See docs/transport.md.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from ._arena import Arena, Reservation
from ._payload import DTYPE_NAMES, rebuild_tensor


@attrs.frozen
class _CollateTarget:
    arena: Arena
    min_bytes: int


# This process's arena for batch_tensor: set in a loader worker by its transport, else None.
_TARGET: _CollateTarget | None = None


def collate_into(arena: Arena | None, min_bytes: int) -> None:
    """Let :func:`batch_tensor` reserve tensors of ``min_bytes`` or more in ``arena``.

    Called by the worker's transport when the worker starts; ``None`` turns the hook off."""
    global _TARGET
    _TARGET = None if arena is None else _CollateTarget(arena, min_bytes)


def batch_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor to collate a batch into, e.g. ``torch.stack(xs, out=...)``.

    In a worker with an arena, one of at least ``transport_inline_bytes`` lies in the ring and
    travels without a copy; elsewhere it is ``torch.empty``. Never waits. Fill it completely and
    send it whole: docs/transport.md, "Collating into the arena"."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"`dtype` must be a torch.dtype (got {type(dtype).__name__}: {dtype!r})")
    size = torch.Size(shape)
    if any(n < 0 for n in size):
        raise ValueError(f"`shape` must not have negative sizes (got {tuple(size)})")
    target = _TARGET
    if target is not None and math.prod(size) * dtype.itemsize >= target.min_bytes:
        tensor = target.arena.reserve_tensor(tuple(size), dtype)
        if tensor is not None:
            return tensor
    return torch.empty(size, dtype=dtype)


class ReferenceReducer:
    """Worker side, the pickler's hook: reserved tensors by reference, not by copy. ``adopted``
    collects the reservations of the item being pickled, for the encoder to mark sent."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.adopted: dict[int, Reservation] = {}

    def __call__(self, tensor: torch.Tensor) -> Any:
        """``tensor``'s reduction by reference, or None if it is not a whole reservation."""
        arena = self.arena
        if not arena.has_reservations:
            return None
        reservation = arena.reservation_of(tensor)
        name = DTYPE_NAMES.get(tensor.dtype)
        if reservation is None or name is None:
            return None
        self.adopted[reservation.number] = reservation
        where = (arena.ident, reservation.offset, reservation.number, reservation.nbytes)
        arguments = (*where, name, tuple(tensor.shape))
        if tensor.__dict__:
            return _rebuild_reserved_with_attributes, (*arguments, dict(tensor.__dict__))
        return _rebuild_reserved, arguments


class Adoption:
    """Main side: the regions one packet refers to, while it is decoded (one thread)."""

    def __init__(self, arena: Arena, *, pin: bool) -> None:
        self.arena = arena
        self.pin = pin
        self._payloads: dict[int, np.ndarray] = {}

    def payload(self, offset: int, number: int, nbytes: int) -> np.ndarray:
        """Region ``number`` as bytes: the same array for every reference in the item."""
        payload = self._payloads.get(number)
        if payload is None:
            payload = self.arena.read(offset, number, nbytes, pin=self.pin)
            self._payloads[number] = payload
        return payload

    def hand_back_unread(self, numbers: Sequence[int]) -> None:
        """Hand back the regions the packet carried but its decode never reached."""
        for number in numbers:
            if number not in self._payloads:
                self.arena.hand_back(number, 0)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this the adoption the rebuild functions use in this thread."""
        previous = getattr(_DECODING, "adoption", None)
        _DECODING.adoption = self
        try:
            yield
        finally:
            _DECODING.adoption = previous


_DECODING = threading.local()


def _current_adoption(arena: int) -> Adoption:
    adoption: Adoption | None = getattr(_DECODING, "adoption", None)
    if adoption is None or adoption.arena.ident != arena:
        raise RuntimeError(
            "a tensor collated into a worker's arena can only be rebuilt by decoding the packet "
            "that carried it"
        )
    return adoption


def _rebuild_reserved(
    arena: int, offset: int, number: int, nbytes: int, dtype: str, shape: tuple[int, ...]
) -> torch.Tensor:
    payload = _current_adoption(arena).payload(offset, number, nbytes)
    return rebuild_tensor(payload, dtype, shape)


def _rebuild_reserved_with_attributes(
    arena: int,
    offset: int,
    number: int,
    nbytes: int,
    dtype: str,
    shape: tuple[int, ...],
    attributes: dict[str, Any],
) -> torch.Tensor:
    tensor = _rebuild_reserved(arena, offset, number, nbytes, dtype, shape)
    tensor.__dict__.update(attributes)
    return tensor
