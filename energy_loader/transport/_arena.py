"""Per-worker rings of shared memory in anonymous memory files (``os.memfd_create``).

Nothing is ever created in ``/dev/shm``; the kernel frees an arena once the last process that
maps it closes it or exits, so a killed worker leaves nothing behind. The main process creates
one arena per worker; a worker inherits it under fork, or receives its file descriptor with
the dataset under spawn/forkserver (``multiprocessing.reduction.DupFd``, the way the worker's
command pipe travels too).
"""

from __future__ import annotations

import collections
import itertools
import mmap
import os
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

# Arenas mapped in this process, by id: the main process looks packets' arenas up here, and a
# forked worker closes the ones it inherited but does not own.
_ARENAS: weakref.WeakValueDictionary[int, Arena] = weakref.WeakValueDictionary()
_ARENA_IDS = itertools.count()


class Arena:
    """One worker's ring of shared memory: the worker writes payloads, the main process reads.

    Layout: one page of header, then ``size`` bytes of ring. The header holds one int64, the
    sequence number of the last payload the main process has taken (written only by the main
    process, read by the worker). The worker numbers its payloads and remembers where the
    ones not yet taken lie; a payload never wraps around the end of the ring. Not thread-safe
    on either side: one producer, one consumer, payloads taken in the order they were made.
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
        # Worker side: payloads not yet taken, oldest first, as (offset, size, sequence).
        self._pending: collections.deque[tuple[int, int, int]] = collections.deque()
        self._sequence = 0
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

    def _taken(self) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.int64, count=1)

    # worker side

    def reserve(self, size: int) -> tuple[int, int] | None:
        """Room for ``size`` bytes: (offset in the ring, sequence number), or None if full."""
        capacity, pending = self.size, self._pending
        taken = int(self._taken()[0])
        while pending and pending[0][2] <= taken:
            pending.popleft()
        size = -(-size // ALIGN) * ALIGN  # payloads start 64-byte aligned
        if size > capacity:
            return None
        if not pending:
            offset = 0
        else:
            oldest = pending[0][0]
            newest, newest_size, _ = pending[-1]
            cursor = newest + newest_size
            if newest < oldest:  # wrapped: the free space is [cursor, oldest)
                if cursor + size > oldest:
                    return None
                offset = cursor
            elif size + (cursor - oldest) <= oldest:
                # The front has room for this payload and as much again as is in flight, so
                # wrapping early cannot starve the payloads that follow: the ring keeps to a
                # few payloads' worth of pages instead of touching all of its memory.
                offset = 0
            elif cursor + size <= capacity:
                offset = cursor
            elif size <= oldest:
                offset = 0  # the end of the ring: wrap, the payload fits at the front
            else:
                return None
        self._sequence += 1
        pending.append((offset, size, self._sequence))
        return offset, self._sequence

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
        taken = self._taken()
        if sequence > taken[0]:
            taken[0] = sequence  # one aligned 8-byte store, after the copy


def _release(mapping: mmap.mmap, fd: int) -> None:
    mapping.close()
    os.close(fd)


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
