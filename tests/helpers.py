"""Small pipelines shared by the tests (module-level, so spawn can import them)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import energy_loader as el
from energy_loader.testing.strategies import AddNoise, MakeSample


def make_sample(index: int) -> dict[str, Any]:
    return {"index": index, "x": torch.tensor([index])}


def noisy(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "noise": random.random()}


def reference_pipeline(length: int = 200, buffer: int = 16, batch: int = 4) -> el.SavableDataset:
    """map -> shuffle buffer -> batch over a shuffled IndexedSource (the reference shape, small)."""
    source = el.IndexedSource.from_fn(length, MakeSample(), shuffle=True, seed=7)
    return el.BatchDataset(
        el.ShuffleBufferDataset(el.MapDataset(source, AddNoise()), size=buffer), batch_size=batch
    )


def indices(batch_or_sample: Any) -> list[int]:
    """The source indices in a sample or a batch."""
    value = batch_or_sample["index"]
    if isinstance(value, torch.Tensor):  # a batch collated by default_collate
        value = value.tolist()
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


ROOT = Path(__file__).resolve().parents[1]


def run_command(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m energy_loader ARGS`` from the repository root (the tests importable), with
    extra environment variables; two minutes at most."""
    return subprocess.run(
        [sys.executable, "-m", "energy_loader", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )
