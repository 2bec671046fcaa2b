"""UnbatchDataset: split batches into single samples or into micro-batches of ``m``.

State: the batch being split (its restore key) and its first row not yet yielded; without an
inner ``restore_sample``, ``inner`` holds the state from before the batch, which is pulled
again. See docs/wrappers.md, "UnbatchDataset".
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..dataset import (
    RESTORE_KEY,
    BaseWrapperDataset,
    EpochCursor,
    Key,
    SavableDataset,
    WrapperCursor,
    bad_state,
)
from ..errors import EnergyLoaderError
from ..state.plain import StateReader, to_key
from ..validation import require_int

__all__ = ["UnbatchDataset", "batch_length", "take_rows"]

_MISSING: Any = object()


def _tensordict_type() -> Any:
    """``tensordict.TensorDictBase`` if tensordict was imported (a batch can only be one then)."""
    module = sys.modules.get("tensordict")
    return getattr(module, "TensorDictBase", None) if module is not None else None


def batch_length(batch: Any, path: str = "batch") -> int:
    """The size of ``batch``'s first dimension; raises if its parts disagree or have none."""
    td_type = _tensordict_type()
    if td_type is not None and isinstance(batch, td_type):
        if not batch.batch_size:
            raise ValueError(f"{path} is a TensorDict with no batch dimension")
        return int(batch.batch_size[0])
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        if batch.ndim == 0:
            raise ValueError(f"{path} is a 0-d {type(batch).__name__}, which has no rows")
        return int(batch.size(0)) if isinstance(batch, torch.Tensor) else batch.shape[0]
    if isinstance(batch, list):
        return len(batch)
    if isinstance(batch, (Mapping, tuple)):
        items = batch.items() if isinstance(batch, Mapping) else enumerate(batch)
        sizes = {
            name: batch_length(value, f"{path}[{name!r}]")
            for name, value in items
            if name != RESTORE_KEY
        }
        if not sizes:
            raise ValueError(f"{path} is empty: there is nothing to split")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"the parts of {path} disagree on the batch size: {sizes}")
        return next(iter(sizes.values()))
    raise TypeError(
        f"{path} is a {type(batch).__name__}; UnbatchDataset splits tensors, numpy arrays, "
        "lists, dicts and tuples of those, and TensorDicts"
    )


