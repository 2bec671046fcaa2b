"""What torch's DataLoader iterates in each worker: the pipeline plus the worker protocol.

The loader hands torch a :class:`WorkerSideDataset`; torch pickles it into each worker process
(with dill for the pipeline under spawn/forkserver), where ``__iter__`` runs one epoch of this
process's :class:`~energy_loader.workers.runner.Runner` and groups its items into bundles.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import attrs
import dill
from torch.utils.data import IterableDataset, get_worker_info

from ..dataset import SavableDataset
from ..transport import WorkerTransport
from ..worker import WorkerConfig
from .bundling import bundle_bytes, bundle_items
from .protocol import CheckpointSettings, RunPlan
from .runner import Runner


class WorkerSideDataset(IterableDataset[Any]):
    """What torch's DataLoader iterates: the pipeline plus the worker protocol around it. Under
    spawn/forkserver the pipeline (a recipe) travels with dill, so lambdas and closures work."""

    def __init__(
        self,
        pipeline: SavableDataset,
        config: WorkerConfig,
        settings: CheckpointSettings,
        plan: RunPlan,
        *,
        savable: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.config = attrs.evolve(config, data_parallel_group=None)
        self.settings = settings
        self.plan = plan
        self.savable = savable
        self.channels: list[Connection] | None = None
        self.transport: WorkerTransport | None = None
        # Items travel in bundles of up to items_per_transfer (energy_loader.workers.bundling); the
        # main process's per-worker caps, in shared memory, while workers run.
        self.items_per_transfer = 1
        self.bundle_limits: Any = None
        self.offset = 0
        self._runner: Runner | None = None
        self._runner_pid = -1
        # True only while the owning loader makes torch's iterator (and so in the workers it
        # starts): anything else iterating this dataset is a DataLoader built around it.
        self.owner_iterating = False

    def runner(self) -> Runner:
        """This process's runner, created on first use in each process."""
        if self._runner is None or self._runner_pid != os.getpid():
            info = get_worker_info()
            self._runner = Runner(self, info.id if info is not None else 0)
            self._runner_pid = os.getpid()
        return self._runner

    @property
    def local_runner(self) -> Runner | None:
        """The runner of this process if it has one (the main process's, with 0 workers)."""
        return self._runner if self._runner_pid == os.getpid() else None

    def drop_runner(self) -> None:
        """Forget the in-process runner (the main process's, when ``num_workers == 0``)."""
        self._runner = None

    @contextlib.contextmanager
    def iterated_by_owner(self) -> Iterator[None]:
        """Around the owning loader's ``DataLoader.__iter__``: the iteration it starts (in
        this process or in the workers it forks or spawns) is the loader's own."""
        self.owner_iterating = True
        try:
            yield
        finally:
            self.owner_iterating = False

    def __iter__(self) -> Iterator[Any]:
        if not self.owner_iterating:
            raise TypeError(
                "a DataLoader other than its SavableDataLoader is iterating the loader's "
                "internal dataset (did accelerator.prepare(loader) or a framework rebuild the "
                "loader from loader.dataset?). Its items are worker messages, not your "
                "batches, and its position would not be saved. With Hugging Face Accelerate "
                "use energy_loader.integrations.accelerate.prepare_loader(accelerator, "
                "loader) instead of accelerator.prepare(loader); see docs/integrations.md"
            )
        runner = self.runner()
        items = runner.run_epoch(self.savable)
        info = get_worker_info()
        if not self.savable or info is None:
            return items
        arenas = () if self.transport is None else self.transport.arenas
        return bundle_items(
            items,
            self.bundle_limits,
            runner.logical_id,
            info.id,
            self.items_per_transfer,
            bundle_bytes(arenas[0].size if arenas else None),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["pipeline"] = dill.dumps(self.pipeline, recurse=True)
        state["_runner"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["pipeline"] = dill.loads(state["pipeline"])
        self.__dict__.update(state)
