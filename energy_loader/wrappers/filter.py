"""FilterDataset: keep the samples for which ``predicate(sample)`` is true.

State: none of its own (the inner state passes through): after yielding a kept sample the
inner dataset stands right after it, and dropped samples in between leave no trace to save.
Restore key: the kept sample's inner key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..dataset import (
    BaseWrapperDataset,
    Key,
    SavableDataset,
    apply_user_fn,
    user_fn_fields,
)
from ..validation import require_bool, require_callable

__all__ = ["FilterDataset"]


class FilterDataset(BaseWrapperDataset):
    """Drop the samples for which ``predicate`` returns false.

    The predicate runs under :class:`MapDataset`'s per-sample seeding (``seed_per_sample``), so a
    random predicate ("keep 10%") is reproducible. ``len()`` is unknown. Example::

        FilterDataset(source, lambda s: len(s["text"]) > 0)
    """

    passes_state_through = True

    def __init__(
        self,
        dataset: SavableDataset,
        predicate: Callable[[Any], bool],
        *,
        seed_per_sample: bool = True,
    ) -> None:
        super().__init__(dataset)
        require_callable(predicate, "predicate")
        require_bool(seed_per_sample, "seed_per_sample")
        self.predicate = predicate
        self.seed_per_sample = seed_per_sample
        # Whether the inner source reads under this filter's seeding (as MapDataset's).
        self._seeded_with_read = seed_per_sample and dataset.share_sample_seeding(self)

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        predicate = self.predicate
        seeded = self.seed_per_sample and not self._seeded_with_read
        for key, sample in self.dataset.iter_keyed():
            if apply_user_fn(predicate, sample, key, owner=self, seeded=seeded):
                yield key, sample

    def _config_fields(self) -> dict[str, Any]:
        return {
            **user_fn_fields("predicate", self.predicate),
            "seed_per_sample": self.seed_per_sample,
        }
