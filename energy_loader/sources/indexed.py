"""IndexedSource: any map-style dataset, or ``(length, fn)``, as a savable sharded source.

Shard ``s`` of ``S`` reads positions ``s, s + S, ...`` of each epoch's (Feistel-permuted)
order; ``position`` in the state is global. Restore key ``(index,)``. Per-sample seeding of
reads, shared with a map or filter right on top: docs/api.md, "IndexedSource".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from ..dataset import (
    EpochCursor,
    Key,
    SavableDataset,
    apply_user_fn,
    callable_name,
    code_fingerprint,
)
from ..rng import stable_hash
from ..state.fingerprint import CODE_SUFFIX, FROM_FN
from ..validation import require_bool, require_callable, require_int
from ._strided import StridedCursor
from .permutation import FeistelPermutation

__all__ = ["IndexedSource"]

_ORDER_BLOCK = 256


class _IndexedCursor(StridedCursor):
    dataset: IndexedSource
    reader_name = "shard"

    def resume(self) -> Iterator[tuple[Key, Any]]:
        source = self.dataset
        length, stride = source.length, source.context.num_shards
        order = source.order_for_epoch(self.epoch)
        getitem = source.read
        while self.position < length:
            if order is None:
                indices: Iterable[int] = range(self.position, length, stride)
            else:
                # The order of a block of this shard's positions, computed vectorised.
                stop = min(length, self.position + stride * _ORDER_BLOCK)
                positions = np.arange(self.position, stop, stride, dtype=np.uint64)
                indices = order.take(positions).tolist()
            for index in indices:
                sample = getitem(index)
                self.position += stride
                yield (index,), sample


class IndexedSource(SavableDataset):
    """A savable, sharded, optionally shuffled source over indexable data.

    ``data`` has ``__len__`` and ``__getitem__(int)``; ``shuffle``, ``seed_per_sample`` and the
    order: docs/api.md, "IndexedSource". Example::

        source = IndexedSource(my_dataset, shuffle=True, seed=1234)
        source = IndexedSource.from_fn(length=10**10, fn=make_sample, shuffle=True)
    """

    # from_fn's function: user code, fingerprinted in the config as a map's function is
    # (None over a data object).
    _from_fn: Callable[[int], Any] | None = None

    def __init__(
        self,
        data: Any,
        *,
        shuffle: bool = False,
        seed: int = 0,
        seed_per_sample: bool | None = None,
    ) -> None:
        super().__init__()
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise TypeError(
                "IndexedSource needs map-style data with __len__ and __getitem__ (got "
                f"{type(data).__name__}); for a function use IndexedSource.from_fn(length, fn)"
            )
        if seed_per_sample is None:
            seed_per_sample = not _draws_nothing(data)
        self._init(len(data), data.__getitem__, type(data).__name__, shuffle, seed, seed_per_sample)

    @classmethod
    def from_fn(
        cls,
        length: int,
        fn: Callable[[int], Any],
        *,
        shuffle: bool = False,
        seed: int = 0,
        seed_per_sample: bool = False,
    ) -> IndexedSource:
        """A source of ``length`` samples where sample ``i`` is ``fn(i)``; with
        ``seed_per_sample=True`` each call runs under sample ``i``'s seed (for an ``fn`` that
        draws random numbers: without it, a restore does not re-make its draws and refuses
        to continue). ``fn`` is user code: its code fingerprint (``from_fn_code``) is
        checked at a restore as a map function's is."""
        require_callable(fn, "fn")
        self = cls.__new__(cls)
        SavableDataset.__init__(self)
        self._init(length, fn, callable_name(fn), shuffle, seed, seed_per_sample)
        self._from_fn = fn
        return self

    def _init(
        self,
        length: Any,
        getitem: Callable[[int], Any],
        name: str,
        shuffle: Any,
        seed: Any,
        seed_per_sample: Any,
    ) -> None:
        self.length = require_int(length, "length", minimum=0)
        require_bool(shuffle, "shuffle")
        require_bool(seed_per_sample, "seed_per_sample")
        self.seed = require_int(seed, "seed", minimum=0)
        self.shuffle = shuffle
        self.seed_per_sample = seed_per_sample
        self._getitem = getitem
        self._data_name = name
        # The dataset whose seeding the reads run under: this source, or the wrapper that
        # took it (share_sample_seeding).
        self._seed_scope: SavableDataset = self
        self.read: Callable[[int], Any] = self._seeded_read if seed_per_sample else getitem

    def _seeded_read(self, index: int) -> Any:
        """``data[index]`` under the sample's seed (key ``(index,)``), as a map function."""
        return apply_user_fn(
            self._getitem, index, (index,), owner=self, seeded=True, scope=self._seed_scope
        )

    def share_sample_seeding(self, owner: SavableDataset) -> bool:
        """Read under ``owner``'s seeding (``share_sample_seeding``) if this source seeds its
        reads and no other wrapper took them."""
        taken = self._seed_scope is not self and self._seed_scope is not owner
        if not self.seed_per_sample or taken:
            return False
        self._seed_scope = owner
        return True

    def order_for_epoch(self, epoch: int) -> FeistelPermutation | None:
        """The epoch's global order (``None`` for the identity)."""
        if not self.shuffle:
            return None
        return FeistelPermutation(self.length, stable_hash(self.seed, self.stream_salt(), epoch))

    def _new_cursor(self) -> EpochCursor:
        return _IndexedCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {
            "data": self._data_name,
            "length": self.length,
            "shuffle": self.shuffle,
            "seed": self.seed,
            # the function's name is the data's; only its code is added (a code field, which
            # states saved without it do not compare)
            **(
                {FROM_FN + CODE_SUFFIX: code_fingerprint(self._from_fn)}
                if self._from_fn is not None
                else {}
            ),
            # only when on: states saved unseeded (and before the option) keep their config
            **({"seed_per_sample": True} if self.seed_per_sample else {}),
        }

    def restore_sample(self, key: Key) -> Any:
        self.validate_key(key)
        return self.read(key[0])

    def can_restore_sample(self) -> bool:
        return True

    def validate_key(self, key: Key) -> None:
        if len(key) != 1 or isinstance(key[0], bool) or not isinstance(key[0], int):
            raise ValueError(f"IndexedSource restore keys are (index,); got {key!r}")
        if not 0 <= key[0] < self.length:
            raise ValueError(f"restore key index {key[0]} is outside range({self.length})")

    def __len__(self) -> int:
        """Samples per epoch of this copy's shard (the whole data for worker 0 of 1)."""
        context = self.context
        return len(range(context.shard_index, self.length, context.num_shards))


def _draws_nothing(data: Any) -> bool:
    """Plain containers, whose reads draw no random numbers (read unseeded by default)."""
    import torch

    return isinstance(data, list | tuple | range | np.ndarray | torch.Tensor)
