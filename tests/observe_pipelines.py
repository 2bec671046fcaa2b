"""Pipelines for the observability tests, importable by workers and by ``replay --pipeline``."""

from __future__ import annotations

import os
import time
from typing import Any

import energy_loader as el
from energy_loader.testing.strategies import AddNoise, MakeSample

LENGTH = 120


def build() -> el.SavableDataset:
    """map -> shuffle buffer -> batch of 3 over a shuffled source; batches logged when asked."""
    source = el.IndexedSource.from_fn(LENGTH, MakeSample(), shuffle=True, seed=11)
    batched = el.BatchDataset(
        el.ShuffleBufferDataset(el.MapDataset(source, AddNoise()), size=8), batch_size=3
    )
    log_dir = os.environ.get("ENERGY_LOADER_TEST_LOG_DIR")
    return batched if log_dir is None else el.LogSampleDataset(batched, log_dir=log_dir)


def make(index: int) -> dict[str, Any]:
    return {"index": index}


def sleep_20ms(sample: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.02)
    return sample
