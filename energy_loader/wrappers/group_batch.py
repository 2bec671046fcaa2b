"""GroupBatchDataset: batches of samples that share a group key (bucketing).

A full bucket of ``key_fn(sample)`` is collated and yielded; partial ones at the inner epoch's
end (``leftovers``). State: the partial buckets as ``[group, [restore keys]]``, oldest first.
See docs/wrappers.md, "GroupBatchDataset".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

from ..dataset import (
    EpochCursor,
    Key,
    SavableDataset,
    WrapperCursor,
    apply_user_fn,
    bad_state,
    callable_name,
    user_fn_fields,
)
from ..errors import StateFormatError
from ..state.plain import StateReader, to_key
from ..validation import require_bool, require_callable, require_int
from .batch import CollatingDataset, check_inner_key, require_restorable

__all__ = ["GroupBatchDataset"]

LEFTOVERS = ("emit", "drop")
_MISSING: Any = object()
_SCALARS = (str, int, float, bool, type(None))


def _is_plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_is_plain(part) for part in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, _SCALARS)


def _from_state(value: Any, path: str) -> Hashable:
    """A group key back from plain data (JSON turns tuples into lists)."""
    group = to_key([value], path)[0]
    if not _is_plain(group):
        raise StateFormatError(f"{path} is not a plain group key: {value!r}")
    return group


class _GroupBatchCursor(WrapperCursor):
    dataset: GroupBatchDataset

    def __init__(self, dataset: GroupBatchDataset) -> None:
        super().__init__(dataset)
        self.buckets: dict[Hashable, list[tuple[Key, Any]]] = {}

    def begin_epoch(self) -> None:
        super().begin_epoch()
        self.buckets = {}

    def resume(self) -> Iterator[tuple[Key, Any]]:
        grouping = self.dataset
        for key, sample in self.inner_samples():
            group = grouping.group_of(key, sample)
            bucket = self.buckets.setdefault(group, [])
            bucket.append((key, sample))
            if len(bucket) >= grouping.size_of(group):
                del self.buckets[group]
                yield grouping.make_batch(bucket)
        while self.buckets:
            group = next(iter(self.buckets))
            bucket = self.buckets.pop(group)
            if grouping.leftovers == "emit":
                yield grouping.make_batch(bucket)

    def fields(self) -> dict[str, Any]:
        return {
            "buckets": [
                [_to_plain(group), [list(key) for key, _ in bucket]]
                for group, bucket in self.buckets.items()
            ]
        }

    def load_fields(self, reader: StateReader) -> None:
        self.buckets = {}
        for i, item in enumerate(reader.list("buckets")):
            path = f"{reader.path}.buckets[{i}]"
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise bad_state(path, f"must be [group, [restore keys]], got {item!r}")
            group = _from_state(item[0], path)
            if group in self.buckets:
                raise bad_state(path, f"repeats the group {group!r}")
            keys = StateReader({"keys": item[1]}, path).keys("keys")
            if not 0 < len(keys) < self.dataset.size_of(group):
                raise bad_state(
                    path,
                    f"holds {len(keys)} keys; a partial bucket of {group!r} holds 1 to "
                    f"{self.dataset.size_of(group) - 1}",
                )
            for key in keys:
                check_inner_key(self.dataset.dataset, key, path)
            self.buckets[group] = [(key, _MISSING) for key in keys]


def _to_plain(group: Hashable) -> Any:
    return [_to_plain(part) for part in group] if isinstance(group, tuple) else group


class GroupBatchDataset(CollatingDataset):
    """Batch samples whose ``key_fn`` agrees, ``batch_size`` (or ``batch_sizes[key]``) at a time.

    ``collate_fn`` builds each batch (default :func:`default_collate`); ``len()`` is unknown::

        GroupBatchDataset(source, lambda s: len(s["tokens"]) // 128, 32,
                          batch_sizes={0: 128, 1: 64}, leftovers="drop")
    """

    def __init__(
        self,
        dataset: SavableDataset,
        key_fn: Callable[[Any], Hashable],
        batch_size: int,
        *,
        batch_sizes: Mapping[Hashable, int] | None = None,
        leftovers: str = "emit",
        collate_fn: Callable[[Sequence[Any]], Any] | None = None,
        seed_per_sample: bool = True,
    ) -> None:
        super().__init__(dataset)
        require_callable(key_fn, "key_fn")
        self.batch_size = require_int(batch_size, "batch_size", minimum=1)
        sizes: dict[Hashable, int] = {}
        if batch_sizes is not None:
            if not isinstance(batch_sizes, Mapping):
                raise TypeError(
                    "`batch_sizes` must be a mapping {group key: batch size} or None "
                    f"(got {type(batch_sizes).__name__})"
                )
            for group, size in batch_sizes.items():
                if not _is_plain(group):
                    raise TypeError(
                        f"`batch_sizes` keys must be plain group keys (str, int, float, bool, "
                        f"None or tuples of those); got {group!r}"
                    )
                sizes[group] = require_int(size, f"batch_sizes[{group!r}]", minimum=1)
        if leftovers not in LEFTOVERS:
            raise ValueError(
                "`leftovers` must be 'emit' (yield the partial batches at the end of the epoch) "
                f"or 'drop' (discard them); got {leftovers!r}"
            )
        if collate_fn is not None:
            require_callable(collate_fn, "collate_fn")
        require_bool(seed_per_sample, "seed_per_sample")
        require_restorable(dataset, "GroupBatchDataset saves its buckets")
        self.key_fn = key_fn
        self.batch_sizes = sizes
        self.leftovers = leftovers
        self.collate_fn = collate_fn
        self.seed_per_sample = seed_per_sample

    def group_of(self, key: Key, sample: Any) -> Hashable:
        """The group key of one sample (seeded ``key_fn``), checked to be plain."""
        group = apply_user_fn(self.key_fn, sample, key, owner=self, seeded=self.seed_per_sample)
        if not _is_plain(group):
            raise TypeError(
                f"GroupBatchDataset: {callable_name(self.key_fn)} returned {group!r} "
                f"({type(group).__name__}) for restore key {key!r}; group keys go into the "
                "saved state and must be str, int, finite float, bool, None or tuples of those"
            )
        return group

    def size_of(self, group: Hashable) -> int:
        """The batch size of one group."""
        return self.batch_sizes.get(group, self.batch_size)

    def make_batch(self, bucket: list[tuple[Key, Any]]) -> tuple[Key, Any]:
        """``(restore key, batch)`` of a bucket, rebuilding samples restored as keys."""
        restore = self.dataset.restore_sample
        samples = [restore(key) if sample is _MISSING else sample for key, sample in bucket]
        return tuple(key for key, _ in bucket), self.collate(samples)

    def largest_batch(self) -> int:
        return max([self.batch_size, *self.batch_sizes.values()])

    def _new_cursor(self) -> EpochCursor:
        return _GroupBatchCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {
            **user_fn_fields("key_fn", self.key_fn),
            "batch_size": self.batch_size,
            "batch_sizes": [[_to_plain(g), s] for g, s in self.batch_sizes.items()],
            "leftovers": self.leftovers,
            **self.collate_fields(),
            "seed_per_sample": self.seed_per_sample,
        }
