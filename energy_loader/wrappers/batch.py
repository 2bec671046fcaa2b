"""BatchDataset: group consecutive samples into batches.

State: ``{"phase", "epoch", "inner_done", "inner"}``: a batch is yielded only when complete, so
the inner state says where the next begins, and a state restores under a smaller batch size
that divides the saved one. Restore key: the tuple of the samples' keys.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..dataset import (
    BaseWrapperDataset,
    EpochCursor,
    Key,
    SavableDataset,
    WrapperCursor,
    bad_state,
    user_fn_fields,
)
from ..state.plain import StateReader
from ..validation import require_bool, require_callable, require_int
from .collate import collate_keeping_tuples

__all__ = ["BatchDataset"]


class _BatchCursor(WrapperCursor):
    dataset: BatchDataset

    def resume(self) -> Iterator[tuple[Key, Any]]:
        size, collate = self.dataset.batch_size, self.dataset.collate
        inner = self.inner_samples()
        while pairs := list(itertools.islice(inner, size)):  # a batch's pulls at C speed
            if len(pairs) < size and self.dataset.drop_last:
                return
            keys, samples = zip(*pairs)
            yield keys, collate(list(samples))

    def fields(self) -> dict[str, Any]:
        return {}

    def load_fields(self, reader: StateReader) -> None:
        return None


def require_restorable(dataset: SavableDataset, saves: str) -> None:
    """Refuse an inner dataset without ``restore_sample`` under a wrapper that ``saves`` keys."""
    if not dataset.can_restore_sample():
        raise ValueError(
            f"{saves} as restore keys and needs an inner dataset that can restore samples; "
            f"{type(dataset).__name__} cannot"
        )


def check_inner_key(dataset: SavableDataset, key: Key, path: str) -> None:
    """Raise a state error at ``path`` when ``dataset`` refuses the saved ``key``."""
    try:
        dataset.validate_key(key)
    except ValueError as error:
        raise bad_state(path, f"holds an invalid key: {error}") from None


class CollatingDataset(BaseWrapperDataset):
    """A wrapper whose items are ``collate_fn``-made batches keyed by their samples' keys."""

    collate_fn: Callable[[Sequence[Any]], Any] | None

    @abstractmethod
    def largest_batch(self) -> int:
        """The most samples one of its batches holds (what a restore key may name)."""

    def collate(self, samples: Sequence[Any]) -> Any:
        """Collate with the user's function or :func:`collate_keeping_tuples`."""
        return (self.collate_fn or collate_keeping_tuples)(samples)

    def restore_sample(self, key: Key) -> Any:
        return self.collate([self.dataset.restore_sample(k) for k in key])

    def validate_key(self, key: Key) -> None:
        largest = self.largest_batch()
        if not key or len(key) > largest or not all(type(k) is tuple for k in key):
            raise ValueError(
                f"{type(self).__name__} restore keys are tuples of 1..{largest} sample keys; "
                f"got {key!r}"
            )
        for sample_key in key:
            self.dataset.validate_key(sample_key)

    def collate_fields(self) -> dict[str, Any]:
        if self.collate_fn:
            return user_fn_fields("collate_fn", self.collate_fn)
        return {"collate_fn": "default_collate"}


class BatchDataset(CollatingDataset):
    """Group ``batch_size`` consecutive samples into one batch.

    ``collate_fn`` defaults to :func:`~energy_loader.wrappers.collate.collate_keeping_tuples`
    (torch's batches; ragged data as lists, tuple samples' columns in a tuple). The last batch
    of an epoch may be smaller unless ``drop_last=True``. Example::

        BatchDataset(ShuffleBufferDataset(source, size=1000), batch_size=32)
    """

    def __init__(
        self,
        dataset: SavableDataset,
        batch_size: int,
        *,
        collate_fn: Callable[[Sequence[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset)
        self.batch_size = require_int(batch_size, "batch_size", minimum=1)
        if collate_fn is not None:
            require_callable(collate_fn, "collate_fn")
        require_bool(drop_last, "drop_last")
        self.collate_fn = collate_fn
        self.drop_last = drop_last

    def largest_batch(self) -> int:
        return self.batch_size

    def _new_cursor(self) -> EpochCursor:
        return _BatchCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, **self.collate_fields(), "drop_last": self.drop_last}

    def __len__(self) -> int:
        inner = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last:
            return inner // self.batch_size
        return -(-inner // self.batch_size)
