"""The two ends of the codec: :class:`Encoder` in the worker, :func:`decode` in the main process,
and the :class:`Packet` between them (pinned by torch's pin-memory thread). See
docs/transport.md.
"""

from __future__ import annotations

import abc
import io
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._arena import Arena, find_arena
from ._payload import Pickler, fill, offsets, pinned_buffer, unpack
from ._reserved import Adoption, ReferenceReducer


class Packet(abc.ABC):
    """An encoded item on its way to the main process; :func:`decode` turns it back. Torch's
    pin-memory thread calls :meth:`pin_memory`, which decodes straight into pinned memory."""

    __slots__ = ()

    def decode(self) -> Any:
        """The item, rebuilt in this process."""
        return self._decode(pin=False)

    def pin_memory(self, device: Any = None) -> Packet:
        """The item decoded into pinned memory (plain memory when no accelerator exists)."""
        return _Decoded(self._decode(pin=True))

    @abc.abstractmethod
    def _decode(self, *, pin: bool) -> Any:
        """Rebuild the item (into pinned memory when ``pin``)."""

    @property
    def nbytes(self) -> int:
        """The item's encoded size: its payload and the arena regions it refers to."""
        return 0


class _Inline(Packet):
    """A payload carried in the packet itself."""

    __slots__ = ("data", "sizes")

    def __init__(self, data: bytearray, sizes: tuple[int, ...]) -> None:
        self.data = data
        self.sizes = sizes

    def __reduce__(self) -> Any:
        return _Inline, (self.data, self.sizes)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def _decode(self, *, pin: bool) -> Any:
        data: Any = self.data
        if pin:
            pinned = pinned_buffer(len(data))
            if pinned is not None:
                # numpy's stubs declare the buffer protocol only on Python 3.12+
                with memoryview(pinned) as target:  # type: ignore[arg-type]
                    target[:] = data
                data = pinned
        return unpack(data, self.sizes)


class _ArenaPacket(Packet):
    """A packet that, in the main process, owns regions of its worker's arena until decoded (only
    the received copy, ``owned``); dropped undecoded it hands them all back."""

    __slots__ = ("arena", "owned")

    def __init__(self, arena: int, owned: bool) -> None:
        self.arena = arena
        self.owned = owned  # True only for the copy the main process received

    @abc.abstractmethod
    def _regions(self) -> Sequence[int]:
        """The numbers of the arena regions this packet owns."""

    def __del__(self, _exiting: Callable[[], bool] = sys.is_finalizing) -> None:
        # A packet still held when the interpreter exits is collected after the module's
        # globals are gone; its arena goes away with the process, so there is nothing to do.
        if self.owned and not _exiting():
            arena = find_arena(self.arena)
            if arena is not None:
                for number in self._regions():
                    arena.hand_back(number, 0)

    def _claim(self) -> Arena:
        """The arena, now that the decode takes the regions over (once)."""
        arena = find_arena(self.arena)
        if arena is None or not self.owned:
            raise RuntimeError(
                f"a batch arrived for shared-memory arena {self.arena}, which is closed: its "
                "worker was stopped before the batch was read"
                if arena is None
                else "this batch was already decoded"
            )
        self.owned = False
        return arena


class _InArena(_ArenaPacket):
    """A payload waiting in a worker's arena at ``[offset, offset + total)``."""

    __slots__ = ("offset", "sequence", "sizes")

    def __init__(
        self, arena: int, offset: int, sequence: int, sizes: tuple[int, ...], owned: bool = False
    ) -> None:
        super().__init__(arena, owned)
        self.offset = offset
        self.sequence = sequence
        self.sizes = sizes

    def __reduce__(self) -> Any:
        return _InArena, (self.arena, self.offset, self.sequence, self.sizes, True)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def _regions(self) -> Sequence[int]:
        return (self.sequence,)

    def _decode(self, *, pin: bool) -> Any:
        arena = self._claim()
        _, total = offsets(self.sizes)
        return unpack(arena.read(self.offset, self.sequence, total, pin=pin), self.sizes)


class _Referencing(_ArenaPacket):
    """An item whose payload (``inner``) refers to regions of its worker's arena by position; the
    decode adopts each (a view or a copy), and a packet dropped undecoded hands them back."""

    __slots__ = ("inner", "numbers", "referenced_bytes")

    def __init__(
        self,
        inner: Packet,
        arena: int,
        numbers: tuple[int, ...],
        referenced_bytes: int,
        owned: bool = False,
    ) -> None:
        super().__init__(arena, owned)
        self.inner = inner
        self.numbers = numbers
        self.referenced_bytes = referenced_bytes

    def __reduce__(self) -> Any:
        arguments = (self.inner, self.arena, self.numbers, self.referenced_bytes, True)
        return _Referencing, arguments

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.referenced_bytes

    def _regions(self) -> Sequence[int]:
        return self.numbers

    def _decode(self, *, pin: bool) -> Any:
        adoption = Adoption(self._claim(), pin=pin)
        try:
            with adoption.active():
                return self.inner._decode(pin=pin)
        finally:
            adoption.hand_back_unread(self.numbers)


class _Decoded(Packet):
    """An item already decoded (by the pin-memory thread)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def _decode(self, *, pin: bool) -> Any:
        return self.value

    def pin_memory(self, device: Any = None) -> Packet:
        return self


def decode(item: Any) -> Any:
    """The item a worker encoded; anything that is not a :class:`Packet` is returned as is."""
    return item.decode() if isinstance(item, Packet) else item


class Encoder:
    """The worker end: turns each item into a :class:`Packet`. One pickler and stream are reused
    (memo cleared between items); nothing of an item is kept. One per worker, not thread-safe."""

    def __init__(self, inline_bytes: int, arena: Arena | None) -> None:
        self._inline_bytes = inline_bytes
        self._arena = arena
        self._stream = io.BytesIO()
        self._buffers: list[pickle.PickleBuffer] = []
        self._references = None if arena is None else ReferenceReducer(arena)
        self._pickler = Pickler(self._stream, self._buffers, self._references)

    def encode(self, item: Any) -> Packet:
        """Pickle ``item``; tensors collated into the arena by reference, the rest by value."""
        references = self._references
        try:
            packet = self._encode_payload(item)
            if references is None or not references.adopted:
                return packet
            # Pickled: the main process will own these regions; each is freed only once it
            # hands it back.
            adopted = references.adopted.values()
            for reservation in adopted:
                reservation.sent = True
            referenced = sum(reservation.nbytes for reservation in adopted)
            return _Referencing(
                packet, references.arena.ident, tuple(references.adopted), referenced
            )
        finally:
            if references is not None:
                references.adopted.clear()

    def _encode_payload(self, item: Any) -> Packet:
        """The payload: inline below the threshold, else into the arena if it has room."""
        stream, buffers, pickler = self._stream, self._buffers, self._pickler
        try:
            pickler.dump(item)
            with stream.getbuffer() as pickled:
                parts = [pickled, *(buffer.raw() for buffer in buffers)]
                sizes = tuple(part.nbytes for part in parts)
                starts, total = offsets(sizes)
                arena = self._arena
                if arena is not None and total >= self._inline_bytes:
                    slot = arena.reserve(total)
                    if slot is not None:
                        arena.write(slot[0], parts, starts)
                        return _InArena(arena.ident, slot[0], slot[1], sizes)
                data = bytearray(total)
                with memoryview(data) as target:
                    fill(target, parts, starts)
                return _Inline(data, sizes)
        finally:
            buffers.clear()
            pickler.clear_memo()
            stream.seek(0)
            stream.truncate()
