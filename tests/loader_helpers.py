"""Module-level functions for loader tests (importable by spawned workers)."""

from __future__ import annotations

import os
import time
from typing import Any

import energy_loader as el


def slow_sample(index: int) -> dict[str, Any]:
    time.sleep(0.1)
    return {"index": index}


def fail_at_seven(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["index"] == 7:
        raise ValueError("sample 7 is cursed")
    return sample


def where_am_i(sample: dict[str, Any]) -> dict[str, Any]:
    worker = el.current_worker()
    return {**sample, "worker": worker.worker_id, "pid": os.getpid()}


class CountReads:
    """Counts source reads across worker processes in a shared multiprocessing value."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter

    def __call__(self, index: int) -> dict[str, Any]:
        with self.counter.get_lock():
            self.counter.value += 1
        return {"index": index}
