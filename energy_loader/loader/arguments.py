"""The loader's constructor arguments: checks with the fix in the message, and what they
resolve to (the rank/worker layout, partitions, checkpoint settings, transport, start method).

:func:`resolve_arguments` is the one place a :class:`~energy_loader.SavableDataLoader` over a
pipeline turns its keyword options into a :class:`LoaderArguments`."""

from __future__ import annotations

import math
import multiprocessing
from typing import Any

import attrs
import dill

from ..dataset import SavableDataset
from ..metrics import StallPolicy, resolve_stall_policy
from ..transport import Transport, validate_transport_settings
from ..validation import require_bool, require_int
from ..worker import WorkerConfig
from ..workers.protocol import CheckpointSettings
from .partitions import resolve_num_partitions
from .progress import MAX_HELD_BACK


def resolve_worker_config(
    dataset: Any, worker_config: WorkerConfig | None, num_workers: Any
) -> WorkerConfig:
    """The loader's layout: ``worker_config``, or one built from the environment."""
    if not isinstance(dataset, SavableDataset):
        raise TypeError(
            "the loader runs a SavableDataset pipeline (e.g. IndexedSource(...) wrapped in "
            f"MapDataset/BatchDataset); got {type(dataset).__name__}"
        )
    if worker_config is None:
        return WorkerConfig.from_env(num_workers=require_int(num_workers, "num_workers", minimum=0))
    if not isinstance(worker_config, WorkerConfig):
        raise TypeError(
            f"`worker_config` must be a WorkerConfig (got {type(worker_config).__name__})"
        )
    if num_workers not in (0, worker_config.num_workers):
        raise ValueError(
            f"num_workers={num_workers} disagrees with worker_config.num_workers="
            f"{worker_config.num_workers}; pass one of them"
        )
    return worker_config


def require_change_policy(value: Any, name: str, changed: str) -> None:
    """``ValueError`` unless ``value`` says what a restore whose ``changed`` since the save
    does: ``"warn"`` (continue, with a warning naming them) or ``"refuse"``."""
    if value not in ("warn", "refuse"):
        raise ValueError(
            f"`{name}` must be 'warn' (continue a restore whose {changed}, with a warning "
            f"naming them) or 'refuse' (got {value!r})"
        )


