"""Every place energy_loader reaches into torch's private DataLoader machinery, in one module.

Torch is pinned (constraints.txt), and each of these is a documented-by-reading, stable-for-
years detail of ``torch/utils/data/dataloader.py``; keeping them here means a torch upgrade is
checked in one file. What and why:

- ``DataLoader._iterator``: the persistent iterator torch keeps when ``persistent_workers``;
  the loader shuts its workers down on restore, failure and close.
- ``_MultiProcessingDataLoaderIter._shutdown_workers()``: torch's own orderly shutdown.
- ``._workers``: the worker processes, to name a dead worker by pid and to see whether one
  is alive while waiting for a reply.
- ``._rcvd_idx`` and ``._task_info``: tasks sent to a worker and not yet received, for the
  queue depth in ``loader.stats()``.
- ``torch._utils.ExceptionWrapper``: a worker's exception with its traceback, re-raised in the
  main process exactly as torch re-raises its own workers' errors.
"""

from __future__ import annotations

from typing import Any

from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader

__all__ = [
    "ExceptionWrapper",
    "has_iterator",
    "outstanding_tasks",
    "shut_down_iterator",
    "worker_processes",
]


def has_iterator(loader: DataLoader[Any]) -> bool:
    """Whether torch holds a (persistent) iterator, and so live workers, for ``loader``."""
    return loader._iterator is not None  # type: ignore[attr-defined]


def shut_down_iterator(loader: DataLoader[Any]) -> None:
    """Stop the workers of ``loader``'s persistent iterator (if any) and forget it."""
    iterator = loader._iterator  # type: ignore[attr-defined]
    if iterator is not None:
        iterator._shutdown_workers()  # type: ignore[attr-defined]
        loader._iterator = None  # type: ignore[attr-defined]


def worker_processes(loader: DataLoader[Any]) -> list[Any]:
    """The worker processes of ``loader``'s iterator, by physical worker id ([] if none)."""
    iterator = loader._iterator  # type: ignore[attr-defined]
    return list(getattr(iterator, "_workers", [])) if iterator is not None else []


def outstanding_tasks(loader: DataLoader[Any]) -> list[int]:
    """The physical worker of every task sent out and not yet received, in task order."""
    iterator = loader._iterator  # type: ignore[attr-defined]
    if iterator is None:
        return []
    received = getattr(iterator, "_rcvd_idx", 0)
    return [
        info[0]
        for task, info in list(getattr(iterator, "_task_info", {}).items())
        if task >= received and info
    ]
