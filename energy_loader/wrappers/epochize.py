"""EpochizeDataset: cut a long or endless stream into epochs of ``length`` samples of the job.

Each epoch continues the stream where the last stopped (unlike ``LimitDataset``), rolling the
inner dataset over into its next epoch. State: ``{"phase", "epoch", "count", "pass_count",
"inner"}``. See docs/wrappers.md, "EpochizeDataset".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..dataset import BaseWrapperDataset, EpochCursor, Key, SavableDataset
from ..errors import EnergyLoaderError
from ..state.plain import StateReader
from ..validation import require_int

__all__ = ["EpochizeDataset"]


class _EpochizeCursor(EpochCursor):
    dataset: EpochizeDataset

    def __init__(self, dataset: EpochizeDataset) -> None:
        super().__init__(dataset)
        self.count = 0
        self.pass_count = 0

    def begin_epoch(self) -> None:
        self.count = 0

    def resume(self) -> Iterator[tuple[Key, Any]]:
        length, inner = self.dataset.context.share_of(self.dataset.length), self.dataset.dataset
        while self.count < length:
            for pair in inner.iter_keyed():
                self.count += 1
                self.pass_count += 1
                yield pair
                if self.count >= length:
                    return
            if self.pass_count == 0:
                raise EnergyLoaderError(
                    f"EpochizeDataset: the inner {type(inner).__name__} yielded no sample in a "
                    "whole epoch, so the stream cannot continue (is this worker's shard empty? "
                    "use fewer workers or a larger dataset)"
                )
            self.pass_count = 0

    def fields(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "pass_count": self.pass_count,
            "inner": self.dataset.dataset.save_state(),
        }

    def load_fields(self, reader: StateReader) -> None:
        self.count = reader.int("count")
        self.pass_count = reader.int("pass_count")
        self.dataset.dataset._restore_from(reader.sub("inner"))


class EpochizeDataset(BaseWrapperDataset):
    """Epochs of exactly ``length`` samples from a stream that continues across them.

    Typical use: an endless blend or repeat, where an "epoch" is a fixed number of steps
    between evaluations. Example::

        EpochizeDataset(RepeatDataset(source), 10_000)   # epochs of 10k samples of the job
    """

    def __init__(self, dataset: SavableDataset, length: int) -> None:
        super().__init__(dataset)
        self.length = require_int(length, "length", minimum=1)

    def _new_cursor(self) -> EpochCursor:
        return _EpochizeCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {"length": self.length}

    def __len__(self) -> int:
        """This partition's items per epoch: its share of ``length``."""
        return self.context.share_of(self.length)
