"""PackingDataset: pack variable-length token sequences into buffers of at most ``max_len``.

First fit over a look-ahead buffer, deterministic given the inner order; a pack is
``{"tokens", "cu_seqlens"}``. State saves pieces as ``[inner_key, start, stop]``, rebuilt
lazily after a restore. See docs/wrappers.md, "PackingDataset".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..dataset import (
    BaseWrapperDataset,
    EpochCursor,
    Key,
    SavableDataset,
    WrapperCursor,
    apply_user_fn,
    bad_state,
    user_fn_fields,
)
from ..state.plain import StateReader, to_key
from ..validation import require_bool, require_callable, require_int
from .batch import check_inner_key, require_restorable

__all__ = ["PackingDataset"]

TOO_LONG = ("split", "drop")

# A piece: (inner key, start, stop, tokens of that range or None until rebuilt).
_Piece = tuple[Key, int, int, "torch.Tensor | None"]


def _as_tokens(value: Any, key: Key) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tokens = value
    elif isinstance(value, np.ndarray):
        tokens = torch.from_numpy(value)
    elif isinstance(value, (list, tuple)):
        tokens = torch.tensor(list(value), dtype=torch.long)
    else:
        raise TypeError(
            f"PackingDataset: the sample with restore key {key!r} is a {type(value).__name__}; "
            "it needs a 1-D tensor, numpy array or list of token ids (pass encode_fn=...)"
        )
    if tokens.dim() != 1:
        raise ValueError(
            f"PackingDataset: the token sequence of restore key {key!r} has shape "
            f"{tuple(tokens.shape)}; it must be 1-D"
        )
    return tokens


class _PackingCursor(WrapperCursor):
    dataset: PackingDataset

    def __init__(self, dataset: PackingDataset) -> None:
        super().__init__(dataset)
        self.pack: list[_Piece] = []
        self.used = 0
        self.buffer: list[_Piece] = []

    def begin_epoch(self) -> None:
        super().begin_epoch()
        self.pack, self.used, self.buffer = [], 0, []

    def _emit(self) -> tuple[Key, Any]:
        """Close the open pack, open the next one from the buffer (first fit), return it."""
        done = self.pack
        self.pack, self.used, rest = [], 0, []
        max_len = self.dataset.max_len
        for piece in self.buffer:
            size = piece[2] - piece[1]
            if self.used + size <= max_len:
                self.pack.append(piece)
                self.used += size
            else:
                rest.append(piece)
        self.buffer = rest
        return self.dataset.make_pack(done)

    def _must_emit(self) -> bool:
        if not self.pack:
            return False
        return self.used == self.dataset.max_len or len(self.buffer) >= self.dataset.buffer_size

    def resume(self) -> Iterator[tuple[Key, Any]]:
        packing = self.dataset
        max_len = packing.max_len
        while self._must_emit():
            yield self._emit()
        for key, sample in self.inner_samples():
            tokens = packing.encode(key, sample)
            length = len(tokens)
            if length > max_len and packing.too_long == "drop":
                continue
            for start in range(0, length, max_len):
                stop = min(start + max_len, length)
                piece = (key, start, stop, tokens[start:stop])
                if self.used + stop - start <= max_len:
                    self.pack.append(piece)
                    self.used += stop - start
                else:
                    self.buffer.append(piece)
            while self._must_emit():
                yield self._emit()
        while self.pack:
            yield self._emit()

    def fields(self) -> dict[str, Any]:
        return {
            "pack": [[list(k), a, b] for k, a, b, _ in self.pack],
            "buffer": [[list(k), a, b] for k, a, b, _ in self.buffer],
        }

    def load_fields(self, reader: StateReader) -> None:
        self.pack = _read_pieces(reader, "pack", self.dataset)
        self.buffer = _read_pieces(reader, "buffer", self.dataset)
        self.used = sum(b - a for _, a, b, _ in self.pack)
        if self.used > self.dataset.max_len:
            raise bad_state(f"{reader.path}.pack", f"holds {self.used} tokens > max_len")
        if self.buffer and not self.pack:
            raise bad_state(f"{reader.path}.pack", "is empty while the buffer is not")


def _read_pieces(reader: StateReader, name: str, packing: PackingDataset) -> list[_Piece]:
    pieces: list[_Piece] = []
    for i, item in enumerate(reader.list(name)):
        path = f"{reader.path}.{name}[{i}]"
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise bad_state(path, f"must be [inner_key, start, stop], got {item!r}")
        key, start, stop = to_key(item[0], path), item[1], item[2]
        valid = type(start) is int and type(stop) is int and 0 <= start < stop
        if not valid or stop - start > packing.max_len:
            raise bad_state(path, f"has an invalid token range [{start!r}, {stop!r})")
        check_inner_key(packing.dataset, key, path)
        pieces.append((key, start, stop, None))
    return pieces


class PackingDataset(BaseWrapperDataset):
    """Pack token sequences into buffers of at most ``max_len`` tokens (sequence packing).

    ``buffer_size`` pieces of look-ahead trade pack fill against memory and latency; ``encode_fn``
    runs under :class:`MapDataset`'s per-sample seeding. ``len()`` is unknown. Example::

        PackingDataset(source, 4096, encode_fn=lambda s: tokenizer(s["text"]), buffer_size=64)
    """

    def __init__(
        self,
        dataset: SavableDataset,
        max_len: int,
        *,
        buffer_size: int = 16,
        too_long: str = "split",
        encode_fn: Callable[[Any], Any] | None = None,
        pad_id: int | None = None,
        seed_per_sample: bool = True,
    ) -> None:
        super().__init__(dataset)
        self.max_len = require_int(max_len, "max_len", minimum=1)
        self.buffer_size = require_int(buffer_size, "buffer_size", minimum=1)
        if too_long not in TOO_LONG:
            raise ValueError(
                "`too_long` must be 'split' (cut over-long sequences into max_len pieces) or "
                f"'drop' (skip them); got {too_long!r}"
            )
        if encode_fn is not None:
            require_callable(encode_fn, "encode_fn")
        if pad_id is not None:
            require_int(pad_id, "pad_id", minimum=0)
        require_bool(seed_per_sample, "seed_per_sample")
        require_restorable(dataset, "PackingDataset saves its buffer")
        self.too_long = too_long
        self.encode_fn = encode_fn
        self.pad_id = pad_id
        self.seed_per_sample = seed_per_sample

    def encode(self, key: Key, sample: Any) -> torch.Tensor:
        """The token sequence of one inner sample (seeded ``encode_fn``, or the sample)."""
        if self.encode_fn is None:
            return _as_tokens(sample, key)
        value = apply_user_fn(self.encode_fn, sample, key, owner=self, seeded=self.seed_per_sample)
        return _as_tokens(value, key)

    def make_pack(self, pieces: list[_Piece]) -> tuple[Key, dict[str, torch.Tensor]]:
        """``(restore key, pack)`` from pieces, rebuilding the tokens of restored ones."""
        rebuilt: dict[Key, torch.Tensor] = {}
        parts = []
        for key, start, stop, tokens in pieces:
            if tokens is None:
                if key not in rebuilt:
                    rebuilt[key] = self.encode(key, self.dataset.restore_sample(key))
                tokens = rebuilt[key][start:stop]
                if len(tokens) != stop - start:
                    raise ValueError(
                        f"PackingDataset: restore key {key!r} now has {len(rebuilt[key])} "
                        f"tokens, too few for the saved range [{start}, {stop})"
                    )
            parts.append(tokens)
        boundaries = [0]
        for part in parts:
            boundaries.append(boundaries[-1] + len(part))
        tokens = torch.cat(parts)
        if self.pad_id is not None and len(tokens) < self.max_len:
            padding = torch.full((self.max_len - len(tokens),), self.pad_id, dtype=tokens.dtype)
            tokens = torch.cat([tokens, padding])
        pack = {"tokens": tokens, "cu_seqlens": torch.tensor(boundaries, dtype=torch.int32)}
        return tuple((key, start, stop) for key, start, stop, _ in pieces), pack

    def _pieces_of(self, key: Key) -> list[_Piece]:
        """The pieces named by a pack's restore key (shape checked, tokens not yet rebuilt)."""
        pieces: list[_Piece] = []
        for piece in key:
            if not (
                isinstance(piece, tuple)
                and len(piece) == 3
                and isinstance(piece[0], tuple)
                and type(piece[1]) is int
                and type(piece[2]) is int
                and 0 <= piece[1] < piece[2]
            ):
                raise ValueError(
                    f"PackingDataset restore keys are tuples of (inner_key, start, stop); "
                    f"got {key!r}"
                )
            pieces.append((piece[0], piece[1], piece[2], None))
        total = sum(stop - start for _, start, stop, _ in pieces)
        if not pieces or total > self.max_len:
            raise ValueError(
                f"PackingDataset restore keys name 1 or more pieces of at most max_len="
                f"{self.max_len} tokens in all; got {key!r}"
            )
        return pieces

    def restore_sample(self, key: Key) -> Any:
        return self.make_pack(self._pieces_of(key))[1]

    def validate_key(self, key: Key) -> None:
        for inner_key, _, _, _ in self._pieces_of(key):
            self.dataset.validate_key(inner_key)

    def _new_cursor(self) -> EpochCursor:
        return _PackingCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {
            "max_len": self.max_len,
            "buffer_size": self.buffer_size,
            "too_long": self.too_long,
            **user_fn_fields("encode_fn", self.encode_fn),
            "pad_id": self.pad_id,
            "seed_per_sample": self.seed_per_sample,
        }
