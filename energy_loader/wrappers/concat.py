"""ConcatDataset: the inner datasets' epochs one after another.

State: ``{"phase", "epoch", "current", "inners"}``; nothing is buffered. Restore key
``(i, inner_key)``. See docs/wrappers.md, "ConcatDataset".
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
