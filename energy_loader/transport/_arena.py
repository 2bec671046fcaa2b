"""Per-worker rings of shared memory in anonymous memory files (``os.memfd_create``).

Nothing is ever created in ``/dev/shm``; the kernel frees an arena once the last process that
maps it closes it or exits, so a killed worker leaves nothing behind. The main process creates
one arena per worker; a worker inherits it under fork, or receives its file descriptor with
the dataset under spawn/forkserver (``multiprocessing.reduction.DupFd``, the way the worker's
command pipe travels too).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from multiprocessing import reduction
from typing import Any

import numpy as np

from ._payload import ALIGN, fill

__all__ = ["HAVE_MEMFD", "MIN_ARENA_BYTES", "Arena", "close_all_but", "find_arena"]

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

    Layout: one page of header, then ``size`` bytes of ring. The worker numbers its payloads
    (1, 2, ...) and remembers where the ones still in use lie; the header is a table of
    :data:`_SLOTS` int64 slots in which the main process writes a payload's number into slot
    ``number % _SLOTS`` once it has handed the payload's space back (the worker only reads
    it). Payloads may come back in any order; the worker places each new one at the first gap
    from the front of the ring that fits it, so the pages in use stay close to what is in
    flight, and a payload never wraps around the end. One producer (the worker's iterating
    thread), one consumer (the main process), payloads received in the order they were made.

    The main process either copies a payload out and hands its space back at once
    (:meth:`take`), or reads it in place (:meth:`view`): the item's tensors are then views of
    the ring, and the space goes back when the last of them is freed. So that a user who
    keeps many batches does not fill the ring, the main process reads in place only while
    less than half of it is held that way, and copies otherwise; a worker whose ring is full
    sends its payloads inline, and never waits.
    """

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

    # worker side

    def reserve(self, size: int) -> tuple[int, int] | None:
        """Room for ``size`` bytes: (offset in the ring, payload number), or None if full."""
        in_use = self._in_use
        if in_use:
            slots = self._slots()
            for offset, (_, number) in list(in_use.items()):
                if slots[number % _SLOTS] == number:
                    del in_use[offset]
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
        self._sequence += 1
        in_use[cursor] = (size, self._sequence)
        return cursor, self._sequence

    def write(self, offset: int, parts: Sequence[memoryview], starts: Sequence[int]) -> None:
        """Copy a payload's parts (at their ``starts``) into the ring at ``offset``."""
        with memoryview(self._map) as whole:
            fill(whole[_HEADER_BYTES + offset :], parts, starts)

    # main side

    def take(self, offset: int, sequence: int, out: np.ndarray) -> None:
        """Copy the payload at ``offset`` into ``out`` and hand its space back to the worker."""
        start = _HEADER_BYTES + offset
        # numpy's stubs declare the buffer protocol only on Python 3.12+
        with memoryview(self._map) as whole, memoryview(out) as target:  # type: ignore[arg-type]
            target[:] = whole[start : start + out.nbytes]
        self.hand_back(sequence, 0)

    def can_view(self, size: int) -> bool:
        """Whether a payload of ``size`` bytes may be read in place (see the class notes)."""
        return self.held_bytes + size <= self.size // 2

    def view(self, offset: int, sequence: int, size: int) -> np.ndarray:
        """The payload at ``offset`` in place, as a ``uint8`` array of ``size`` bytes.

        Its space is handed back to the worker once the array and every view made of it (the
        decoded tensors and arrays) are gone.
        """
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
