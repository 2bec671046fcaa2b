"""Shared fixtures: one torch thread, loaders whose workers are stopped after each test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def stop_workers(loader: Any) -> None:
    """Stop a loader's workers now. A loader with live workers that is freed by the cyclic
    garbage collector (Accelerator and Trainer hold it in reference cycles) waits ~5 s per
    worker for them; the loader has no public close() yet."""
    loader._shutdown_workers()
