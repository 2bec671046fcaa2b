"""Rank programs for the drop-in over a Hugging Face stream on real gloo ranks (launched by
tests/distributed_helpers.py's ``launch``; module-level so spawned ranks import them)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node

import energy_loader as el

ROWS = 300


def _stream() -> datasets.IterableDataset:
    return datasets.Dataset.from_dict({"id": list(range(ROWS))}).to_iterable_dataset(num_shards=4)


def split_or_refused(rank: int, world_size: int, workdir: Path) -> None:
    """An unsplit stream and one split for another rank are refused at construction; a split
    stream trains in step (an all_reduce a batch) over this rank's rows, 2 workers."""
    refused = []
    for stream in (_stream(), split_dataset_by_node(_stream(), rank=0, world_size=world_size)):
        if rank == 0 and stream._distributed is not None:
            continue  # split for rank 0: this rank's own split
        try:
            el.SavableDataLoader(stream, batch_size=2, num_workers=2)
        except ValueError as error:
            refused.append(str(error))
    stream = split_dataset_by_node(_stream(), rank=rank, world_size=world_size)
    loader = el.SavableDataLoader(
        stream, batch_size=2, num_workers=2, multiprocessing_context="fork"
    )
    ids = []
    for batch in loader:
        ids += [int(i) for i in batch["id"]]
        dist.all_reduce(torch.ones(1))  # a training step's collective: ranks stay in step
    loader.close()
    (workdir / f"rank{rank}.json").write_text(json.dumps({"refused": refused, "ids": ids}))
