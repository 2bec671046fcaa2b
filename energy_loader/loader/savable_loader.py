"""SavableDataLoader and BasicDataLoader: the DataLoader subclasses users hold.

:class:`SavableDataLoader` is a ``torch.utils.data.DataLoader`` that picks one engine at
construction (:mod:`energy_loader.loader.engine`) and hands every public method to it: a
savable pipeline runs on the :class:`~energy_loader.loader.pipeline_engine.PipelineEngine`,
any other map-style or iterable dataset on a drop-in engine with torch's behaviour for
torch's arguments (:mod:`energy_loader.loader.dropin`). ``type(loader) is SavableDataLoader``
for every dataset. Each method here is a few lines: argument checks, then the engine.

Not here: running workers, saving, planning a restore (the engines), process groups
(:mod:`energy_loader.distributed`, which the collective methods call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader

from .. import distributed
from ..dataset import SavableDataset
from ..state.changes import require_changes
from ..torch_internals import worker_iterator
from ..transport import DEFAULT_ARENA_BYTES, DEFAULT_INLINE_BYTES
from ..validation import require_bool, require_int
from ..worker import WorkerConfig
from ..workers.bundling import DEFAULT_ITEMS_PER_TRANSFER
from ..workers.protocol import CheckpointSettings
from .arguments import require_change_policy, resolve_arguments
from .dropin.build import dropin_engine
from .dropin.map_style import MapEngine
from .dropin.peeking import make_units, peek_units
from .dropin.trainers import lightning_count_check, restored_by_lightning
from .engine import Engine
from .pipeline_engine import PipelineEngine
from .planner import Planner
from .skipping import Skips
from .torch_args import DEFAULT_BATCH_SIZE, PipelineTorchArgs, pipeline_with_torch_args


class SavableDataLoader(DataLoader):  # type: ignore[type-arg]
    """A torch DataLoader that saves its exact position, over a savable pipeline or any dataset.

    Example::

        loader = SavableDataLoader(pipeline, num_workers=2)
        for step, batch in enumerate(loader):
            train_step(batch)
            if step % 500 == 0:
                torch.save({"model": model.state_dict(), "data": loader.state_dict()}, path)

        loader = SavableDataLoader(build_pipeline(), num_workers=2)
        loader.load_state_dict(torch.load(path, weights_only=True)["data"])

    Over a pipeline, torch's ``batch_size``, ``collate_fn`` and ``drop_last`` add a ``BatchDataset``
    and ``shuffle``, samplers and ``generator`` are refused with the savable way; over any other
    dataset it is a drop-in for torch's DataLoader (docs/dropin.md). A restore replays fewer than
    ``checkpoint_every_n_samples`` items (or about ``checkpoint_every_sec`` of work) per worker;
    ``iter(loader)`` continues an unfinished epoch (also after a ``break``). Every option, and what
    ``verify_restore``, ``on_code_change`` and ``on_data_change`` do: docs/loader.md.

    Thread-safety: one thread iterates and saves.
    """

    # Set by integrations whose trainer fetches ahead of training (see state_dict()).
    held_back_source: Callable[[], int] | None = None
    # Whether this loader keeps and saves state (BasicDataLoader does not).
    saves_state = True

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = DEFAULT_BATCH_SIZE,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_config: WorkerConfig | None = None,
        checkpoint_every_n_samples: int = 16,
        checkpoint_every_sec: float | None = 0.1,
        n_checkpoints: int | None = None,
        gc_collect_every_n_steps: int | None = None,
        gc_freeze_at_start: bool = True,
        worker_reply_timeout: float = 60.0,
        transport_codec: bool = True,
        transport_inline_bytes: int = DEFAULT_INLINE_BYTES,
        transport_arena_bytes: int = DEFAULT_ARENA_BYTES,
        items_per_transfer: int = DEFAULT_ITEMS_PER_TRANSFER,
        num_partitions: int | None = None,
        stall_warning: Any = True,
        seed_per_sample: bool = True,
        verify_restore: bool = True,
        on_code_change: str = "warn",
        on_data_change: str = "warn",
        changes: Sequence[str] = (),
    ) -> None:
        # Set by a load_state_dict() from Lightning: the saved epoch's batches used.
        self._lightning_restored: int | None = None
        self._skips = Skips()
        self.seed_per_sample = seed_per_sample
        self.verify_restore = verify_restore
        self.items_per_transfer = items_per_transfer
        self.transport_codec = transport_codec
        self.transport_inline_bytes = transport_inline_bytes
        self.transport_arena_bytes = transport_arena_bytes
        options = {
            "checkpoint_every_n_samples": checkpoint_every_n_samples,
            "checkpoint_every_sec": checkpoint_every_sec,
            "n_checkpoints": n_checkpoints,
            "gc_collect_every_n_steps": gc_collect_every_n_steps,
            "gc_freeze_at_start": gc_freeze_at_start,
            "worker_reply_timeout": worker_reply_timeout,
            "transport_codec": transport_codec,
            "transport_inline_bytes": transport_inline_bytes,
            "transport_arena_bytes": transport_arena_bytes,
            "items_per_transfer": items_per_transfer,
            "stall_warning": stall_warning,
        }
        require_change_policy(on_code_change, "on_code_change", "user functions changed")
        require_change_policy(on_data_change, "on_data_change", "data files changed in place")
        declared = require_changes(changes, dataset, isinstance(dataset, SavableDataset))
        if not isinstance(dataset, SavableDataset):
            if not type(self).saves_state:
                raise TypeError(
                    "the loader runs a SavableDataset pipeline (e.g. IndexedSource(...) wrapped "
                    f"in MapDataset/BatchDataset); got {type(dataset).__name__}"
                )
            DataLoader.__init__(
                self,
                dataset,
                batch_size,
                shuffle,
                sampler,
                batch_sampler,
                num_workers,
                collate_fn,
                pin_memory,
                drop_last,
                timeout,
                worker_init_fn,
                multiprocessing_context,
                generator,
                prefetch_factor=prefetch_factor,
                persistent_workers=persistent_workers,
                pin_memory_device=pin_memory_device,
                in_order=in_order,
            )
            self._engine: Engine = dropin_engine(
                self,
                worker_config=worker_config,
                num_partitions=num_partitions,
                seed_per_sample=seed_per_sample,
                verify_restore=verify_restore,
                on_code_change=on_code_change,
                **options,
            )
            return
        # torch's batching arguments as their savable equivalent (or a clear refusal).
        torch_args = PipelineTorchArgs(
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            generator=generator,
            in_order=in_order,
        )
        dataset, prefetch_factor = pipeline_with_torch_args(dataset, torch_args, prefetch_factor)
        require_bool(seed_per_sample, "seed_per_sample")  # drop-in loaders only
        require_bool(verify_restore, "verify_restore")
        args = resolve_arguments(
            dataset,
            worker_config=worker_config,
            num_workers=num_workers,
            num_partitions=num_partitions,
            prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context,
            **options,
        )
        engine = PipelineEngine(
            dataset,
            args,
            # Without a num_partitions of its own the loader continues whatever count it
            # restores.
            adopts_partitions=num_partitions is None,
            verify=verify_restore,
            savable=self.saves_state,
            on_code_change=on_code_change,
            on_data_change=on_data_change,
            changes=declared,
        )
        DataLoader.__init__(
            self,
            engine.side,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            pin_memory_device=pin_memory_device,
            **engine.torch_arguments(prefetch_factor),
        )
        engine.bind(self)
        self._engine = engine

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """Continue the current epoch if it has items left, otherwise start the next one (a
        drop-in loader: a new epoch, as torch's, except the first after a restore)."""
        made = self._skips.made_by_skip()
        if made is not None:
            return made  # type: ignore[no-any-return]
        restored, self._lightning_restored = self._lightning_restored, None
        iterator: Any = self._engine.iterate()
        if restored is not None:  # Lightning loaded the state: will it count the epoch right?
            iterator.before_first = lightning_count_check(self, restored)
        # The iterator keeps the loader alive (as torch's keeps its workers): dropping the
        # loader while iterating must not stop the workers under the iterator.
        iterator.owner = self
        self._skips.track(iterator)
        return iterator  # type: ignore[no-any-return]

    def skip(self, items: int) -> int:
        """Leave out the next ``items`` items (batches) of the current epoch: they are made
        and dropped, and the state records the skip (epoch, step, count), which ``inspect`` and
        ``replay`` show. Everything after is the stream an uninterrupted run yields from there,
        and a save after it restores exactly. Called inside ``for batch in loader`` it skips
        what that loop would get next; outside one (say right after a restore, before the
        loop) what the next ``iter(loader)`` would yield first. Returns the items skipped: fewer
        when the epoch ends first (a skip does not run into the next epoch).

        After a loss spike at step 41,000, restore the checkpoint of step 40,000, train to
        step 40,800 and call ``loader.skip(400)`` on every rank (docs/long-jobs.md)."""
        return self._skips.skip(items, self, self._engine)

    def _get_iterator(self) -> Any:
        """torch's iterator (the worker processes of a loader with workers), shut down
        promptly even when collected in a reference cycle (``torch_internals``)."""
        return worker_iterator(self)

    def __len__(self) -> int:
        """Items (batches) per epoch for this rank, when known (a drop-in: torch's len)."""
        return self._engine.rank_length()

    @property
    def engine(self) -> Engine:
        """What runs this loader's dataset (:mod:`energy_loader.loader.engine`)."""
        return self._engine

    @property
    def epoch(self) -> int:
        """The epoch the loader is in (0 before the first item): the epoch of the item handed out
        last, or the next once a ``for`` loop has pulled the end (docs/epochs.md)."""
        return self._engine.current_epoch()

    @property
    def num_partitions(self) -> int:
        """P: the job's logical partitions (:mod:`energy_loader.loader.partitions`); a drop-in
        loader runs one per worker of every rank."""
        engine = self._engine
        if isinstance(engine, PipelineEngine):
            return engine.num_partitions
        return max(1, self.num_workers) * engine.worker_config.world_size

    @property
    def pipeline(self) -> SavableDataset:
        """The savable pipeline this loader runs (the recipe: never iterate it yourself)."""
        return self._pipeline_engine("pipeline").planner.pipeline

    @property
    def planner(self) -> Planner:
        """Save and restore planning for this rank (:mod:`energy_loader.loader.planner`)."""
        return self._pipeline_engine("planner").planner

    @property
    def checkpoint_settings(self) -> CheckpointSettings:
        """When this loader's workers snapshot their partitions."""
        return self._pipeline_engine("checkpoint_settings").checkpoint_settings

    @property
    def worker_config(self) -> WorkerConfig:
        """The rank/worker layout this loader runs with."""
        return self._engine.worker_config

    @property
    def resumed_batches_left(self) -> int | None:
        """While the epoch a restore continues runs, the batches of it this rank has yet to hand out
        (a map-style drop-in; after a resize, what the new dealing gives it); None otherwise."""
        engine = self._engine
        return engine.resumed_batches_left() if isinstance(engine, MapEngine) else None

    # -- saving ----------------------------------------------------------------------------

    def save_state_rank(self, *, held_back: int = 0) -> dict[str, Any]:
        """This rank's exact position as plain data (json-able, weights_only-loadable).

        ``held_back=n`` (at most 2): as of ``n`` items before the last one handed out (Lightning).
        Raises ``WorkerError`` after a worker failed, until ``restore_state_rank`` or
        ``reset_state``.
        """
        return self._engine.save(held_back)

    def state_dict(self, *, held_back: int | None = None) -> dict[str, Any]:
        """This rank's state as JSON string leaves (``torch.distributed.checkpoint``'s Stateful
        protocol): ``{"slot_00003": "<JSON>", ...}`` for a pipeline, ``{"rank_00001": "<JSON>"}``
        for a drop-in loader.

        ``held_back`` as in :meth:`save_state_rank`; left at ``None`` (how DCP and trainers call it)
        it is ``held_back_source()`` when an integration set it (Lightning's callback), else 0. Why
        slots and string leaves: docs/distributed.md. ``torch.save`` and ``json`` take the dict as
        is.
        """
        if held_back is None:
            held_back = 0 if self.held_back_source is None else self.held_back_source()
        return self._engine.leaves(held_back)

    def state_dict_of_ranks(self, states: list[Any]) -> dict[str, Any]:
        """Every rank's state (``save_state_global``'s list) in :meth:`state_dict`'s layout:
        one checkpoint for the whole job, from which each rank's :meth:`load_state_dict` takes
        what it runs (Lightning's callback stores it)."""
        return self._engine.leaves_of_ranks(states)

    def save_state_global(self, dst_rank: int = 0) -> list[dict[str, Any]] | None:
        """Gather every rank's state to ``dst_rank``: a list there, ``None`` elsewhere (a collective
        over the data-parallel group)."""
        return distributed.save_state_global(self, dst_rank)

    # -- restoring -------------------------------------------------------------------------

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        """Continue exactly from ``state`` at the next ``iter()``.

        ``state`` is this rank's own state, also from another ``num_workers`` (a drop-in under a
        ``DistributedSampler``: any rank's, on any world size or batch size); onto another world
        size a pipeline needs every rank's state (:meth:`restore_state_global`). Raises
        ``StateFormatError`` for an invalid state and ``StateMismatchError`` for one of another
        pipeline, dataset or ``num_partitions``, or lacking this rank's partitions; the loader is
        then left as it was. Running workers are restarted.
        """
        self.restore_from_states([state])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output (a DCP template this loader listed, filled;
        or every rank's leaves, from any layout the state allows) or from a plain
        :meth:`save_state_rank` state. Decodes only the leaves this rank runs."""
        self._lightning_restored = None
        engine = self._engine
        records = engine.decode_leaves(state_dict)
        if records is None:
            self.restore_state_rank(state_dict)
        else:
            engine.apply(engine.plan(records))
        if isinstance(engine, MapEngine):
            used = engine.restored_batches_used()
            if used is not None and restored_by_lightning():
                self._lightning_restored = used  # checked at the next iter() (trainers.py)

    def restore_from_states(self, states: list[Any]) -> None:
        """Restore this rank from some or all ranks' states of one save (plain, or records an
        engine decoded): decode, check that several are of one save, plan (which checks that
        each fits), apply."""
        engine = self._engine
        records = engine.decode(states)
        if len(records) > 1:
            across = len(records) != self.worker_config.world_size
            engine.check_one_save(records, across=across)
        engine.apply(engine.plan(records))

    def restore_state_global(
        self, states: list[dict[str, Any]] | None, *, src_rank: int | None = None
    ) -> None:
        """Restore every rank from the list of all ranks' states, passed by every rank
        (``src_rank=None``) or by ``src_rank`` only (scattered); a collective."""
        distributed.restore_state_global(self, states, src_rank=src_rank)

    def reset_state(self) -> None:
        """Forget all progress: the next ``iter()`` starts epoch 0 from scratch."""
        self._lightning_restored = None
        self._engine.reset()

    # -- looking ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What the loader has been doing, as plain numbers (docs/observability.md).

        Example::

            if step % 100 == 0:
                print(energy_loader.metrics.flatten(loader.stats()))
        """
        return self._engine.stats()

    def config(self) -> dict[str, Any]:
        """The pipeline's (or the drop-in dataset's) configuration plus the loader's layout."""
        return self._engine.config()

    def peek_keys(self, n: int, state: dict[str, Any] | None = None) -> list[Any]:
        """What this rank yields next, without taking it: the restore keys of the next ``n`` items
        of a pipeline, or the dataset indices of the next ``n`` batches of a map-style drop-in (with
        ``state``: after that saved position). The live loader and the global RNGs are untouched."""
        require_int(n, "n", minimum=0)
        engine = self._engine
        if isinstance(engine, MapEngine):
            saved = None
            if state is not None:
                saved = engine.decode_one(state)
                engine.check(saved)
            return list(peek_units(engine, n, saved))
        if state is not None:
            raise TypeError("peek_keys(n, state) needs a map-style drop-in loader")
        from .peek import peek_keys

        return peek_keys(self._pipeline_engine("peek_keys"), n)

    def restore_sample(self, key: Any) -> Any:
        """Rebuild the sample (or batch) that carried ``key`` (a savable pipeline; a drop-in
        loader's dataset is indexed directly: ``dataset[index]``)."""
        return self._pipeline_engine("restore_sample").restore_sample(key)

    def peek_batches(self, n: int, state: dict[str, Any]) -> list[tuple[Any, Any]]:
        """The next ``n`` batches after the saved ``state`` with their indices, made here by the
        loader's own fetcher (same per-sample seeds, same ``collate_fn``); map-style drop-ins only.
        """
        units = self.peek_keys(n, state)
        if not units:
            return []
        engine = self._map_engine("peek_batches")
        saved = engine.decode_one(state)
        return list(zip(units, make_units(engine, units, saved), strict=True))

    def set_distributed_rank(self, rank: int, num_replicas: int) -> None:
        """Point a map-style drop-in's ``DistributedSampler`` at ``rank`` of ``num_replicas`` before
        the first ``iter()`` (what ``replay --rank`` does). Raises ``TypeError`` without one and
        ``ValueError`` for a bad rank or a loader that has iterated or restored."""
        require_int(num_replicas, "num_replicas", minimum=1)
        require_int(rank, "rank", minimum=0)
        if rank >= num_replicas:
            raise ValueError(f"rank must be in range({num_replicas}) (got {rank})")
        self._map_engine("set_distributed_rank").set_distributed_rank(self, rank, num_replicas)

    def _map_engine(self, what: str) -> MapEngine:
        engine = self._engine
        if not isinstance(engine, MapEngine):
            raise TypeError(
                f"{what} needs a map-style dataset given to the loader as a drop-in (an "
                "iterable's items have no index; a pipeline's have restore keys: peek_keys)"
            )
        return engine

    def _pipeline_engine(self, what: str) -> PipelineEngine:
        engine = self._engine
        if not isinstance(engine, PipelineEngine):
            raise TypeError(f"{what} needs a savable pipeline (this loader runs a drop-in)")
        return engine

    # -- the rest --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers now, keeping the position (the next ``iter()`` restarts them); torch's
        own shutdown from the cycle collector waits up to 5 s per worker."""
        self._engine.close()

    def _shutdown_workers(self) -> None:
        self._engine.shutdown()

    @property
    def _is_accelerate_prepared(self) -> bool:
        """Refuses ``accelerator.prepare(loader)``: Accelerate reads this first and would rebuild a
        plain DataLoader that saves no position."""
        raise TypeError(
            f"accelerator.prepare() cannot take a {type(self).__name__}: it would rebuild a "
            "plain DataLoader that saves no position (and, for a pipeline, cannot read it). "
            "Use energy_loader.integrations.accelerate.prepare_loader(accelerator, loader) "
            "instead: it puts the batches on accelerator.device and saves the loader's "
            "position with accelerator.save_state()"
        )

    def __enter__(self) -> SavableDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _suppress: Any = contextlib.suppress) -> None:
        # Bound as a default: at interpreter exit this module's globals may already be None.
        with _suppress(Exception):
            self._engine.shutdown()


class BasicDataLoader(SavableDataLoader):
    """Runs a savable pipeline with the same sharding and seeding, but saves nothing.

    For evaluation; ``save_state_rank`` and the other state methods raise ``TypeError``.
    """

    saves_state = False

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._pipeline_engine("BasicDataLoader").iterate_unsaved()

    def save_state_rank(self, *, held_back: int = 0) -> dict[str, Any]:
        raise TypeError("BasicDataLoader does not save state; use SavableDataLoader")

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        raise TypeError("BasicDataLoader does not restore state; use SavableDataLoader")

    def peek_keys(self, n: int, state: dict[str, Any] | None = None) -> list[Any]:
        raise TypeError("peek_keys needs a SavableDataLoader (BasicDataLoader keeps no state)")

    def skip(self, items: int) -> int:
        raise TypeError("BasicDataLoader keeps no position to skip in; use SavableDataLoader")
