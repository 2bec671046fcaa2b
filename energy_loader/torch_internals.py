"""Every place energy_loader reaches into torch's private DataLoader machinery, in one module.

Torch is pinned (constraints.txt); a torch upgrade is checked here. What and why:

- ``DataLoader._iterator``/``._shutdown_workers()``: stop persistent workers (restore, close).
- ``_MultiProcessingDataLoaderIter`` subclassed (``_index_queues``, ``_workers_done_event``,
  pids): prompt shutdown in a reference cycle; ``._workers``: name a dead worker by pid.
- ``._rcvd_idx``, ``._task_info``: tasks in flight, for ``loader.stats()``'s queue depth.
- ``torch._utils.ExceptionWrapper``: re-raise a worker's error as torch does.
- ``_utils.worker._worker_info``: ``get_worker_info()`` reports the user's dataset and, after a
  restore, the logical worker continued (``WorkerInfo`` is frozen: ``object.__setattr__``).
- The base-seed draw (:func:`draw_base_seed`) and ``DistributedSampler``'s permutation
  (:func:`distributed_permutation`), made as torch makes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader
from torch.utils.data import _utils as _data_utils
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

__all__ = [
    "ExceptionWrapper",
    "WorkersDataLoader",
    "distributed_permutation",
    "draw_base_seed",
    "has_iterator",
    "outstanding_tasks",
    "set_worker_info",
    "shut_down_iterator",
    "shut_down_workers_of",
    "worker_iterator",
    "worker_processes",
]


class _CycleSafeIterator(_MultiProcessingDataLoaderIter):
    """torch's worker iterator, whose shutdown also works when collected in a reference cycle:
    the cycle's collection stops the index queues' feeders first, so workers that can no longer
    be reached are terminated at once instead of each joined with torch's 5 s timeout.
    """

    def _shutdown_workers(self) -> None:
        if not getattr(self, "_shutdown", True):
            stranded = [
                worker
                for worker, queue in zip(self._workers, self._index_queues)
                if worker.is_alive() and _cannot_reach(queue)
            ]
            if stranded:
                self._workers_done_event.set()
                # No SIGCHLD error for workers stopped on purpose (torch's own order).
                if self._worker_pids_set:
                    _data_utils.signal_handling._remove_worker_pids(id(self))
                    self._worker_pids_set = False
                for worker in stranded:
                    worker.terminate()
                for worker in stranded:
                    worker.join(timeout=_data_utils.MP_STATUS_CHECK_INTERVAL)
        super()._shutdown_workers()


def _cannot_reach(queue: Any) -> bool:
    """Whether a ``multiprocessing`` queue can no longer send: its collection finalizer has
    told its feeder thread to stop (``_close`` has run), or the feeder has stopped."""
    finalizer, thread = queue._close, queue._thread
    told_to_stop = finalizer is not None and not finalizer.still_active()
    return told_to_stop or (thread is not None and not thread.is_alive())


def worker_iterator(loader: DataLoader[Any]) -> Any:
    """What ``loader._get_iterator()`` returns, with worker processes behind a
    :class:`_CycleSafeIterator`."""
    if loader.num_workers == 0:
        return DataLoader._get_iterator(loader)  # type: ignore[attr-defined]
    loader.check_worker_number_rationality()
    return _CycleSafeIterator(loader)


class WorkersDataLoader(DataLoader):  # type: ignore[type-arg]
    """A plain torch ``DataLoader`` whose worker iterator shuts down promptly even when it is
    collected in a reference cycle (:class:`_CycleSafeIterator`)."""

    def _get_iterator(self) -> Any:
        return worker_iterator(self)


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


def draw_base_seed(loader: DataLoader[Any]) -> int:
    """The draw torch's ``_BaseDataLoaderIter.__init__`` makes for its workers' base seed
    (torch 2.x), from the loader's ``generator`` or the global torch generator."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())


def distributed_permutation(length: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The order ``torch.utils.data.DistributedSampler`` deals an epoch from, before padding:
    its ``__iter__`` computes exactly this (torch 2.x)."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        return torch.randperm(length, generator=generator).tolist()
    return list(range(length))
