"""The drop-in loader over an iterable dataset: the pipeline machinery, one copy per worker.

torch runs one copy of an iterable dataset per worker, batches in that worker and hands the
batches out round-robin. That is a savable pipeline of one logical partition per worker:
``BatchDataset(IterableSource(dataset))`` run by a
:class:`~energy_loader.loader.pipeline_engine.PipelineEngine`, whose workers checkpoint the
source every few items (:mod:`energy_loader.sources.iterable`). A restore replays up to
``checkpoint_every_n_samples`` batches per worker from a ``Stateful`` dataset's own state, and
the epoch so far for any other. The state restores on the same ``num_workers`` and world size
only (each worker's copy is one stream); a Hugging Face stream not split for its rank is
refused (:mod:`.hf_stream`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader

from ...dataset import RESTORE_KEY
from ...errors import StateMismatchError
from ...sources.iterable import IterableSource
from ...torch_internals import WorkersDataLoader, draw_base_seed
from ...worker import WorkerConfig
from ...wrappers.batch import BatchDataset
from ...wrappers.map import MapDataset
from ..arguments import resolve_arguments
from ..pipeline_engine import PipelineEngine
from .encoding import decode_generator_states, encode_generator_states
from .hf_stream import check_stream_split
from .restore import DropInRestore
from .state import DROPIN_STATE_FORMAT, DROPIN_STATE_VERSION, check_config, read_header


class IterableState:
    """An iterable drop-in loader's state: the inner pipeline's rank state, the loader's
    ``generator=`` state (None without one) and whether its workers persist."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        config: dict[str, Any],
        pipeline: Any,
        generator: torch.Tensor | None = None,
        persistent: bool = False,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.pipeline = pipeline
        self.generator = generator
        self.persistent = persistent

    def to_plain(self) -> dict[str, Any]:
        generator = self.generator
        return {
            "format": DROPIN_STATE_FORMAT,
            "version": DROPIN_STATE_VERSION,
            "kind": "iterable",
            "rank": self.rank,
            "world_size": self.world_size,
            "config": self.config,
            "pipeline": self.pipeline,
            "generator": None if generator is None else encode_generator_states([generator])[0],
            "persistent": self.persistent,
        }

    @classmethod
    def from_plain(cls, state: Any) -> IterableState:
        reader = read_header(state, "iterable")
        text = reader.raw("generator")
        return cls(
            reader.int("rank"),
            reader.int("world_size", minimum=1),
            reader.raw("config"),
            reader.raw("pipeline"),
            None if text is None else decode_generator_states([text], "state.generator")[0],
            reader.bool("persistent"),
        )


