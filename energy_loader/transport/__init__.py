"""How items cross from a worker process to the main process: a batch codec and arenas.

Torch's DataLoader pickles every item onto one result queue with its multiprocessing
reductions, which move *each tensor* through its own new shared-memory segment: allocate,
copy, pass a file descriptor over a socket, map it in the main process, unmap, free. For a
batch of a few small tensors that costs far more than the bytes. The codec replaces it:

- In the worker, :class:`Encoder` pickles the item with protocol 5. Tensors and numpy arrays
  become *out-of-band buffers* (their bytes are not copied into the pickle stream); everything
  else (dicts, lists, tuples, restore keys, plain values, objects) is ordinary pickle, with the
  reductions torch's queue would use for anything the codec does not handle itself (sparse,
  quantized or grad-requiring tensors keep torch's own path, inside the stream). The stream and
  the buffers are laid out back to back (buffers 64-byte aligned) in *one* payload.
- A payload smaller than ``inline_bytes`` travels inline: one writable ``bytearray`` inside a
  small :class:`Packet`, through torch's result queue.
- A larger one is copied into the worker's :class:`Arena`, a ring of shared memory that lives
  as long as the worker, and only its position travels in the packet.
- A collate function can fill a large tensor straight in the worker's arena: ask
  :func:`batch_tensor` for it (``torch.stack(samples, out=batch_tensor(shape, dtype))``, which
  :func:`~energy_loader.default_collate` does). The encoder then sends the tensor by
  reference (its position in the ring), not by copy: the worker copies none of its bytes and
  never holds a private copy of the batch.
- In the main process :func:`decode` rebuilds the item: tensors with ``torch.frombuffer`` and
  arrays with ``numpy.frombuffer`` as views of the payload (no copy; the memory is writable, so
  no read-only warning). An arena payload is read in place: its tensors are views of the
  ring, and its space goes back to the worker when the last of them is freed. (It is copied
  out instead, and its space handed back at once, into pinned memory when torch's pin-memory
  thread asks, or while half the ring is held by batches the user keeps.) Decoded tensors
  are contiguous; shape, dtype, values and the attributes of plain tensors (a
  ``__restore_key__``) are kept.

Arenas are anonymous memory files (``os.memfd_create``): nothing is ever created in
``/dev/shm``, and the kernel frees an arena once the last process that maps it exits or closes
it, so a killed worker leaves nothing behind. The main process creates one arena per worker
when the workers start and closes them when they stop; a worker inherits its arena under fork,
or receives its file descriptor with the dataset under spawn/forkserver (the same way it
receives its command pipe). Without ``memfd_create`` (not Linux) every payload goes inline.

The ring is single-producer/single-consumer: the worker numbers its payloads and remembers
where the ones in use lie; the main process hands each back, in any order, by writing its
number into a slot of the arena's first page. A worker never waits for space: a payload that
does not fit goes inline. Each payload goes into the first gap from the front that fits, so
the pages the ring touches stay close to what is actually in flight. A region reserved for
a tensor is freed once the worker no longer references it and, if it was sent, the main
process has handed it back.

Modules: ``_payload`` (the payload format and the pickler), ``_arena`` (the rings), ``_codec``
(packets, the encoder, :func:`decode`), ``_reserved`` (:func:`batch_tensor` and tensors sent
by reference); this one: the loader's settings and the arenas'
lifecycle (:class:`Transport` in the main process, :class:`WorkerTransport` in the workers).
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
    for name, value, minimum in (
        ("transport_inline_bytes", inline_bytes, 0),
        ("transport_arena_bytes", arena_bytes, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"`{name}` must be an integer number of bytes (got {type(value).__name__}: "
                f"{value!r})"
            )
        if value < minimum:
            raise ValueError(f"`{name}` must be >= {minimum} (got {value})")
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
        """The encode function of physical worker ``worker_id``, in that worker's process.

        Closes every other arena this process inherited or received (a forked worker maps
        its siblings' arenas, and those of any other loader, until it lets them go), and
        points :func:`batch_tensor` at the worker's own.
        """
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
