"""Per-worker rings of shared memory in anonymous memory files (``os.memfd_create``): nothing
in ``/dev/shm``, freed when the last process closes them. See docs/transport.md, "The arena".
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from multiprocessing import reduction
from typing import Any

import attrs
import numpy as np
import torch

from ._payload import ALIGN, fill, pinned_buffer

HAVE_MEMFD = hasattr(os, "memfd_create")
MIN_ARENA_BYTES = mmap.PAGESIZE
_HEADER_BYTES = mmap.PAGESIZE
#: Handed-back slots in the header; also the most payloads a worker keeps in flight.
_SLOTS = _HEADER_BYTES // 8

# Arenas mapped in this process, by id: the main process looks packets' arenas up here, and a
# forked worker closes the ones it inherited but does not own.
_ARENAS: weakref.WeakValueDictionary[int, Arena] = weakref.WeakValueDictionary()
_ARENA_IDS = itertools.count()


class Arena:
    """One worker's ring of shared memory: the worker writes payloads, the main process reads.

    A header page of :data:`_SLOTS` slots (payload ``n`` comes back in slot ``n % _SLOTS``), then
    ``size`` bytes of ring filled first-fit from the front: docs/transport.md, "The arena"."""

    def __init__(self, size: int, *, fd: int | None = None, ident: int | None = None) -> None:
        self.size = size
        self.ident = next(_ARENA_IDS) if ident is None else ident
        if fd is None:
            fd = os.memfd_create(f"energy_loader-arena-{os.getpid()}-{self.ident}")
        try:  # the arena owns ``fd`` from here on
            if os.fstat(fd).st_size == 0:
                os.ftruncate(fd, _HEADER_BYTES + size)
            self._map = mmap.mmap(fd, _HEADER_BYTES + size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # Worker side: payloads in use, by offset: offset -> (size, number).
        self._in_use: dict[int, tuple[int, int]] = {}
        self._sequence = 0
        # Worker side: reserved tensors the worker still references, by payload number and
        # by address; numbers whose last reference died, queued by their finalizers.
        self._reserved: dict[int, Reservation] = {}
        self._reserved_at: dict[int, Reservation] = {}
        self._released: collections.deque[int] = collections.deque()
        self._reserving = threading.Lock()
        # Main side: bytes held by payloads read in place.
        self._lock = threading.Lock()
        self.held_bytes = 0
        self._finalizer = weakref.finalize(self, _release, self._map, fd)
        _ARENAS[self.ident] = self

    def __reduce__(self) -> Any:
        if self.closed:
            raise RuntimeError("a closed arena cannot be sent to a worker")
        return _attach, (reduction.DupFd(self._fd), self.size, self.ident)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unmap and close; the memory is freed once no other process maps it. Idempotent."""
        if _ARENAS.get(self.ident) is self:
            del _ARENAS[self.ident]
        self._finalizer()

    def _slots(self) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.int64, count=_SLOTS)

    def reserve(self, size: int) -> tuple[int, int] | None:
        """Room for ``size`` bytes: (offset in the ring, payload number), or None if full."""
        with self._reserving:
            return self._reserve(size)

    def _reserve(self, size: int) -> tuple[int, int] | None:
        in_use = self._in_use
        self._collect()
        size = -(-size // ALIGN) * ALIGN  # payloads start 64-byte aligned
        if size > self.size or len(in_use) >= _SLOTS - 1:
            return None
        cursor = 0  # first fit from the front
        for offset in sorted(in_use):
            if offset - cursor >= size:
                break
            cursor = max(cursor, offset + in_use[offset][0])
        else:
            if self.size - cursor < size:
                return None
        number = self._next_number()
        in_use[cursor] = (size, number)
        return cursor, number

    def _collect(self) -> None:
        """Forget the regions that are free again (reserving thread, under the lock)."""
        in_use, reserved, released = self._in_use, self._reserved, self._released
        while released:
            reservation = reserved.pop(released.popleft())
            del self._reserved_at[reservation.address]
            if not reservation.sent:  # the main process never saw it
                del in_use[reservation.offset]
        if in_use:
            slots = self._slots()
            for offset, (_, number) in list(in_use.items()):
                if slots[number % _SLOTS] == number and number not in reserved:
                    del in_use[offset]

    def _next_number(self) -> int:
        """The next payload number whose slot no payload in use shares (two in flight on one slot
        could hide one's hand-back behind the other's)."""
        taken = {number % _SLOTS for _, number in self._in_use.values()}
        number = self._sequence + 1
        while number % _SLOTS in taken:
            number += 1
        self._sequence = number
        return number

    def reserve_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor in a fresh region of the ring, or None if full. The worker owns
        the region until it is sent by reference; it is freed once its last reference here dies
        and, if sent, the main process handed it back."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return None  # nothing to share; a region of its own would be a wasted slot
        with self._reserving:
            slot = self._reserve(nbytes)
            if slot is None:
                return None
            offset, number = slot
            region = np.frombuffer(
                self._map, dtype=np.uint8, count=nbytes, offset=_HEADER_BYTES + offset
            )
            reservation = Reservation(offset, number, nbytes, region.ctypes.data)
            self._reserved[number] = reservation
            self._reserved_at[reservation.address] = reservation
        # Views of the tensor keep ``region`` alive through the tensor's storage.
        weakref.finalize(region, self._released.append, number)
        return torch.from_numpy(region).view(dtype).view(shape)

    @property
    def has_reservations(self) -> bool:
        """Whether this worker references any reserved tensor (a cheap test per tensor)."""
        return bool(self._reserved_at)

    def reservation_of(self, tensor: torch.Tensor) -> Reservation | None:
        """The unsent reservation ``tensor`` covers exactly (contiguous, every byte), if any."""
        reservation = self._reserved_at.get(tensor.data_ptr())
        if (
            reservation is None
            or reservation.sent
            or tensor.nbytes != reservation.nbytes
            or not tensor.is_contiguous()
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            return None
        return reservation

    def write(self, offset: int, parts: Sequence[memoryview], starts: Sequence[int]) -> None:
        """Copy a payload's parts (at their ``starts``) into the ring at ``offset``."""
        with memoryview(self._map) as whole:
            fill(whole[_HEADER_BYTES + offset :], parts, starts)

    def take(self, offset: int, sequence: int, out: np.ndarray) -> None:
        """Copy the payload at ``offset`` into ``out`` and hand its space back to the worker."""
        start = _HEADER_BYTES + offset
        # numpy's stubs declare the buffer protocol only on Python 3.12+
        with memoryview(self._map) as whole, memoryview(out) as target:  # type: ignore[arg-type]
            target[:] = whole[start : start + out.nbytes]
        self.hand_back(sequence, 0)

    def read(self, offset: int, sequence: int, size: int, *, pin: bool) -> np.ndarray:
        """Payload ``sequence`` (``size`` bytes at ``offset``) as a ``uint8`` array to decode: in
        place (:meth:`view`) unless wanted in pinned memory or half the ring is held so; then
        copied out (:meth:`take`) and handed back at once."""
        copy = pinned_buffer(size) if pin else None
        if copy is None and self.held_bytes + size <= self.size // 2:
            return self.view(offset, sequence, size)
        if copy is None:
            copy = np.empty(size, dtype=np.uint8)
        self.take(offset, sequence, copy)
        return copy

    def view(self, offset: int, sequence: int, size: int) -> np.ndarray:
        """The payload at ``offset`` in place, as a ``uint8`` array of ``size`` bytes; its space
        goes back to the worker once it and every view of it (the decoded tensors) are gone."""
        start = _HEADER_BYTES + offset
        payload = np.frombuffer(self._map, dtype=np.uint8, count=size, offset=start)
        with self._lock:
            self.held_bytes += size
        weakref.finalize(payload, self.hand_back, sequence, size)
        return payload

    def hand_back(self, sequence: int, held: int) -> None:
        """Give payload ``sequence``'s space back (``held``: the bytes it held in place)."""
        with self._lock:
            self.held_bytes -= held
            if not self.closed:
                self._slots()[sequence % _SLOTS] = sequence  # one aligned 8-byte store


@attrs.define
class Reservation:
    """A region of a worker's ring reserved for a tensor (worker side)."""

    offset: int
    number: int
    nbytes: int
    address: int  # of its first byte in this process, the tensor's ``data_ptr()``
    sent: bool = False


def _release(mapping: mmap.mmap, fd: int) -> None:
    os.close(fd)
    # While tensors still read the ring in place, it stays mapped until the last one goes.
    with contextlib.suppress(BufferError):
        mapping.close()


def _attach(handle: Any, size: int, ident: int) -> Arena:
    """Map an arena received from the main process (spawn/forkserver)."""
    return Arena(size, fd=handle.detach(), ident=ident)


def find_arena(ident: int) -> Arena | None:
    """The arena with this id mapped in this process, if it is still open."""
    return _ARENAS.get(ident)


def close_all_but(own: Arena | None) -> None:
    """Close every arena this process maps except ``own`` (in a new worker process)."""
    for arena in list(_ARENAS.values()):
        if arena is not own:
            arena.close()
