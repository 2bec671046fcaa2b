"""The main end of bundles: hands out the workers' bundled items one at a time, in order.

Items leave in the workers' round-robin order (the logical worker due next, skipping workers
that ended their epoch), never in arrival order: bundle sizes depend on timing, the order of
items must not. A worker whose bundles run ahead of the others would pile up here; when one
worker has more than ``2 * items_per_transfer`` items waiting, its cap (a shared array the
worker reads per bundle) drops to one item a bundle until they are handed out. The worker end,
and why bundles exist, is :mod:`energy_loader.workers.bundling`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Any

from ..workers.protocol import FAILED_SLOT, WorkerItem


class Unbundler:
    """The main end: hands out bundled items one at a time in round-robin order (``bundles``:
    torch's iterator; ``limits``: the workers' bundle caps). The iterating thread only."""

    def __init__(self, bundles: Iterator[Any], limits: Any, items_per_transfer: int) -> None:
        self._bundles = bundles
        self._limits = limits
        self._items_per_transfer = items_per_transfer
        self._waiting: list[collections.deque[Any]] = [
            collections.deque() for _ in range(len(limits))
        ]

    def next_item(self, expected: int, done: Sequence[bool]) -> WorkerItem:
        """The next item of logical worker ``expected`` (or the next due that has not ended); raises
        StopIteration when all are exhausted, and a failure item's exception in its turn."""
        waiting = self._waiting
        count = len(waiting)
        turns = [(expected + step) % count for step in range(count)]
        due = next((w for w in turns if not done[w]), None)
        while due is None or not waiting[due]:
            try:
                bundle = next(self._bundles)
            except StopIteration:
                # Nothing more will come: whatever still waits goes out in round-robin order.
                due = next((w for w in turns if waiting[w]), None)
                if due is None:
                    raise
                break
            worker = bundle[0].worker
            waiting[worker].extend(bundle)
            self._regulate(worker)
        item = waiting[due].popleft()
        self._regulate(due)
        if item.slot == FAILED_SLOT:
            item.sample.reraise()
        return item

    def _regulate(self, worker: int) -> None:
        """One item a bundle for a worker whose items pile up here; back to the full size
        once they are handed out."""
        most = self._items_per_transfer
        waiting = len(self._waiting[worker])
        limit = 1 if waiting > 2 * most else most if waiting <= most else None
        if limit is not None and self._limits[worker] != limit:
            self._limits[worker] = limit
