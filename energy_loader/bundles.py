"""Several items a transfer: fewer trips through torch's queues, same order, same positions.

Torch moves one item per task: the main process sends an index down a worker's index queue,
the worker makes the item and puts it on the result queue, a feeder thread pickles it and
writes a pipe, and the main process polls, reads and unpickles it. That is 100-200 us of CPU
an item on a busy machine, whatever the item costs to make: for cheap items (a batch of
Parquet rows, a few tokenised lines) it is most of the work. So a worker sends its items in
*bundles*, and the main process hands them out one at a time.

Worker end (:func:`bundle_items`): a bundle is closed when it holds ``limit`` items, its
payloads reach :data:`BUNDLE_BYTES` (an eighth of the worker's shared-memory arena if that is
less, so the bundles in flight never crowd the arena), making it has taken
:data:`BUNDLE_SECONDS`, or the worker ends its epoch. ``limit`` starts at 1 each epoch and
doubles with every bundle up to ``items_per_transfer`` (the first item is not held back to
fill a bundle), and the main process may lower it (below). An item that costs more than
:data:`BUNDLE_SECONDS` to make travels alone, as torch would send it. An exception in the
pipeline closes the bundle with a failure item in its place, so the items made before it are
delivered first and the error is raised exactly where torch would raise it.

Main end (:class:`Unbundler`): items leave in the workers' round-robin order (the logical
worker due next, skipping workers that ended their epoch), never in arrival order: bundle
sizes depend on timing, the order of items must not. Every item is handed out in the order
and with the position bookkeeping it would have had one per transfer, so states, restores
and ``held_back`` saves are unchanged. A worker whose bundles run ahead of the others (its
items are cheaper, so its bundles are fuller) would pile up in the main process; when one
worker has more than ``2 * items_per_transfer`` items waiting there, its limit drops to one
item a bundle until they are handed out (a shared array each worker reads per bundle).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper

from .metrics import clock
from .transport import Packet

__all__ = [
    "BUNDLE_BYTES",
    "BUNDLE_SECONDS",
    "DEFAULT_ITEMS_PER_TRANSFER",
    "FAILED_SLOT",
    "Unbundler",
    "bundle_bytes",
    "bundle_items",
    "payload_bytes",
]

# The loader's default ``items_per_transfer`` (the reference workload and the Parquet reader,
# docs/benchmarks.md, gain as much at 8 as at 16).
DEFAULT_ITEMS_PER_TRANSFER = 16
# A bundle is closed once its payloads reach this many bytes. Above ~1 MB an item's bytes
# cost more to move than the trip, and larger bundles only add to what is in flight (a worker
# has prefetch_factor bundles queued and the main process up to two waiting): at 8 MiB, two
# 4.8 MB batches a trip took the large-tensor benchmark's memory from 1.01x to 1.06x.
BUNDLE_BYTES = 1024 * 1024
# ... or once making it took this long: torch's ~0.2 ms a transfer is then at most 2%.
BUNDLE_SECONDS = 0.01
# The slot of a failure item: its sample is the ExceptionWrapper of the pipeline's error.
FAILED_SLOT = -2


def payload_bytes(sample: Any, depth: int = 2) -> int:
    """The bytes an item moves: a transport packet's payload, or (with torch's transport) its
    tensors', arrays' and byte strings' sizes, looking two containers deep (a long list by
    its first eight elements); 0 if unknown. A budget, not an account."""
    if isinstance(sample, Packet):
        return sample.nbytes
    if isinstance(sample, (torch.Tensor, np.ndarray)):
        return int(sample.nbytes)
    if isinstance(sample, (bytes, bytearray)):
        return len(sample)
    if depth and isinstance(sample, dict):
        return sum(payload_bytes(value, depth - 1) for value in sample.values())
    if depth and isinstance(sample, (list, tuple)):
        head = sum(payload_bytes(value, depth - 1) for value in sample[:8])
        return head if len(sample) <= 8 else head * len(sample) // 8
    return 0


def bundle_bytes(arena_bytes: int | None) -> int:
    """The payload bytes that close a bundle, for a worker with an arena of ``arena_bytes``."""
    return BUNDLE_BYTES if not arena_bytes else min(BUNDLE_BYTES, arena_bytes // 8)


def bundle_items(
    items: Iterator[Any],
    limits: Any,
    logical: int,
    physical: int,
    items_per_transfer: int,
    max_bytes: int = BUNDLE_BYTES,
) -> Iterator[tuple[Any, ...]]:
    """Group a worker's numbered items (``WorkerItem`` tuples) into bundles.

    ``limits[logical]`` is the main process's current cap for this worker (see the module
    docstring); ``physical`` names the worker in a failure's message, as torch does;
    ``max_bytes`` closes a bundle (:func:`bundle_bytes`).
    """
    bundle: list[Any] = []
    limit = 1
    nbytes = 0
    began = clock()
    while True:
        try:
            item = next(items, None)
        except Exception:
            failure = ExceptionWrapper(where=f"in DataLoader worker process {physical}")
            bundle.append((logical, -1, False, failure, FAILED_SLOT, None))
            yield tuple(bundle)
            return
        if item is None:
            if bundle:
                yield tuple(bundle)
            return
        bundle.append(item)
        nbytes += payload_bytes(item[3])
        if (
            item[2]
            or len(bundle) >= min(limit, limits[logical])
            or nbytes >= max_bytes
            or clock() - began >= BUNDLE_SECONDS
        ):
            yield tuple(bundle)
            bundle = []
            nbytes = 0
            limit = min(2 * limit, items_per_transfer)
            began = clock()  # the generator was idle while torch held it


class Unbundler:
    """The main end: hands out bundled items one at a time in round-robin order.

    ``bundles`` is torch's iterator over the workers' bundles; ``limits`` the shared array the
    workers read their bundle cap from. Not thread-safe: the iterating thread only.
    """

    def __init__(self, bundles: Iterator[Any], limits: Any, items_per_transfer: int) -> None:
        self._bundles = bundles
        self._limits = limits
        self._items_per_transfer = items_per_transfer
        self._waiting: list[collections.deque[Any]] = [
            collections.deque() for _ in range(len(limits))
        ]

    def next_item(self, expected: int, done: Sequence[bool]) -> Any:
        """The next item of logical worker ``expected`` (or the next one due after it that
        has not ended its epoch). Raises StopIteration when every worker is exhausted, and a
        failure item's exception when its turn comes."""
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
            worker = bundle[0][0]
            waiting[worker].extend(bundle)
            self._regulate(worker)
        item = waiting[due].popleft()
        self._regulate(due)
        if item[4] == FAILED_SLOT:
            item[3].reraise()
        return item

    def _regulate(self, worker: int) -> None:
        """One item a bundle for a worker whose items pile up here; back to the full size
        once they are handed out."""
        most = self._items_per_transfer
        waiting = len(self._waiting[worker])
        limit = 1 if waiting > 2 * most else most if waiting <= most else None
        if limit is not None and self._limits[worker] != limit:
            self._limits[worker] = limit
