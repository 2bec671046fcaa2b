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


class MapDataset(BaseWrapperDataset):
    """Apply ``fn`` to every sample.

    With ``seed_per_sample=True`` (the default) python ``random``, numpy's global RNG and torch's
    default CPU generator are seeded from (pipeline seed, this map's position, restore key) before
    each call (~11 us; once before the read when the source seeds its reads), so random
    augmentations are reproduced after a restore and by ``restore_sample`` on any worker. Pass
    ``False`` for functions that draw nothing. Example::

        MapDataset(source, lambda s: {**s, "tokens": tokenize(s["text"])})
    """

    passes_state_through = True

    def __init__(
        self,
        dataset: SavableDataset,
        fn: Callable[[Any], Any],
        *,
        seed_per_sample: bool = True,
    ) -> None:
        super().__init__(dataset)
        require_callable(fn, "fn")
        require_bool(seed_per_sample, "seed_per_sample")
        self.fn = fn
        self.seed_per_sample = seed_per_sample
        # Whether the inner source reads under this map's seeding, which then covers fn too.
        self._seeded_with_read = seed_per_sample and dataset.share_sample_seeding(self)

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        fn, seeded = self.fn, self.seed_per_sample and not self._seeded_with_read
        for key, sample in self.dataset.iter_keyed():
            yield key, apply_user_fn(fn, sample, key, owner=self, seeded=seeded)

    def restore_sample(self, key: Key) -> Any:
        sample = self.dataset.restore_sample(key)
        seeded = self.seed_per_sample and not self._seeded_with_read
        return apply_user_fn(self.fn, sample, key, owner=self, seeded=seeded)

    def _config_fields(self) -> dict[str, Any]:
        return {**user_fn_fields("fn", self.fn), "seed_per_sample": self.seed_per_sample}

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]
