"""Every use of torch's private DataLoader internals by the drop-in loader, in one place.

torch is pinned (constraints.txt), and each use below is small; they live here so that a torch
upgrade has one module to check. Why each is needed:

- :func:`shutdown_iterator`: a torch iterator's workers stop when it is garbage collected;
  the drop-in stops them when the iterator is replaced or the loader closed, so no worker
  outlives what the user asked for (``_MultiProcessingDataLoaderIter._shutdown_workers``).
- :func:`set_worker_info`: torch's :func:`~torch.utils.data.get_worker_info` inside a worker
  reports the dataset torch was given, which for the drop-in is its fetch wrapper. Users
  configure *their* dataset through it (``get_worker_info().dataset``), and an iterable
  dataset shards by ``get_worker_info().id``, which after a restore must name the logical
  worker whose stream the process now continues. ``WorkerInfo`` refuses attribute changes
  after construction, so its fields are replaced with ``object.__setattr__``.
- :data:`ExceptionWrapper`: a failure inside a worker travels to the main process the way torch
  sends it, so it is re-raised there with torch's message and the original type.
"""

from __future__ import annotations

from typing import Any

from torch._utils import ExceptionWrapper
from torch.utils.data import _utils as _data_utils

__all__ = ["ExceptionWrapper", "set_worker_info", "shutdown_iterator"]


def shutdown_iterator(iterator: Any) -> None:
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
