"""The loaders whose saved states make the committed corpus (``v1/``), built the same way by
the script that wrote it (``make_corpus.py``) and by the test that restores it
(``tests/test_state_corpus.py``).

Keep these functions as they are: the states in ``v1/`` record their pipelines' configs and
their functions' code, and a restore compares both. A new setup goes with new files.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, RandomSampler

import energy_loader as el

# The position of every save: batches taken before it, and batches compared after it.
TAKEN = 5
COMPARED = 8
NUM_PARTITIONS = 4


def make_sample(index: int) -> dict[str, Any]:
    return {"index": index, "value": torch.tensor([float(index)])}


def add_noise(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "noise": random.random()}  # seeded per sample by the map


def keep(sample: dict[str, Any]) -> bool:
    return sample["index"] % 7 != 3


def pipeline(rank: int = 0, world_size: int = 1, workers: int = 0) -> el.SavableDataLoader:
    """source -> map (draws per sample) -> filter -> shuffle buffer -> batch, 4 partitions."""
    source = el.IndexedSource.from_fn(240, make_sample, shuffle=True, seed=11)
    stages = el.ShuffleBufferDataset(
        el.FilterDataset(el.MapDataset(source, add_noise), keep), size=8
    )
    config = el.WorkerConfig(rank=rank, world_size=world_size, num_workers=workers, seed=5)
    return el.SavableDataLoader(
        el.BatchDataset(stages, batch_size=4), worker_config=config, num_partitions=NUM_PARTITIONS
    )


class Indexed(Dataset):
    """A plain map-style dataset: ``{"index": i, "noise": <a draw from torch's generator>}``."""

    def __len__(self) -> int:
        return 90

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "noise": torch.rand(1)}


class Counting(IterableDataset):
    """A plain iterable dataset of 70 items."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        for index in range(worker, 70, workers):
            yield {"index": index}


def dropin_map(rank: int = 0, world_size: int = 1) -> el.SavableDataLoader:
    """A drop-in loader over :class:`Indexed`: a seeded ``RandomSampler`` on one rank, a
    ``DistributedSampler`` on several."""
    dataset = Indexed()
    config = el.WorkerConfig(rank=rank, world_size=world_size)
    if world_size == 1:
        generator = torch.Generator().manual_seed(3)
        sampler: Any = RandomSampler(dataset, generator=generator)
        return el.SavableDataLoader(
            dataset, batch_size=3, sampler=sampler, worker_config=config, generator=generator
        )
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=9)
    return el.SavableDataLoader(dataset, batch_size=3, sampler=sampler, worker_config=config)


def dropin_iterable() -> el.SavableDataLoader:
    """A drop-in loader over :class:`Counting`, batches of 4."""
    return el.SavableDataLoader(Counting(), batch_size=4, worker_config=el.WorkerConfig())


def keys(batch: Any) -> list[int]:
    """The indices in a batch (a pipeline's list of samples, or a collated dict)."""
    if isinstance(batch, list):
        return [int(sample["index"]) for sample in batch]
    return [int(i) for i in batch["index"]]


def take(iterator: Any, count: int) -> list[list[int]]:
    return [keys(next(iterator)) for _ in range(count)]


def blend_pipeline(weights: tuple[float, ...], workers: int = 2, **options: Any) -> Any:
    """Two sources of 120 blended by ``weights`` -> batch, 4 partitions (steered states)."""
    sources = [
        el.IndexedSource.from_fn(120, make_sample, shuffle=True, seed=seed) for seed in (1, 2)
    ]
    blend = el.BlendDataset(*zip(sources, weights), on_exhausted="drop")
    config = el.WorkerConfig(num_workers=workers, seed=5)
    return el.SavableDataLoader(
        el.BatchDataset(blend, batch_size=4),
        worker_config=config,
        num_partitions=NUM_PARTITIONS,
        **options,
    )


def steered() -> tuple[el.SavableDataLoader, Any]:
    """A run that skips and changes on purpose, and its iterator where the state is saved:
    ``TAKEN`` batches at weights 1:1, a skip of 2, a restore into weights 3:1 (declared), a
    skip of 1 (one worker's item: the other's partitions still hold their pending change)."""
    loader = blend_pipeline((1.0, 1.0))
    iterator = iter(loader)
    take(iterator, TAKEN)
    loader.skip(2)
    state = loader.state_dict()
    loader.close()
    loader = blend_pipeline((3.0, 1.0), changes=["BlendDataset.weights"])
    loader.load_state_dict(state)
    loader.skip(1)
    return loader, iter(loader)


def dropin_skipped() -> tuple[el.SavableDataLoader, Any]:
    """The map-style drop-in after ``TAKEN`` batches and a skip of 2."""
    loader = dropin_map()
    iterator = iter(loader)
    take(iterator, TAKEN)
    loader.skip(2)
    return loader, iterator
