"""GcDataset: deterministic garbage collection in the process that runs the pipeline.

``gc.freeze()`` at start, ``gc.collect()`` every ``every_n_iter`` samples: no random long
pauses, no copy-on-write pages un-shared in forked workers (docs/wrappers.md, "GcDataset").
State: none (passes the inner state through).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

from ..dataset import BaseWrapperDataset, Key, SavableDataset
from ..validation import require_bool, require_int

__all__ = ["GcDataset"]

_FROZEN_PIDS: set[int] = set()


class GcDataset(BaseWrapperDataset):
    """Collect garbage every ``every_n_iter`` samples; ``gc.freeze()`` once per process.
    Example::

        GcDataset(BatchDataset(source, 32), every_n_iter=64)
    """

    passes_state_through = True

    def __init__(
        self, dataset: SavableDataset, *, every_n_iter: int = 64, freeze: bool = True
    ) -> None:
        super().__init__(dataset)
        self.every_n_iter = require_int(every_n_iter, "every_n_iter", minimum=1)
        require_bool(freeze, "freeze")
        self.freeze = freeze

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        if self.freeze and os.getpid() not in _FROZEN_PIDS:
            gc.freeze()
            _FROZEN_PIDS.add(os.getpid())
        every, count = self.every_n_iter, 0
        for pair in self.dataset.iter_keyed():
            count += 1
            if count % every == 0:
                gc.collect()
            yield pair

    def _config_fields(self) -> dict[str, Any]:
        return {"every_n_iter": self.every_n_iter, "freeze": self.freeze}

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]
