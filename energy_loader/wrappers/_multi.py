"""The shared base of wrappers that read from several inner datasets (blend, concat).

A multi-inner wrapper's state nests its inner datasets' states, in order, under ``"inners"``
beside its own fields. Its samples carry the restore key ``(i, inner_key)``: which inner
dataset made the sample and that dataset's key, so ``restore_sample`` asks the right one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..dataset import EpochCursor, Key, SavableDataset, bad_state
from ..state.plain import StateReader

__all__ = ["MultiCursor", "MultiWrapperDataset"]


class MultiWrapperDataset(SavableDataset):
    """A dataset that reads from several distinct inner datasets: distinct objects sharing no
    dataset below them, since each keeps its own position.
    """

    datasets: tuple[SavableDataset, ...]
    # While a restore replays a state saved before sources were appended: how many it holds
    # (:mod:`energy_loader.state.changes`); the sources after them start fresh.
    saved_sources: int | None = None

    def __init__(self, datasets: Sequence[SavableDataset]) -> None:
        super().__init__()
        name = type(self).__name__
        if not datasets:
            raise ValueError(f"{name} needs at least one inner dataset")
        seen: dict[int, int] = {}
        for position, dataset in enumerate(datasets):
            if not isinstance(dataset, SavableDataset):
                raise TypeError(
                    f"{name}: inner dataset {position} must be a SavableDataset (a source such "
                    f"as IndexedSource, or a wrapper); got {type(dataset).__name__}"
                )
            for node in dataset.walk():
                first = seen.setdefault(id(node), position)
                if first != position:
                    raise ValueError(
                        f"{name}: inner datasets {first} and {position} share the same "
                        f"{type(node).__name__} object; build a separate pipeline for each"
                    )
        self.datasets = tuple(datasets)

    def children(self) -> Sequence[SavableDataset]:
        return self.datasets

    def reset_state(self) -> None:
        super().reset_state()
        for dataset in self.datasets:
            dataset.reset_state()

    def can_restore_sample(self) -> bool:
        return all(dataset.can_restore_sample() for dataset in self.datasets)

    def split_key(self, key: Key) -> tuple[int, Key]:
        """``(i, inner_key)`` from a restore key of this dataset (validated)."""
        count = len(self.datasets)
        if (
            len(key) != 2
            or isinstance(key[0], bool)
            or not isinstance(key[0], int)
            or not 0 <= key[0] < count
            or not isinstance(key[1], tuple)
        ):
            raise ValueError(
                f"{type(self).__name__} restore keys are (i, inner_key) with i in "
                f"range({count}); got {key!r}"
            )
        return key[0], key[1]

    def restore_sample(self, key: Key) -> Any:
        index, inner_key = self.split_key(key)
        return self.datasets[index].restore_sample(inner_key)

    def validate_key(self, key: Key) -> None:
        index, inner_key = self.split_key(key)
        self.datasets[index].validate_key(inner_key)


class MultiCursor(EpochCursor):
    """A cursor of a multi-inner wrapper: own fields plus the inner states under ``inners``."""

    dataset: MultiWrapperDataset

    def tagged(self, index: int) -> Iterator[tuple[Key, Any]]:
        """Inner dataset ``index``'s samples (rest of its epoch) with keys ``(index, key)``."""
        for key, sample in self.dataset.datasets[index].iter_keyed():
            yield (index, key), sample

    def state(self) -> dict[str, Any]:
        out = super().state()
        out["inners"] = [dataset.save_state() for dataset in self.dataset.datasets]
        return out

    def load(self, reader: StateReader) -> None:
        super().load(reader)
        datasets = self.dataset.datasets
        items = reader.list("inners")
        if len(items) != (self.dataset.saved_sources or len(datasets)):
            raise bad_state(
                f"{reader.path}.inners",
                f"holds {len(items)} states but the pipeline has {len(datasets)} inner datasets",
            )
        for index, dataset in enumerate(datasets):
            if index >= len(items):
                dataset.reset_state()  # a source appended since the save: from its beginning
                continue
            dataset._restore_from(StateReader(items[index], f"{reader.path}.inners[{index}]"))


def read_flags(reader: StateReader, name: str, dataset: MultiWrapperDataset) -> list[bool]:
    """A list of booleans, one per inner dataset (those appended since the save: false),
    validated."""
    values, count = reader.list(name), len(dataset.datasets)
    saved = dataset.saved_sources or count
    if len(values) != saved or not all(isinstance(v, bool) for v in values):
        raise bad_state(f"{reader.path}.{name}", f"must be {saved} true/false values, got {values}")
    return values + [False] * (count - saved)
