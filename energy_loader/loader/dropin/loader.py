"""DropInDataLoader: torch's DataLoader for any dataset, with exact save and restore.

``SavableDataLoader(dataset, ...)`` returns one of these when ``dataset`` is not a savable
pipeline, so changing ``DataLoader`` to ``SavableDataLoader`` is the whole migration. It is
a ``SavableDataLoader`` (``isinstance`` holds) and a torch ``DataLoader`` initialised with
the caller's own arguments: torch validates them, sets every attribute frameworks read and
computes ``len()``. How it runs a map-style dataset: :mod:`.map_style`; an iterable one:
:mod:`.iterable`.

Elastic resume: under a ``DistributedSampler`` any rank's state restores every rank of any
world size or batch size (:class:`energy_loader.loader.planner.Dealing`); other samplers
restore on the world size that saved them. Not here: shuffle buffers, packing, blends,
restore keys. Those need a savable pipeline (docs/migration.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from ...dataset import SavableDataset
from ...errors import StateMismatchError
from ...state.plain import StateReader
from ...transport import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_INLINE_BYTES,
    Transport,
    validate_transport_settings,
)
from ...validation import require_bool, require_int
from ...worker import WorkerConfig
from ...workers.bundling import DEFAULT_ITEMS_PER_TRANSFER
from ..progress import MAX_HELD_BACK
from ..savable_loader import SavableDataLoader
from ..torch_args import DEFAULT_BATCH_SIZE
from .entries import ANY_RANK_KEY, is_rank_entries, rank_entries, rank_key, states_of_entries
from .job import check_one_save
from .map_style import MapEngine
from .trainers import lightning_count_check, restored_by_lightning

__all__ = ["DropInDataLoader"]


class DropInDataLoader(SavableDataLoader):
    """A torch ``DataLoader`` over any map-style or iterable dataset that saves its position.

    Built by ``SavableDataLoader(dataset, ...)`` for a dataset that is not a savable pipeline
    (construct it directly only to be explicit). Yields what ``torch.utils.data.DataLoader``
    yields for the same arguments and generator (or global seed), for a deterministic
    ``__getitem__``, for any ``num_workers``. Example::

        loader = SavableDataLoader(my_dataset, batch_size=32, shuffle=True, num_workers=8)
        for step, batch in enumerate(loader):
            train_step(batch)
            if step % 500 == 0:
                torch.save({"data": loader.state_dict(), ...}, path)

        loader = SavableDataLoader(my_dataset, batch_size=32, shuffle=True, num_workers=8)
        loader.load_state_dict(torch.load(path, weights_only=True)["data"])

    Options of its own (keyword-only, after torch's): ``seed_per_sample`` (default True:
    python ``random``, numpy's and torch's global RNGs are seeded from (epoch seed, index)
    before each ``__getitem__``, so random augmentation comes back identical after a restore,
    on any layout (a dataset with ``__getitems__`` is then read one index at a time);
    False leaves workers seeded as torch seeds them, and a restored ``__getitem__`` then draws
    other numbers), ``verify_restore`` (default True: a restore re-runs the sampler to the
    saved position and checks it against the state's proof -- the last batch's indices, the
    sampler's generators at an epoch's end -- raising ``StateMismatchError`` if it re-made
    another stream; False continues from the re-derived position unchecked),
    ``items_per_transfer`` (most batches a worker sends in one trip), the
    ``transport_*`` options, ``worker_config`` (rank and world size; default from the
    environment). The other options of :class:`SavableDataLoader` are accepted for a
    one-word change and apply to iterable datasets (``checkpoint_every_n_samples``, ...).

    Thread-safety: one thread iterates and saves. Epochs: every ``iter()`` starts a new epoch,
    as with torch, except the first after a restore, which continues the saved one (docs/loader.md).
    """

    restores_by_slot = False  # a drop-in state is whole: per-rank files are read whole

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
    ) -> None:
        if isinstance(dataset, SavableDataset):
            raise TypeError(
                "DropInDataLoader runs plain datasets; give a savable pipeline to SavableDataLoader"
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
        require_bool(seed_per_sample, "seed_per_sample")
        require_bool(verify_restore, "verify_restore")
        require_int(items_per_transfer, "items_per_transfer", minimum=1)
        validate_transport_settings(transport_codec, transport_inline_bytes, transport_arena_bytes)
        self.seed_per_sample = seed_per_sample
        self.items_per_transfer = items_per_transfer
        self.transport_codec = transport_codec
        self.transport_inline_bytes = transport_inline_bytes
        self.transport_arena_bytes = transport_arena_bytes
        self.held_back_source: Callable[[], int] | None = None
        # Set by a load_state_dict() from Lightning: the saved epoch's batches used.
        self._lightning_restored: int | None = None
        self._worker_config = _resolve_worker_config(worker_config, num_workers)
        if num_partitions not in (None, max(1, num_workers) * self._worker_config.world_size):
            raise ValueError(
                "`num_partitions` needs a savable pipeline (elastic resume across layouts); a "
                "drop-in loader over a plain dataset runs one partition per worker: leave "
                "num_partitions=None"
            )
        transport = (
            Transport(transport_inline_bytes, transport_arena_bytes)
            if transport_codec and num_workers
            else None
        )
        self._iterable = isinstance(dataset, IterableDataset)
        if self._iterable:
            from .iterable import IterableEngine

            self._engine: Any = IterableEngine(
                self,
                checkpoint_every_n_samples=checkpoint_every_n_samples,
                checkpoint_every_sec=checkpoint_every_sec,
                n_checkpoints=n_checkpoints,
                gc_collect_every_n_steps=gc_collect_every_n_steps,
                gc_freeze_at_start=gc_freeze_at_start,
                worker_reply_timeout=worker_reply_timeout,
                transport_codec=transport_codec,
                transport_inline_bytes=transport_inline_bytes,
                transport_arena_bytes=transport_arena_bytes,
                items_per_transfer=items_per_transfer,
                stall_warning=stall_warning,
                seed_per_sample=seed_per_sample,
            )
        else:
            self._engine = MapEngine(
                self,
                seed_per_sample=seed_per_sample,
                items_per_transfer=items_per_transfer,
                transport=transport,
                verify_restore=verify_restore,
            )

    # -- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Any:
        """A new epoch, as torch's ``iter(loader)`` (the first after a restore continues it)."""
        restored, self._lightning_restored = self._lightning_restored, None
        iterator = self._engine.iterate()
        if restored is not None:  # Lightning loaded the state: will it count the epoch right?
            iterator.before_first = lightning_count_check(self, restored)
        # The iterator keeps the loader alive (as torch's keeps its workers): dropping the
        # loader while iterating must not stop the workers under the iterator.
        iterator.owner = self
        return iterator

    def __len__(self) -> int:
        """torch's ``len(loader)``: batches per epoch (the sampler's length)."""
        return DataLoader.__len__(self)

    @property
    def epoch(self) -> int:
        """The epoch (0-based) of the batch handed out last: ``iter()`` calls since the
        first, counted across restores."""
        return int(self._engine.epoch_number)

    @property
    def resumed_batches_left(self) -> int | None:
        """While the epoch a restore continues runs (its first ``iter()``): how many of its
        batches this rank has not handed out yet; None in any other epoch or before ``iter()``.

        After a restore on the same layout this is ``len(self)`` minus the batches used
        before the save; after a resize (another world size or batch size under a
        ``DistributedSampler``) it is what the new dealing gives this rank, which a trainer
        that counts an epoch's batches up to ``len()`` needs to know (Lightning's callback).
        """
        if self._iterable:
            return None
        left: int | None = self._engine.resumed_batches_left()
        return left

    @property
    def num_partitions(self) -> int:
        """One partition per worker of every rank (a drop-in loader is not elastic)."""
        return max(1, self.num_workers) * self._worker_config.world_size

    @property
    def worker_config(self) -> WorkerConfig:
        """The rank/worker layout this loader runs with."""
        return self._worker_config

    # -- state -----------------------------------------------------------------------------------

    def save_state_rank(self, *, held_back: int = 0) -> dict[str, Any]:
        """This rank's exact position as plain data (json-able when a stateful sampler's or
        dataset's own state is; always ``torch.load(weights_only=True)``-able).

        ``held_back=n`` (at most 2) saves the position ``n`` batches before the last one
        handed out, for consumers that fetch ahead (Lightning).
        """
        return self._saved(held_back).to_plain()

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        """Continue exactly from ``state`` at the next ``iter()``, on any ``num_workers``.

        Under a ``DistributedSampler`` the ranks of a job advance in lockstep, so a state
        names the job's position in the epoch's permutation, not the rank's: any rank's state
        restores every rank of any world size and batch size (Lightning hands rank 0's state
        to every rank); on another world size or batch size the rest of the epoch is dealt to
        the new ranks as the sampler deals (docs/loader.md).

        Raises ``StateFormatError`` for something that is not a drop-in state and
        ``StateMismatchError`` for a state of another dataset, sampler or batching, or of
        another rank; the loader is then left as it was.
        """
        decoded = self._engine.decode(state)
        config = self._worker_config
        other_layout = decoded.world_size != config.world_size or decoded.rank != config.rank
        if other_layout and not self._engine.rank_free(decoded):
            raise StateMismatchError(
                f"the state was saved by rank {decoded.rank} of {decoded.world_size}; this loader "
                f"is rank {config.rank} of {config.world_size}. A drop-in loader restores on "
                "the same world size, each rank from its own state, unless its sampler is a "
                "DistributedSampler (then any rank's state restores any layout); otherwise "
                "elastic resume needs a savable pipeline: docs/migration.md"
            )
        self._engine.restore(decoded)

    def decode_states(self, states: Sequence[Any]) -> list[Any]:
        """Every rank's state as given: a drop-in state is checked when its rank restores it."""
        return list(states)

    def restore_from_states(self, states: list[Any]) -> None:
        """Restore this rank from the list of every rank's states (its own entry)."""
        self.restore_state_rank(self._own_state(states))

    def plan_restore(self, states: list[Any]) -> Any:
        """Check that this rank can restore from ``states`` (changes nothing)."""
        own = self._own_state(states)
        decoded = self._engine.decode(own)
        self._engine.check(decoded)
        return decoded

    def saved_ranks_needed(self, first: Any, rank: int | None = None) -> list[int]:
        """The saved ranks whose states rank ``rank`` (any rank: the answer is the same for
        all) restores from on another world size: ``first``'s alone under a
        ``DistributedSampler`` (it names the job's position); otherwise refused with
        ``StateMismatchError`` (each rank restores from its own state)."""
        if self.restores_any_rank(first):
            return [StateReader(first, "state").int("rank")]
        raise _other_world_size(StateReader(first, "state").int("world_size", minimum=1), self)

    def restores_any_rank(self, state: Any) -> bool:
        """Whether ``state`` (plain) names the job's position rather than one rank's: a
        map-style state under a ``DistributedSampler`` restores every rank of any layout."""
        return bool(self._engine.rank_free(self._engine.decode(state)))

    def _own_state(self, states: list[Any]) -> Any:
        config = self._worker_config
        if len(states) == 1:
            return states[0]  # this rank's own entry; restore_state_rank checks whose
        if len(states) == config.world_size:
            check_one_save(states, across=False)
            return states[config.rank]  # its own entry (also the job's position)
        if states and self.restores_any_rank(states[0]):
            check_one_save(states, across=True)
            return states[0]  # the job's position: any rank's state
        raise _other_world_size(len(states), self)

    def state_dict(self, *, held_back: int | None = None) -> dict[str, Any]:
        """This rank's state as ``{"rank_00001": "<JSON>"}`` (torch.distributed.checkpoint's
        Stateful protocol; :mod:`.entries` says why a key per rank and a JSON leaf).

        ``held_back`` as in :meth:`save_state_rank`; left at None it is what an integration's
        ``held_back_source`` says (Lightning), else 0. DCP takes the loader under one key on
        every rank; ``torch.save`` and ``json`` take the dict as is.
        """
        if held_back is None:
            held_back = 0 if self.held_back_source is None else self.held_back_source()
        state = self._saved(held_back)
        as_json = getattr(state, "to_json", None)
        if as_json is not None:  # a map-style state: the epoch's constant part encoded once
            key = ANY_RANK_KEY if self._engine.rank_free(state) else rank_key(state.rank)
            with contextlib.suppress(TypeError, ValueError):  # a sampler state JSON can't hold
                return {key: as_json()}
        return rank_entries([state.to_plain()])

    def _saved(self, held_back: int) -> Any:
        require_int(held_back, "held_back", minimum=0)
        if held_back > MAX_HELD_BACK:
            raise ValueError(f"`held_back` must be at most {MAX_HELD_BACK} (got {held_back})")
        config = self._worker_config
        return self._engine.save(config.rank, config.world_size, held_back)

    def state_dict_of_ranks(self, states: Sequence[Any]) -> dict[str, Any]:
        """Every rank's state (``save_state_global``'s list) in :meth:`state_dict`'s layout:
        one checkpoint for the whole job, from which each rank's :meth:`load_state_dict` takes
        its own entry (Lightning's callback stores it)."""
        return rank_entries(states)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s or :meth:`state_dict_of_ranks`' output (this rank
        takes its own entry), or from a plain :meth:`save_state_rank` state."""
        self._lightning_restored = None
        if is_rank_entries(state_dict):
            self.restore_from_states(states_of_entries(state_dict))
        else:
            self.restore_state_rank(state_dict)
        pending = getattr(self._engine, "pending", None)
        if pending is not None and pending.started and restored_by_lightning():
            self._lightning_restored = pending.used  # checked at the next iter() (trainers.py)

    def reset_state(self) -> None:
        """Forget all progress: the next ``iter()`` starts epoch 0 as a fresh loader would."""
        self._lightning_restored = None
        self._engine.reset()

    # -- the rest --------------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The dataset, sampler and batching a state must match, plus the layout."""
        config = self._worker_config
        return {
            "dropin": dict(self._engine.config),
            "rank": config.rank,
            "world_size": config.world_size,
            "num_workers": self.num_workers,
        }

    def restore_sample(self, key: Any) -> Any:
        raise TypeError(
            "restore_sample needs a savable pipeline (samples with restore keys); a drop-in "
            "loader's dataset is indexed directly: dataset[index]"
        )

    def peek_keys(self, n: int, state: dict[str, Any] | None = None) -> list[Any]:
        """The dataset indices of the next ``n`` batches of the current epoch (a list per
        batch, an index without batching; fewer if the epoch ends first), changing nothing.

        With ``state`` (any rank's saved state of this dataset and sampling setup): the
        batches after that saved position instead (``python -m energy_loader replay``).
        Map-style datasets only; an iterable dataset's items have no index.
        """
        require_int(n, "n", minimum=0)
        if self._iterable:
            raise TypeError(
                "peek_keys needs a map-style dataset (an iterable's items have no index)"
            )
        saved = None
        if state is not None:
            saved = self._engine.decode(state)
            self._engine.check(saved)
        return list(self._engine.peek_units(n, saved))

    def set_distributed_rank(self, rank: int, num_replicas: int) -> None:
        """Point the loader's ``DistributedSampler`` at ``rank`` of ``num_replicas`` (its
        ``num_samples`` and ``total_size`` recomputed as its constructor computes them), before
        the first ``iter()``: how ``python -m energy_loader replay --rank R`` makes rank R's
        loader out of one built for another rank, or without a process group.

        Raises ``TypeError`` without a ``DistributedSampler`` and ``ValueError`` for a rank
        outside ``range(num_replicas)`` or a loader that has iterated or restored already.
        """
        require_int(num_replicas, "num_replicas", minimum=1)
        require_int(rank, "rank", minimum=0)
        if rank >= num_replicas:
            raise ValueError(f"rank must be in range({num_replicas}) (got {rank})")
        if self._iterable:
            raise TypeError("set_distributed_rank needs a map-style dataset's DistributedSampler")
        self._engine.set_distributed_rank(self, rank, num_replicas)

    def peek_batches(self, n: int, state: dict[str, Any]) -> list[tuple[Any, Any]]:
        """The next ``n`` batches after the saved ``state`` (fewer if its epoch ends first),
        each with its dataset indices (:meth:`peek_keys`), made in this process by the
        loader's own fetcher, the one its workers run: with ``seed_per_sample`` each
        ``dataset[index]`` draws from the same per-sample seeds (job seed, epoch, index) as
        in training, and ``collate_fn`` makes the batch, so a random augmentation is the
        trained one. Changes nothing (the global RNGs are put back); map-style datasets only.
        """
        units = self.peek_keys(n, state)
        if not units:
            return []
        saved = self._engine.decode(state)
        return list(zip(units, self._engine.make_units(units, saved), strict=True))

    def stats(self) -> dict[str, Any]:
        """Numbers since the previous call and in total, as a savable pipeline's loader gives
        them (docs/observability.md): waits of ``next()``, items/s, saves, and per worker the
        seconds and bytes of the batches it made (map-style: the trips torch dealt it in turn;
        its queue depth is not asked)."""
        return self._engine.stats()

    def close(self) -> None:
        """Stop the worker processes now, keeping the position (the next ``iter()`` goes on)."""
        self._engine.close()

    def _shutdown_workers(self) -> None:
        self._engine.shutdown()

    def __del__(self, _suppress: Any = contextlib.suppress) -> None:
        with _suppress(Exception):
            self._engine.shutdown()


def _other_world_size(saved: int, loader: DropInDataLoader) -> StateMismatchError:
    return StateMismatchError(
        f"{saved} rank state(s) were saved, this job has world size "
        f"{loader.worker_config.world_size}: a drop-in loader restores on the same world size "
        "unless its sampler is a DistributedSampler (otherwise elastic resume needs a savable "
        "pipeline: docs/migration.md)"
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


SavableDataLoader.dropin_class = DropInDataLoader
