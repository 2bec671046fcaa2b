"""torch's DataLoader arguments on a savable pipeline: applied as their savable equivalent, or
refused with the fix.

:class:`~energy_loader.SavableDataLoader` takes torch's DataLoader signature. Given a savable
pipeline, the batching arguments become a :class:`~energy_loader.BatchDataset` on top of it
(``batch_size=32`` is ``pipeline.batch(32, collate_fn=..., drop_last=...)``), the process
arguments (``timeout``, ``worker_init_fn``, ``pin_memory_device``) go to torch as they are,
and what a pipeline does its own way (shuffling, samplers, a generator) is refused, naming the
savable way. A default ``batch_size`` that was not passed must be told apart from
``batch_size=1``: :data:`DEFAULT_BATCH_SIZE` is an ``int`` equal to 1 (so the signature and
``repr`` say 1) of its own type.

This module changes nothing for a pipeline given without torch's arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from ..dataset import SavableDataset
from ..errors import EnergyLoaderError


class _DefaultBatchSize(int):
    """``1``, as torch's default ``batch_size``, but recognisably not passed by the caller."""

    def __repr__(self) -> str:
        return "1"

    def __reduce__(self) -> Any:
        return (_default_batch_size, ())


def _default_batch_size() -> _DefaultBatchSize:
    return DEFAULT_BATCH_SIZE


#: The default of ``batch_size`` in :class:`~energy_loader.SavableDataLoader`'s signature.
DEFAULT_BATCH_SIZE = _DefaultBatchSize(1)


def batch_size_given(batch_size: Any) -> bool:
    """Whether ``batch_size`` was passed by the caller (not left at its default)."""
    return type(batch_size) is not _DefaultBatchSize


class TorchArgumentError(EnergyLoaderError, ValueError):
    """A torch DataLoader argument a savable pipeline does its own way."""


@attrs.frozen
class PipelineTorchArgs:
    """The torch arguments given with a savable pipeline (defaults: torch's)."""

    batch_size: Any = DEFAULT_BATCH_SIZE
    shuffle: Any = None
    sampler: Any = None
    batch_sampler: Any = None
    collate_fn: Callable[..., Any] | None = None
    drop_last: bool = False
    generator: Any = None
    in_order: bool = True


def apply_to_pipeline(pipeline: SavableDataset, args: PipelineTorchArgs) -> SavableDataset:
    """The pipeline the loader runs, batched if ``batch_size`` was given; raises
    :class:`TorchArgumentError` for an argument a pipeline does its own way, naming that way."""
    if args.shuffle:
        raise TorchArgumentError(
            "`shuffle=True` does not apply to a savable pipeline: shuffle at the source "
            "(IndexedSource(data, shuffle=True, seed=...)) or add a ShuffleBufferDataset "
            "(pipeline.shuffle_buffer(size)); the loader then saves the shuffle's position"
        )
    if args.sampler is not None or args.batch_sampler is not None:
        name = "sampler" if args.sampler is not None else "batch_sampler"
        raise TorchArgumentError(
            f"`{name}` does not apply to a savable pipeline, whose sources choose and order "
            "their samples: use IndexedSource(data, shuffle=True, seed=...) or a "
            "ShuffleBufferDataset for the order, FilterDataset/LimitDataset for the choice, "
            "BatchDataset/GroupBatchDataset for batches; or pass a map-style dataset instead "
            "of a pipeline to run it as a drop-in with your sampler"
        )
    if args.generator is not None:
        raise TorchArgumentError(
            "`generator` does not apply to a savable pipeline: its randomness comes from the "
            "seeds of its sources and wrappers (e.g. IndexedSource(..., seed=...)) and "
            "WorkerConfig(seed=...)"
        )
    if args.in_order is not True:
        raise TorchArgumentError(
            "`in_order=False` does not apply to a savable pipeline: its items come in a fixed "
            "order so that a saved position means one thing; leave `in_order` at True"
        )
    if not batch_size_given(args.batch_size) or args.batch_size is None:
        if args.collate_fn is not None or args.drop_last:
            name = "collate_fn" if args.collate_fn is not None else "drop_last"
            raise TorchArgumentError(
                f"`{name}` needs a `batch_size` with a savable pipeline: pass batch_size=... "
                "(the loader then batches with BatchDataset(pipeline, batch_size, "
                "collate_fn=..., drop_last=...)), or batch in the pipeline yourself"
            )
        return pipeline
    from ..wrappers.batch import BatchDataset

    return BatchDataset(
        pipeline, args.batch_size, collate_fn=args.collate_fn, drop_last=args.drop_last
    )


def pipeline_with_torch_args(
    pipeline: SavableDataset, args: PipelineTorchArgs, prefetch_factor: int | None
) -> tuple[SavableDataset, int | None]:
    """The pipeline to run (:func:`apply_to_pipeline`) and the prefetch factor (torch's
    default of 2 with workers when none was given)."""
    return apply_to_pipeline(pipeline, args), 2 if prefetch_factor is None else prefetch_factor
