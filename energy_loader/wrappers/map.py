"""MapDataset: ``fn(sample) -> sample``, with per-sample seeding of the global RNGs.

State: none of its own; a map buffers nothing, so its state *is* the inner dataset's state.
Restore key: the inner sample's key, unchanged; ``restore_sample(key)`` re-runs ``fn`` on the
rebuilt inner sample, after seeding the global RNGs exactly as the first time.
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

__all__ = ["MapDataset"]


class SeededFnDataset(BaseWrapperDataset):
    """A wrapper that runs one user function (attribute ``fn_name``) per sample, seeded."""

    passes_state_through = True
    fn_name = "fn"

    def __init__(self, dataset: SavableDataset, fn: Any, seed_per_sample: bool) -> None:
        super().__init__(dataset)
        require_callable(fn, self.fn_name)
        require_bool(seed_per_sample, "seed_per_sample")
        setattr(self, self.fn_name, fn)
        self.seed_per_sample = seed_per_sample
        # False where the inner source reads under this wrapper's seeding, which covers fn too.
        self.seeded = seed_per_sample and not dataset.share_sample_seeding(self)

    def _config_fields(self) -> dict[str, Any]:
        fn = getattr(self, self.fn_name)
        return {**user_fn_fields(self.fn_name, fn), "seed_per_sample": self.seed_per_sample}


class MapDataset(SeededFnDataset):
    """Apply ``fn`` to every sample.

    ``seed_per_sample=True`` (the default) seeds python, numpy and torch's global RNGs from
    (pipeline seed, this map's position, restore key) before each call (~11 us), so random
    augmentations repeat after a restore and in ``restore_sample``. Example::

        MapDataset(source, lambda s: {**s, "tokens": tokenize(s["text"])})
    """

    fn: Callable[[Any], Any]

    def __init__(
        self, dataset: SavableDataset, fn: Callable[[Any], Any], *, seed_per_sample: bool = True
    ) -> None:
        super().__init__(dataset, fn, seed_per_sample)

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        fn, seeded = self.fn, self.seeded
        for key, sample in self.dataset.iter_keyed():
            yield key, apply_user_fn(fn, sample, key, owner=self, seeded=seeded)

    def restore_sample(self, key: Key) -> Any:
        sample = self.dataset.restore_sample(key)
        return apply_user_fn(self.fn, sample, key, owner=self, seeded=self.seeded)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]
