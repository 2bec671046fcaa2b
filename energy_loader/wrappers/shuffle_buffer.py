"""ShuffleBufferDataset: reservoir-style shuffling through a buffer of ``size`` samples.

State: the :class:`~energy_loader.rng.CounterRng` counter and the buffered samples' restore
keys (``indices`` or ``keys``), never samples: they are rebuilt lazily when picked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..dataset import (
    BaseWrapperDataset,
    EpochCursor,
    Key,
    SavableDataset,
    WrapperCursor,
    bad_state,
)
from ..rng import CounterRng, stable_hash
from ..state.plain import StateReader, pack_keys, unpack_keys
from ..validation import require_int
from .batch import require_restorable

__all__ = ["ShuffleBufferDataset"]

_MISSING: Any = object()


class _ShuffleBufferCursor(WrapperCursor):
    dataset: ShuffleBufferDataset

    def __init__(self, dataset: ShuffleBufferDataset) -> None:
        super().__init__(dataset)
        self.counter = 0
        self.buffer: list[tuple[Key, Any]] = []

    def begin_epoch(self) -> None:
        super().begin_epoch()
        self.buffer = []

    def _take(self, rng: CounterRng, index: int) -> tuple[Key, Any]:
        key, sample = self.buffer[index]
        if sample is _MISSING:
            sample = self.dataset.dataset.restore_sample(key)
        self.counter = rng.counter
        return key, sample

    def resume(self) -> Iterator[tuple[Key, Any]]:
        dataset, buffer = self.dataset, self.buffer
        rng = CounterRng(dataset.stream_seed(), self.counter)
        yield from self._drain(rng, dataset.size)
        for pair in self.inner_samples():
            if len(buffer) < dataset.size:  # read each time: a restore may change it
                buffer.append(pair)
                continue
            index = rng.below(len(buffer))
            out = self._take(rng, index)
            buffer[index] = pair
            yield out
            if len(buffer) > dataset.size:  # no generator made per item otherwise
                yield from self._drain(rng, dataset.size)
        yield from self._drain(rng, 0)

    def _drain(self, rng: CounterRng, size: int) -> Iterator[tuple[Key, Any]]:
        """Items taken at random until ``size`` are left: the epoch's end (0), or a buffer a
        restore made smaller (the inner dataset waits until it holds the new size)."""
        buffer = self.buffer
        while len(buffer) > size:
            index = rng.below(len(buffer))
            out = self._take(rng, index)
            buffer[index] = buffer[-1]
            buffer.pop()
            yield out

    def fields(self) -> dict[str, Any]:
        return {"counter": self.counter, **pack_keys([key for key, _ in self.buffer])}

    def load_fields(self, reader: StateReader) -> None:
        self.counter = reader.int("counter")
        keys = unpack_keys(reader)  # more than size: saved while a smaller size drained
        inner = self.dataset.dataset
        for key in keys:
            try:
                inner.validate_key(key)
            except ValueError as error:
                raise bad_state(reader.path, f"buffered key {key!r} is invalid: {error}") from None
        self.buffer = [(key, _MISSING) for key in keys]


class ShuffleBufferDataset(BaseWrapperDataset):
    """Shuffle within a sliding buffer of ``size`` samples.

    Each new sample replaces a random buffered one, which is yielded; at the inner epoch's end
    the buffer drains in random order. Needs an inner ``restore_sample`` (every built-in has one)::

        ShuffleBufferDataset(MapDataset(source, tokenize), size=1000)
    """

    def __init__(self, dataset: SavableDataset, size: int) -> None:
        super().__init__(dataset)
        self.size = require_int(size, "size", minimum=1)
        require_restorable(dataset, "ShuffleBufferDataset saves its buffer")

    def stream_seed(self) -> int:
        """The seed of this buffer's random stream in the current worker."""
        return stable_hash(self.context.worker_seed, self.stream_salt())

    def _new_cursor(self) -> EpochCursor:
        return _ShuffleBufferCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {"size": self.size}

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]
