"""Helpers shared by the tests of the strided sources (sharded, WebDataset, Parquet)."""

from __future__ import annotations

from typing import Any

from energy_loader.dataset import SavableDataset
from energy_loader.worker import WorkerContext


def keys_of(source: SavableDataset, context: WorkerContext | None = None) -> list[Any]:
    """The keys of one epoch of ``source`` (epoch 0), read as the given reader."""
    source.bind(context or WorkerContext())
    source.reset_state()
    return [key for key, _ in source.iter_keyed()]


def assert_readers_interleave(
    source: SavableDataset, expected: list[Any], layouts: list[tuple[int, int]]
) -> None:
    """For each ``(ranks, workers)``, the readers' keys interleaved give ``expected``."""
    for ranks, workers in layouts:
        readers = ranks * workers
        merged: list[Any] = [None] * len(expected)
        for rank in range(ranks):
            for worker in range(workers):
                reader = rank * workers + worker
                context = WorkerContext(partition=reader, num_partitions=readers)
                merged[reader::readers] = keys_of(source, context)
        assert merged == expected, (ranks, workers)