def require_seconds(value: Any, name: str) -> float:
    """A positive number of seconds, as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"`{name}` must be a positive number of seconds (got {value!r})")
    return float(value)


def check_serializable(pipeline: SavableDataset) -> None:
    """Fail now, naming the culprit, if spawn/forkserver could not ship the pipeline."""
    try:
        dill.dumps(pipeline, recurse=True)
        return
    except Exception as error:
        whole = error
    for dataset in pipeline.walk():
        for name, value in vars(dataset).items():
            if isinstance(value, SavableDataset) or name.startswith("_cursor"):
                continue
            try:
                dill.dumps(value, recurse=True)
            except Exception as error:
                raise TypeError(
                    f"{type(dataset).__name__}.{name} ({value!r}) cannot be serialized with dill "
                    f"for the spawn/forkserver start method: {error}. Use the fork start method "
                    "or make it serializable"
                ) from error
    raise TypeError(f"the pipeline cannot be serialized with dill: {whole}") from whole


def resolve_mp_context(value: Any) -> Any:
    """A multiprocessing context from a start method name, a context, or ``None``."""
    if value is None:
        return multiprocessing.get_context()
    if isinstance(value, str):
        try:
            return multiprocessing.get_context(value)
        except ValueError:
            raise ValueError(
                f"`multiprocessing_context` must be 'fork', 'spawn' or 'forkserver' (got {value!r})"
            ) from None
    if hasattr(value, "get_start_method"):
        return value
    raise TypeError(
        "`multiprocessing_context` must be a start method name or a multiprocessing context "
        f"(got {type(value).__name__})"
    )


def checkpoint_settings(
    workers: int,
    prefetch_factor: Any,
    every_n: Any,
    every_sec: Any,
    n_checkpoints: Any,
    gc_every_n: Any,
    gc_freeze: Any,
) -> CheckpointSettings:
    """When workers snapshot, and how many snapshots cover the items that may be in flight."""
    if workers:
        require_int(prefetch_factor, "prefetch_factor", minimum=1)
    elif prefetch_factor not in (None, 2):
        raise ValueError("`prefetch_factor` only applies with num_workers > 0")
    require_int(every_n, "checkpoint_every_n_samples", minimum=1)
    if every_sec is not None and (
        isinstance(every_sec, bool) or not isinstance(every_sec, (int, float)) or every_sec <= 0
    ):
        raise ValueError(
            "`checkpoint_every_sec` must be a positive number of seconds or None "
            f"(got {every_sec!r})"
        )
    if gc_every_n is not None:
        require_int(gc_every_n, "gc_collect_every_n_steps", minimum=1)
    require_bool(gc_freeze, "gc_freeze_at_start")
    # Items a worker may have made that the user has not received: torch keeps up to
    # prefetch_factor * num_workers tasks outstanding, all on one worker once the others have
    # ended their epoch; plus one for the pin-memory thread, plus the items a held-back save
    # may reach back.
    in_flight = (prefetch_factor or 0) * workers + 1 + MAX_HELD_BACK
    needed = math.ceil(in_flight / every_n) + 2
    if n_checkpoints is None:
        n_checkpoints = needed
    require_int(n_checkpoints, "n_checkpoints", minimum=1)
    if n_checkpoints < needed:
        raise ValueError(
            f"n_checkpoints={n_checkpoints} cannot cover the {in_flight} items that may be in "
            f"flight per worker (prefetch_factor={prefetch_factor} x num_workers={workers} + 1, "
            f"+ {MAX_HELD_BACK} for held-back saves) "
            f"at checkpoint_every_n_samples={every_n}; use n_checkpoints >= {needed}"
        )
    return CheckpointSettings(
        every_n=every_n,
        every_sec=None if every_sec is None else float(every_sec),
        capacity=n_checkpoints,
        in_flight=in_flight,
        gc_every_n=gc_every_n,
        gc_freeze=gc_freeze,
    )


@attrs.frozen
class LoaderArguments:
    """A pipeline loader's options, checked and resolved."""

    config: WorkerConfig
    num_partitions: int
    settings: CheckpointSettings
    reply_timeout: float
    transport: Transport | None
    mp_context: Any
    stall: StallPolicy | None
    items_per_transfer: int


def resolve_arguments(
    pipeline: SavableDataset,
    *,
    worker_config: WorkerConfig | None,
    num_workers: Any,
    num_partitions: Any,
    prefetch_factor: Any,
    checkpoint_every_n_samples: Any,
    checkpoint_every_sec: Any,
    n_checkpoints: Any,
    gc_collect_every_n_steps: Any,
    gc_freeze_at_start: Any,
    multiprocessing_context: Any,
    worker_reply_timeout: Any,
    transport_codec: Any,
    transport_inline_bytes: Any,
    transport_arena_bytes: Any,
    items_per_transfer: Any,
    stall_warning: Any,
) -> LoaderArguments:
    """Check every option of a loader over ``pipeline`` (``TypeError``/``ValueError`` naming
    the option and what would be right) and resolve them."""
    config = resolve_worker_config(pipeline, worker_config, num_workers)
    workers = config.num_workers
    validate_transport_settings(transport_codec, transport_inline_bytes, transport_arena_bytes)
    mp_context = resolve_mp_context(multiprocessing_context) if workers else None
    if mp_context is not None and mp_context.get_start_method() != "fork":
        check_serializable(pipeline)
    return LoaderArguments(
        config=config,
        num_partitions=resolve_num_partitions(num_partitions, config.world_size, workers),
        settings=checkpoint_settings(
            workers,
            prefetch_factor,
            checkpoint_every_n_samples,
            checkpoint_every_sec,
            n_checkpoints,
            gc_collect_every_n_steps,
            gc_freeze_at_start,
        ),
        reply_timeout=require_seconds(worker_reply_timeout, "worker_reply_timeout"),
        transport=(
            Transport(transport_inline_bytes, transport_arena_bytes)
            if transport_codec and workers
            else None
        ),
        mp_context=mp_context,
        stall=resolve_stall_policy(stall_warning),
        items_per_transfer=require_int(items_per_transfer, "items_per_transfer", minimum=1),
    )
