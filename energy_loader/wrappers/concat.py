"""ConcatDataset: the inner datasets' epochs one after another.

Ordering. Epoch ``e`` of ``ConcatDataset(a, b, c)`` is the rest of ``a``'s current epoch, then
``b``'s, then ``c``'s; each inner dataset shuffles its own epoch as usual, so the next concat
epoch is every inner dataset's next epoch, in the same order of datasets. Each copy of the
pipeline (worker) reads its own shard of every inner dataset.

State: ``{"phase", "epoch", "current", "inners"}``: the index of the inner dataset being read
(``len(datasets)`` once all have ended) and every inner state, in order. Nothing is buffered.
Ending the epoch early (an outer ``LimitDataset``) ends the current inner epoch; the inner
datasets not reached yet start their next epoch when the next concat epoch reaches them.

Restore key: ``(i, inner_key)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..dataset import EpochCursor, Key, SavableDataset, bad_state
from ..state.plain import StateReader
from ._multi import MultiCursor, MultiWrapperDataset

__all__ = ["ConcatDataset"]


class _ConcatCursor(MultiCursor):
    dataset: ConcatDataset

    def __init__(self, dataset: ConcatDataset) -> None:
        super().__init__(dataset)
        self.current = 0

    def begin_epoch(self) -> None:
        self.current = 0

    def resume(self) -> Iterator[tuple[Key, Any]]:
        count = len(self.dataset.datasets)
        while self.current < count:
            yield from self.tagged(self.current)
            self.current += 1

    def finish(self) -> None:
        datasets = self.dataset.datasets
        if self.phase == "running" and self.current < len(datasets):
            datasets[self.current].finish_epoch()
            self.current = len(datasets)
        super().finish()

    def fields(self) -> dict[str, Any]:
        return {"current": self.current}

    def load_fields(self, reader: StateReader) -> None:
        self.current = reader.int("current")
        count = len(self.dataset.datasets)
        if self.current > count:
            raise bad_state(
                f"{reader.path}.current", f"is {self.current} but there are {count} inner datasets"
            )


class ConcatDataset(MultiWrapperDataset):
    """Read the inner datasets one after another, each to the end of its epoch.

    ``len()`` is the sum of the inner lengths (where all are known). Example::

        ConcatDataset(IndexedSource(books), IndexedSource(papers, shuffle=True, seed=1))
    """

    def __init__(self, *datasets: SavableDataset) -> None:
        if len(datasets) == 1 and isinstance(datasets[0], (list, tuple)):
            raise TypeError(
                "ConcatDataset takes the datasets as separate arguments: "
                "ConcatDataset(*datasets), not ConcatDataset(datasets)"
            )
        super().__init__(datasets)

    def _new_cursor(self) -> EpochCursor:
        return _ConcatCursor(self)

    def __len__(self) -> int:
        lengths = (len(dataset) for dataset in self.datasets)  # type: ignore[arg-type]
        return sum(lengths)
