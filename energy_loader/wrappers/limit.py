"""LimitDataset: at most ``length`` samples per epoch, counted over the whole job.

Each of the ``P`` partitions takes ``length // P`` or one more, on any layout; an epoch ends
the inner epoch too. State: ``{"phase", "epoch", "inner_done", "inner", "count"}``. See
docs/wrappers.md, "LimitDataset".
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
)
from ..state.plain import StateReader
from ..validation import require_int

__all__ = ["LimitDataset"]


class _LimitCursor(WrapperCursor):
    dataset: LimitDataset

    def __init__(self, dataset: LimitDataset) -> None:
        super().__init__(dataset)
        self.count = 0

    def begin_epoch(self) -> None:
        super().begin_epoch()
        self.count = 0

    def resume(self) -> Iterator[tuple[Key, Any]]:
        length = self.dataset.context.share_of(self.dataset.length)
        if self.count < length:
            for pair in self.inner_samples():
                self.count += 1
                yield pair
                if self.count >= length:
                    break
        if not self.inner_done:
            self.dataset.dataset.finish_epoch()
            self.inner_done = True

    def fields(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_fields(self, reader: StateReader) -> None:
        self.count = reader.int("count")


class LimitDataset(BaseWrapperDataset):
    """Stop each epoch after ``length`` samples of the whole job. Example::

    LimitDataset(validation_source, 1000)   # 1000 per epoch, with any number of workers
    """

    def __init__(self, dataset: SavableDataset, length: int) -> None:
        super().__init__(dataset)
        self.length = require_int(length, "length", minimum=0)

    def _new_cursor(self) -> EpochCursor:
        return _LimitCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {"length": self.length}

    def __len__(self) -> int:
        """This partition's items per epoch: its share of ``length``, or fewer."""
        share = self.context.share_of(self.length)
        try:
            return min(share, len(self.dataset))  # type: ignore[arg-type]
        except TypeError:
            return share
