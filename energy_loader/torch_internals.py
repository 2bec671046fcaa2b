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
- ``torch.utils.data._utils.worker._worker_info``: inside a worker, ``get_worker_info()``
  reports the dataset torch was given, which for a drop-in loader is its fetch wrapper. Users
  configure *their* dataset through it (``get_worker_info().dataset``), and an iterable
  dataset shards by ``get_worker_info().id``, which after a restore must name the logical
  worker whose stream the process now continues. ``WorkerInfo`` refuses attribute changes
  after construction, so its fields are replaced with ``object.__setattr__``.
- ``DistributedSampler.__iter__``'s permutation (``randperm`` of a generator seeded with
  ``seed + epoch``, or ``range``): the drop-in loader deals the rest of an epoch to another
  number of ranks from the same permutation (:func:`distributed_permutation`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader
from torch.utils.data import _utils as _data_utils

__all__ = [
    "ExceptionWrapper",
    "distributed_permutation",
    "has_iterator",
    "outstanding_tasks",
    "set_worker_info",
    "shut_down_iterator",
    "shut_down_workers_of",
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


def shut_down_workers_of(iterator: Any) -> None:
    """Stop a torch DataLoader iterator's worker processes now (no-op without workers)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def set_worker_info(**fields: Any) -> None:
    """Replace fields (``dataset``, ``id``, ``num_workers``, ``seed``) of this worker's
    ``get_worker_info()``; does nothing outside a worker process."""
    info = _data_utils.worker._worker_info
    if info is None:
        return
    for name, value in fields.items():
        object.__setattr__(info, name, value)


def distributed_permutation(length: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The order ``torch.utils.data.DistributedSampler`` deals an epoch from, before padding:
    its ``__iter__`` computes exactly this (torch 2.x)."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        return torch.randperm(length, generator=generator).tolist()
    return list(range(length))
