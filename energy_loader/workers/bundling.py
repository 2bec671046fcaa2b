"""Several items a transfer: fewer trips through torch's queues, same order, same positions.

Torch moves one item per task, 100-200 us of CPU on a busy machine whatever the item costs:
for cheap items most of the work. So a worker sends its items in *bundles*
(:func:`bundle_items`), closed at ``limit`` items (from 1 each epoch, doubling up to
``items_per_transfer``; the main process may lower it), :data:`BUNDLE_BYTES` of payload,
:data:`BUNDLE_SECONDS` of making, or the epoch's end; an item slower than that travels alone,
and an exception closes the bundle after the items made before it. The main process
(:mod:`energy_loader.loader.unbundler`) hands them out in the workers' round-robin order with
the bookkeeping each would have had alone, so states and restores are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..metrics import clock
from ..torch_internals import ExceptionWrapper
from ..transport import Packet
from .protocol import FAILED_SLOT, WorkerItem

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
) -> Iterator[tuple[WorkerItem, ...]]:
    """Group a worker's numbered items (``WorkerItem``) into bundles, capped by ``limits[logical]``
    and ``max_bytes``; ``physical`` names the worker in failures."""
    bundle: list[Any] = []
    limit = 1
    nbytes = 0
    began = clock()
    while True:
        try:
            item = next(items, None)
        except Exception:
            failure = ExceptionWrapper(where=f"in DataLoader worker process {physical}")
            bundle.append(WorkerItem(logical, -1, False, failure, FAILED_SLOT, None))
            yield tuple(bundle)
            return
        if item is None:
            if bundle:
                yield tuple(bundle)
            return
        bundle.append(item)
        nbytes += payload_bytes(item.sample)
        if (
            item.is_end
            or len(bundle) >= min(limit, limits[logical])
            or nbytes >= max_bytes
            or clock() - began >= BUNDLE_SECONDS
        ):
            yield tuple(bundle)
            bundle = []
            nbytes = 0
            limit = min(2 * limit, items_per_transfer)
            began = clock()  # the generator was idle while torch held it
