"""The benchmark workloads, and the plain (stateless) pipeline every ratio is relative to.

A workload is source -> map -> shuffle buffer of ``buffer`` -> batch of :data:`BATCH`, run by
:data:`WORKERS` workers with a prefetch of :data:`PREFETCH`. Every contender of the bench builds
this same pipeline in its own library's terms; a batch is always a dict whose ``"index"`` is the
list (or tensor) of the source indices it holds, which is what throughput counts and the
exact-resume checks compare.

- ``reference`` (the documented reference workload): 64 int64 tokens per sample -> a
  tokenizer-like map -> shuffle buffer of 1000 -> batch of 32;
- ``large``: a 3 x 224 x 224 uint8 image per sample -> a horizontal flip -> shuffle buffer of
  64 -> batch of 32 (4.8 MB per batch).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import IterableDataset, get_worker_info

__all__ = [
    "BATCH",
    "PREFETCH",
    "SAVE_EVERY",
    "WORKERS",
    "WORKLOADS",
    "PlainPipeline",
    "ShuffleProgress",
    "Workload",
    "collate",
    "epoch_order",
    "savable_pipeline",
    "shuffle_stream",
]

TOKENS = 64
VOCAB = 50257
BATCH = 32
WORKERS = 2
PREFETCH = 2
SAVE_EVERY = 50
IMAGE_SHAPE = (3, 224, 224)


def make_sample(index: int) -> dict[str, Any]:
    return {"index": index, "tokens": torch.arange(TOKENS, dtype=torch.int64) + index}


def tokenize(sample: dict[str, Any]) -> dict[str, Any]:
    return {"index": sample["index"], "tokens": (sample["tokens"] * 7) % VOCAB}


def make_image(index: int) -> dict[str, Any]:
    row = torch.arange(IMAGE_SHAPE[-1], dtype=torch.int32).add_(index).to(torch.uint8)
    return {"index": index, "image": row.expand(IMAGE_SHAPE).contiguous()}


def flip(sample: dict[str, Any]) -> dict[str, Any]:
    return {"index": sample["index"], "image": sample["image"].flip(-1)}


@attrs.frozen
class Workload:
    """One benchmark pipeline: how a sample is made and transformed, and the buffer size."""

    name: str
    samples: int
    make: Callable[[int], dict[str, Any]]
    transform: Callable[[dict[str, Any]], dict[str, Any]]
    buffer: int
    # Whether the plain pipeline batches itself (indices stay a list: one tensor crosses per
    # batch) or leaves it to the DataLoader (whose collate writes into shared memory).
    plain_batches_itself: bool

    def sample(self, index: int) -> dict[str, Any]:
        """Sample ``index``, made and transformed: what a shuffle buffer holds."""
        return self.transform(self.make(index))


WORKLOADS = {
    "reference": Workload("reference", 60_000, make_sample, tokenize, 1000, True),
    "large": Workload("large", 6_400, make_image, flip, 64, False),
}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch: the indices as a list, every other field stacked into one tensor."""
    batch: dict[str, Any] = {"index": [s["index"] for s in samples]}
    for field in samples[0]:
        if field != "index":
            batch[field] = torch.stack([s[field] for s in samples])
    return batch


def epoch_order(samples: int, seed: int, epoch: int) -> list[int]:
    """The source order of one epoch, shuffled by (seed, epoch), before sharding."""
    order = list(range(samples))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


@attrs.define
class ShuffleProgress:
    """Where one worker's pass over its shard stands (what a stateful version would save)."""

    epoch: int
    consumed: int
    buffer: list[dict[str, Any]]
    rng: random.Random
    # None while the shard streams through the buffer; then how many of the shuffled
    # remainder were yielded.
    drained: int | None = None


def shuffle_stream(
    workload: Workload, progress: ShuffleProgress, indices: list[int]
) -> Iterator[dict[str, Any]]:
    """Samples made, transformed and passed through a shuffle buffer, from ``progress`` on.

    ``progress`` is kept current at every yield, so it can be read between samples.
    """
    size, buffer, rng = workload.buffer, progress.buffer, progress.rng
    if progress.drained is None:
        while progress.consumed < len(indices):
            sample = workload.sample(indices[progress.consumed])
            progress.consumed += 1
            if len(buffer) < size:
                buffer.append(sample)
                continue
            slot = rng.randrange(size)
            buffer[slot], sample = sample, buffer[slot]
            yield sample
        rng.shuffle(buffer)
        progress.drained = 0
    while progress.drained < len(buffer):
        progress.drained += 1
        yield buffer[progress.drained - 1]


class PlainPipeline(IterableDataset):
    """The same work as the savable pipeline, written as a user would without any state."""

    def __init__(self, samples: int, seed: int = 0, workload: str = "reference") -> None:
        self.samples, self.seed, self.epoch = samples, seed, 0
        self.workload = WORKLOADS[workload]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        progress = self.start(worker)
        self.epoch = progress.epoch + 1
        indices = epoch_order(self.samples, self.seed, progress.epoch)[worker::workers]
        samples = shuffle_stream(self.workload, progress, indices)
        if not self.workload.plain_batches_itself:
            yield from samples
            return
        batch: list[dict[str, Any]] = []
        for sample in samples:
            batch.append(sample)
            if len(batch) == BATCH:
                ready, batch = collate(batch), []
                yield ready
        if batch:
            yield collate(batch)

    def start(self, worker: int) -> ShuffleProgress:
        """Where ``worker``'s pass over this epoch begins: here always at its start (the plain
        pipeline never resumes); a stateful version overrides it to resume from its state."""
        return ShuffleProgress(self.epoch, 0, [], random.Random(worker))


def savable_pipeline(
    samples: int, seed: int = 0, workload: str = "reference", *, seed_per_sample: bool = True
) -> Any:
    """The workload as an energy_loader pipeline."""
    from ...sources import IndexedSource
    from ...wrappers import BatchDataset, MapDataset, ShuffleBufferDataset

    spec = WORKLOADS[workload]
    source = IndexedSource.from_fn(samples, spec.make, shuffle=True, seed=seed)
    mapped = MapDataset(source, spec.transform, seed_per_sample=seed_per_sample)
    return BatchDataset(ShuffleBufferDataset(mapped, spec.buffer), BATCH)