def _nested(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor(parts, dtype=like.dtype, layout=like.layout)


def take_rows(batch: Any, start: int, stop: int | None) -> Any:
    """Rows ``start:stop`` of ``batch`` as a micro-batch, or row ``start`` alone (``stop=None``)."""
    td_type = _tensordict_type()
    if td_type is not None and isinstance(batch, td_type):
        try:
            return (batch[start] if stop is None else batch[start:stop]).clone()
        except (NotImplementedError, RuntimeError):  # entries that cannot be sliced (nested)
            entries = {name: take_rows(value, start, stop) for name, value in batch.items()}
            size = [] if stop is None else [stop - start]
            return type(batch)(entries, batch_size=size + list(batch.batch_size[1:]))
    if isinstance(batch, torch.Tensor):
        if batch.is_nested:
            parts = batch.unbind()
            return parts[start] if stop is None else _nested(list(parts[start:stop]), batch)
        return (batch[start] if stop is None else batch[start:stop]).clone()
    if isinstance(batch, np.ndarray):
        return (batch[start] if stop is None else batch[start:stop]).copy()
    if isinstance(batch, list):
        return batch[start] if stop is None else batch[start:stop]
    if isinstance(batch, Mapping):
        return {
            name: take_rows(value, start, stop)
            for name, value in batch.items()
            if name != RESTORE_KEY
        }
    return tuple(take_rows(column, start, stop) for column in batch)


class _UnbatchCursor(WrapperCursor):
    dataset: UnbatchDataset

    def __init__(self, dataset: UnbatchDataset) -> None:
        super().__init__(dataset)
        self._clear()

    def _clear(self) -> None:
        self.batch_key: Key | None = None
        self.batch: Any = _MISSING
        self.offset = 0
        self.before: dict[str, Any] | None = None

    def begin_epoch(self) -> None:
        super().begin_epoch()
        self._clear()

    def resume(self) -> Iterator[tuple[Key, Any]]:
        if self.batch_key is not None:
            if self.batch is _MISSING:
                self.batch = self._rebuild(self.batch_key)
            yield from self._split(self.batch_key, self.batch)
        replay, inner = self.dataset.replay, self.dataset.dataset
        stream = self.inner_samples()
        while True:
            before = inner.save_state() if replay else None
            pair = next(stream, None)
            if pair is None:
                return
            self.batch_key, self.batch, self.offset, self.before = pair[0], pair[1], 0, before
            yield from self._split(*pair)

    def _split(self, key: Key, batch: Any) -> Iterator[tuple[Key, Any]]:
        size, step = batch_length(batch), self.dataset.micro_batch_size
        start = self.offset
        out_key: Key
        while start < size:
            stop = start + 1 if step is None else min(start + step, size)
            if step is None:
                out_key, piece = (key, start), take_rows(batch, start, None)
            else:
                out_key, piece = (key, start, stop), take_rows(batch, start, stop)
            if stop >= size:
                self._clear()
            else:
                self.offset = stop
            start = stop
            yield out_key, piece
        self._clear()

    def _rebuild(self, key: Key) -> Any:
        inner = self.dataset.dataset
        if not self.dataset.replay:
            return inner.restore_sample(key)
        pair = next(self.inner_samples(), None)
        if pair is None or pair[0] != key:
            got = "the end of the epoch" if pair is None else f"restore key {pair[0]!r}"
            raise EnergyLoaderError(
                f"UnbatchDataset: replaying the inner {type(inner).__name__} from its saved "
                f"state gave {got} instead of the batch {key!r}; the inner pipeline must be "
                "deterministic (or able to restore samples)"
            )
        return pair[1]

    def state(self) -> dict[str, Any]:
        out = super().state()
        if self.before is not None:
            out["inner"] = self.before
        return out

    def fields(self) -> dict[str, Any]:
        key = None if self.batch_key is None else list(self.batch_key)
        return {"batch": key, "offset": self.offset}

    def load_fields(self, reader: StateReader) -> None:
        self._clear()
        raw = reader.raw("batch")
        self.batch_key = None if raw is None else to_key(raw, f"{reader.path}.batch")
        if self.batch_key is not None:
            try:
                self.dataset.dataset.validate_key(self.batch_key)
            except ValueError as error:
                raise bad_state(f"{reader.path}.batch", f"is not a valid key: {error}") from None
        self.offset = reader.int("offset")
        if self.batch_key is None and self.offset:
            raise bad_state(f"{reader.path}.offset", "must be 0 when no batch is being split")

    def load(self, reader: StateReader) -> None:
        super().load(reader)
        if self.dataset.replay and self.batch_key is not None:
            self.before = reader.raw("inner")


class UnbatchDataset(BaseWrapperDataset):
    """Split each batch into samples, or into micro-batches of ``micro_batch_size`` rows.

    ``len()`` is unknown (batch sizes vary). Example::

        UnbatchDataset(stream_of_batches)                        # one sample at a time
        UnbatchDataset(BatchDataset(source, 64), micro_batch_size=16)   # 4 micro-batches each
    """

    def __init__(self, dataset: SavableDataset, micro_batch_size: int | None = None) -> None:
        super().__init__(dataset)
        if micro_batch_size is not None:
            require_int(micro_batch_size, "micro_batch_size", minimum=1)
        self.micro_batch_size = micro_batch_size
        self.replay = not dataset.can_restore_sample()

    def _new_cursor(self) -> EpochCursor:
        return _UnbatchCursor(self)

    def _split_key(self, key: Key) -> tuple[Key, int, int | None]:
        step = self.micro_batch_size
        size = 2 if step is None else 3
        if (
            len(key) != size
            or not isinstance(key[0], tuple)
            or not all(type(part) is int and part >= 0 for part in key[1:])
            or (step is not None and not 0 < key[2] - key[1] <= step)
        ):
            shape = "(batch_key, row)" if step is None else "(batch_key, start, stop)"
            raise ValueError(f"UnbatchDataset restore keys are {shape}; got {key!r}")
        return key[0], key[1], None if step is None else key[2]

    def restore_sample(self, key: Key) -> Any:
        batch_key, start, stop = self._split_key(key)
        return take_rows(self.dataset.restore_sample(batch_key), start, stop)

    def validate_key(self, key: Key) -> None:
        self.dataset.validate_key(self._split_key(key)[0])

    def _config_fields(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size}
