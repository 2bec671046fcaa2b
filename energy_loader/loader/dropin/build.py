"""Which drop-in engine runs a plain dataset, and the checks of the options it takes.

:func:`dropin_engine` is called by :class:`~energy_loader.SavableDataLoader` after torch's own
``DataLoader.__init__`` validated torch's arguments and set every attribute frameworks read:
a map-style dataset runs on a :class:`~.map_style.MapEngine`, an iterable one on an
:class:`~.iterable.IterableEngine`. :func:`runs_dropin` tells such a loader (integrations,
``replay``), from its engine alone.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from ...transport import Transport, validate_transport_settings
from ...validation import require_bool, require_int
from ...worker import WorkerConfig
from .iterable import IterableEngine
from .map_style import MapEngine


def runs_dropin(loader: Any) -> bool:
    """Whether ``loader`` is a :class:`~energy_loader.SavableDataLoader` over a plain dataset
    (a drop-in engine runs it), not over a savable pipeline nor a loader of another library."""
    return isinstance(getattr(loader, "engine", None), (MapEngine, IterableEngine))


def dropin_engine(
    loader: DataLoader[Any],
    *,
    worker_config: Any,
    num_partitions: Any,
    seed_per_sample: Any,
    verify_restore: Any,
    on_code_change: str,
    **options: Any,
) -> MapEngine | IterableEngine:
    """The engine for ``loader``'s plain dataset (``loader`` initialised by torch already);
    ``options``: the loader's own keyword options."""
    require_bool(seed_per_sample, "seed_per_sample")
    require_bool(verify_restore, "verify_restore")
    items_per_transfer = options["items_per_transfer"]
    require_int(items_per_transfer, "items_per_transfer", minimum=1)
    codec = options["transport_codec"]
    inline, arena = options["transport_inline_bytes"], options["transport_arena_bytes"]
    validate_transport_settings(codec, inline, arena)
    num_workers = loader.num_workers
    config = _resolve_worker_config(worker_config, num_workers)
    if num_partitions not in (None, max(1, num_workers) * config.world_size):
        raise ValueError(
            "`num_partitions` needs a savable pipeline (elastic resume across layouts); a "
            "drop-in loader over a plain dataset runs one partition per worker: leave "
            "num_partitions=None"
        )
    if isinstance(loader.dataset, IterableDataset):
        return IterableEngine(
            loader,
            config,
            seed_per_sample=seed_per_sample,
            verify_restore=verify_restore,
            on_code_change=on_code_change,
            **options,
        )
    return MapEngine(
        loader,
        config,
        seed_per_sample=seed_per_sample,
        items_per_transfer=items_per_transfer,
        transport=Transport(inline, arena) if codec and num_workers else None,
        verify_restore=verify_restore,
        on_code_change=on_code_change,
    )


def _resolve_worker_config(worker_config: Any, num_workers: int) -> WorkerConfig:
    if worker_config is None:
        return WorkerConfig.from_env(num_workers=num_workers)
    if not isinstance(worker_config, WorkerConfig):
        raise TypeError(
            f"`worker_config` must be a WorkerConfig (got {type(worker_config).__name__})"
        )
    if num_workers != worker_config.num_workers:
        raise ValueError(
            f"num_workers={num_workers} disagrees with worker_config.num_workers="
            f"{worker_config.num_workers}; pass the same number to both"
        )
    return worker_config
