"""FilterDataset: keep the samples for which ``predicate(sample)`` is true.

State: none of its own (the inner state passes through): after yielding a kept sample the
inner dataset stands right after it, and dropped samples in between leave no trace to save.
Restore key: the kept sample's inner key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..dataset import Key, SavableDataset, apply_user_fn
from .map import SeededFnDataset

__all__ = ["FilterDataset"]


class FilterDataset(SeededFnDataset):
    """Drop the samples for which ``predicate`` returns false.

    The predicate runs under :class:`MapDataset`'s per-sample seeding (``seed_per_sample``), so a
    random predicate ("keep 10%") is reproducible. ``len()`` is unknown. Example::

        FilterDataset(source, lambda s: len(s["text"]) > 0)
    """

    fn_name = "predicate"
    predicate: Callable[[Any], bool]

    def __init__(
        self,
        dataset: SavableDataset,
        predicate: Callable[[Any], bool],
        *,
        seed_per_sample: bool = True,
    ) -> None:
        super().__init__(dataset, predicate, seed_per_sample)

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        predicate, seeded = self.predicate, self.seeded
        for key, sample in self.dataset.iter_keyed():
            if apply_user_fn(predicate, sample, key, owner=self, seeded=seeded):
                yield key, sample