class _Stripped:
    """The inner loader's batches without the restore keys a pipeline attaches to them."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.owner: Any = None  # the loader, kept alive while this iterator is

    def __iter__(self) -> _Stripped:
        return self

    def is_current(self) -> bool:
        return bool(self._inner.is_current())

    def __next__(self) -> Any:
        batch = next(self._inner)
        if isinstance(batch, dict):
            batch.pop(RESTORE_KEY, None)
        elif hasattr(batch, RESTORE_KEY):
            with contextlib.suppress(AttributeError, TypeError):
                delattr(batch, RESTORE_KEY)
        return batch

    def __len__(self) -> int:
        return len(self._inner)


class IterableEngine(DropInRestore):
    """Runs an iterable drop-in loader as a pipeline engine of one partition per worker."""

    def __init__(self, loader: DataLoader[Any], config: WorkerConfig, **options: Any) -> None:
        seed_per_sample = options.pop("seed_per_sample")
        verify = options.pop("verify_restore")
        on_code_change = options.pop("on_code_change")
        check_stream_split(loader.dataset, config)
        source = IterableSource(
            loader.dataset, worker_init_fn=loader.worker_init_fn, seed_per_epoch=seed_per_sample
        )
        collate: Any = loader.collate_fn
        if collate is torch.utils.data.default_collate:
            from ...wrappers.collate import default_collate

            collate = default_collate
        if loader.batch_size is None:
            pipeline: Any = MapDataset(source, collate, seed_per_sample=False)
        else:
            pipeline = BatchDataset(
                source, int(loader.batch_size), collate_fn=collate, drop_last=loader.drop_last
            )
        self.num_workers = loader.num_workers
        self.worker_config = config
        self._owner = weakref.ref(loader)  # for torch's len(): no cycle
        # Whether the job's workers persist (torch then draws the base seed once): the
        # saving job's, once a state is restored; this loader's own before.
        self._job_persistent: bool | None = None
        prefetch = 2 if loader.prefetch_factor is None else loader.prefetch_factor
        args = resolve_arguments(
            pipeline,
            worker_config=config,
            num_workers=loader.num_workers,
            num_partitions=None,
            prefetch_factor=prefetch,
            multiprocessing_context=loader.multiprocessing_context,
            **options,
        )
        self.inner = PipelineEngine(
            pipeline,
            args,
            adopts_partitions=True,
            verify=verify,
            dropin=True,
            on_code_change=on_code_change,
        )
        with warnings.catch_warnings():  # torch warned about num_workers once already
            warnings.simplefilter("ignore")
            self.torch_loader = WorkersDataLoader(
                self.inner.side,
                pin_memory=loader.pin_memory,
                timeout=loader.timeout,
                pin_memory_device=loader.pin_memory_device,
                **self.inner.torch_arguments(prefetch),
            )
        self.inner.bind(self.torch_loader)
        self._state_config = {
            "dataset": type(loader.dataset).__name__,
            "stateful": source.stateful,
            "batch_size": None if loader.batch_size is None else int(loader.batch_size),
            "drop_last": bool(loader.drop_last),
            "num_workers": loader.num_workers,
        }

    @property
    def state_config(self) -> dict[str, Any]:
        return self._state_config

    def record_skip(self, items: int) -> None:
        self.inner.record_skip(items)

    def iterate(self) -> _Stripped:
        """The epoch's batches, drawing the workers' base seed from the loader's generator wherever
        torch would make a new iterator, so the training's generators move as under torch, in a
        restored run too; the workers seed from the job seed."""
        inner = self.inner
        loader = self._owner()
        if loader is None:
            raise RuntimeError("the drop-in loader that owned this engine is gone")
        persistent = self._job_persistent
        if persistent is None:
            persistent = bool(loader.persistent_workers)
        persistent_and_drawn = persistent and inner.has_begun()
        if not persistent_and_drawn and inner.next_iter_begins_epoch():
            draw_base_seed(loader)
        return _Stripped(inner.iterate())

    def current_epoch(self) -> int:
        return self.inner.current_epoch()

    def rank_length(self) -> int:
        """torch's ``len(loader)`` of an iterable dataset (its ``len()``, batched)."""
        loader = self._owner()
        if loader is None:
            raise RuntimeError("the drop-in loader that owned this engine is gone")
        return DataLoader.__len__(loader)

    def state_at(self, rank: int, world_size: int, held_back: int) -> IterableState:
        loader = self._owner()
        generator = None if loader is None else loader.generator
        return IterableState(
            rank,
            world_size,
            self.state_config,
            self.inner.save(held_back),
            None if generator is None else generator.get_state(),
            bool(loader.persistent_workers)
            if self._job_persistent is None and loader is not None
            else bool(self._job_persistent),
        )

    def decode_one(self, state: Any) -> IterableState:
        return IterableState.from_plain(state)

    def plan_record(self, state: IterableState) -> tuple[IterableState, Any]:
        """The state with the inner pipeline's plan of it: checked against this loader's
        workers and config, then planned by the pipeline engine (its own checks)."""
        saved = state.config
        if isinstance(saved, dict) and saved.get("num_workers") != self.num_workers:
            raise StateMismatchError(
                f"the state was saved with num_workers={saved.get('num_workers')}, this loader "
                f"has {self.num_workers}: an iterable dataset's copies are one per worker, so "
                f"it restores on the same count. Build the loader with "
                f"num_workers={saved.get('num_workers')} (a savable pipeline restores on any)"
            )
        check_config(saved, self.state_config)
        return state, self.inner.plan(self.inner.decode([state.pipeline]))

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def names_job_position(self, config: dict[str, Any]) -> bool:
        """An iterable dataset's state is its rank's own stream."""
        return False

    def apply_record(self, plan: tuple[IterableState, Any]) -> None:
        state, inner_plan = plan
        self.inner.apply(inner_plan)
        self._job_persistent = state.persistent
        loader = self._owner()
        if loader is not None and loader.generator is not None and state.generator is not None:
            loader.generator.set_state(state.generator)

    def reset(self) -> None:
        self.inner.reset()
        self._job_persistent = None

    def close(self) -> None:
        self.inner.close()

    def shutdown(self) -> None:
        self.inner.shutdown()
