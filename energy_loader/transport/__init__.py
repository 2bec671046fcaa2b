"""How items cross from a worker process to the main process: a batch codec and arenas.

This module: the loader's settings and the arenas' lifecycle (:class:`Transport` main side,
:class:`WorkerTransport` worker side); ``_payload``, ``_arena``, ``_codec``, ``_reserved`` the
rest. How a payload travels: docs/transport.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..validation import require_bool
from ._arena import HAVE_MEMFD, MIN_ARENA_BYTES, Arena, close_all_but
from ._codec import Encoder, Packet, decode
from ._reserved import batch_tensor, collate_into

__all__ = [
    "DEFAULT_ARENA_BYTES",
    "DEFAULT_INLINE_BYTES",
    "Arena",
    "Encoder",
    "Packet",
    "Transport",
    "WorkerTransport",
    "batch_tensor",
    "decode",
    "validate_transport_settings",
]

#: Payloads of at least this many bytes go through the worker's shared-memory arena; smaller
#: ones inline through torch's result queue. Measured with ``benchmarks/bench_transport.py``:
#: see docs/transport.md.
DEFAULT_INLINE_BYTES = 32 * 1024

#: Size of each worker's arena. It is address space, not memory: pages are touched only as
#: payloads need them, and allocation keeps reusing the front of the ring.
DEFAULT_ARENA_BYTES = 256 * 1024 * 1024


def validate_transport_settings(codec: Any, inline_bytes: Any, arena_bytes: Any) -> None:
    """Raise ``TypeError``/``ValueError`` for loader transport arguments that cannot work."""
    require_bool(codec, "transport_codec")
    sizes = {"transport_inline_bytes": inline_bytes, "transport_arena_bytes": arena_bytes}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"`{name}` must be an integer number of bytes (got {type(value).__name__}: "
                f"{value!r})"
            )
        if value < 0:
            raise ValueError(f"`{name}` must be >= 0 (got {value})")
    if 0 < arena_bytes < MIN_ARENA_BYTES:
        raise ValueError(
            f"`transport_arena_bytes` must be 0 (no shared memory: every batch inline) or at "
            f"least {MIN_ARENA_BYTES} (got {arena_bytes})"
        )


class WorkerTransport:
    """What the workers receive with the dataset: the threshold and one arena per worker."""

    def __init__(self, inline_bytes: int, arenas: Sequence[Arena]) -> None:
        self.inline_bytes = inline_bytes
        self.arenas = tuple(arenas)

    def encoder(self, worker_id: int) -> Callable[[Any], Packet]:
        """The encode function of physical worker ``worker_id``, in that worker's process: closes
        every other arena this process inherited or received and points :func:`batch_tensor` at
        its own."""
        own = self.arenas[worker_id] if worker_id < len(self.arenas) else None
        close_all_but(own)
        collate_into(own, self.inline_bytes)
        return Encoder(self.inline_bytes, own).encode


class Transport:
    """The main-process end for one loader: creates and releases the workers' arenas."""

    def __init__(self, inline_bytes: int, arena_bytes: int) -> None:
        self.inline_bytes = inline_bytes
        self.arena_bytes = arena_bytes
        self._arenas: list[Arena] = []

    def open(self, num_workers: int) -> WorkerTransport:
        """Fresh arenas for a new set of workers (closing any previous ones)."""
        self.close()
        if self.arena_bytes and HAVE_MEMFD:
            self._arenas = [Arena(self.arena_bytes) for _ in range(num_workers)]
        return WorkerTransport(self.inline_bytes, self._arenas)

    def close(self) -> None:
        """Release the arenas; call once the workers that used them have stopped."""
        arenas, self._arenas = self._arenas, []
        for arena in arenas:
            arena.close()
