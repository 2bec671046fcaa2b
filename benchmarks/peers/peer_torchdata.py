"""torchdata's ``StatefulDataLoader`` running the bench workloads, as its users would write it.

torchdata saves an ``IterableDataset`` exactly only when the dataset is ``Stateful``
(``state_dict``/``load_state_dict``); otherwise it counts the items a worker yielded and
replays them on restore. So the peer here is :class:`StatefulPipeline`: the plain pipeline
(same order, same sharding, same shuffle buffer, same batches) whose progress lives in one
object that ``state_dict`` reads: the epoch, how many of the worker's indices were consumed,
the indices in the shuffle buffer (samples are rebuilt from them on restore), and the buffer's
``random.Random`` state. The loader runs at torchdata's defaults (``snapshot_every_n_steps=1``:
every batch carries its worker's state to the main process), with the same workers, prefetch
and persistence as the plain DataLoader.

On the real workloads (:func:`torchdata_real_contender`) it runs the plain DataLoader's dataset
with the plain DataLoader's arguments: for ``llm``, :class:`StatefulDocs`, the plain documents
made ``Stateful``; for ``vision``, the plain ``webdataset.WebDataset`` as it is (it is not
``Stateful``, so torchdata replays the worker's items on restore).
"""

from __future__ import annotations

import functools
import importlib.util
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from benchmarks.harness import llm, vision
from benchmarks.harness.bench import Contender
from benchmarks.harness.workloads import WORKLOADS, bound_to_folder
from energy_loader.cli.bench import (
    BATCH,
    PREFETCH,
    WORKERS,
    PlainPipeline,
    ShuffleProgress,
    Workload,
    shutdown_workers,
)

__all__ = ["StatefulDocs", "StatefulPipeline", "torchdata_contender", "torchdata_real_contender"]


class StatefulPipeline(PlainPipeline):
    """:class:`PlainPipeline` with torchdata's ``Stateful`` protocol."""

    def __init__(self, samples: int, seed: int = 0, workload: Workload = WORKLOADS["reference"]):
        super().__init__(samples, seed, workload)
        self._resume: dict[str, Any] | None = None
        self._progress: ShuffleProgress | None = None

    def state_dict(self) -> dict[str, Any]:
        progress = self._progress
        if progress is None:
            return self._resume or {"epoch": self.epoch}
        return {
            "epoch": progress.epoch,
            "consumed": progress.consumed,
            "buffer": [sample["index"] for sample in progress.buffer],
            "rng": progress.rng.getstate(),
            "drained": progress.drained,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume, self._progress = state, None
        self.epoch = state["epoch"]

    def start(self, worker: int) -> ShuffleProgress:
        state, self._resume = self._resume, None
        if state is None or "consumed" not in state:
            self._progress = super().start(worker)
            return self._progress
        rng = random.Random()
        version, internal, gauss = state["rng"]
        rng.setstate((version, tuple(internal), gauss))
        buffer = [self.workload.sample(index) for index in state["buffer"]]
        self._progress = ShuffleProgress(
            state["epoch"], state["consumed"], buffer, rng, state["drained"]
        )
        return self._progress


class StatefulDocs(llm.PlainDocs):
    """The plain DataLoader's documents (:class:`~benchmarks.harness.llm.PlainDocs`) with
    torchdata's ``Stateful`` protocol: the state is the epoch and where the next sequence
    starts (document number in the worker's shard, token offset); a restore re-reads and
    re-tokenizes that document and goes on from there."""

    def __init__(self, folder: Path, seed: int = 0) -> None:
        super().__init__(folder, seed)
        self._state: dict[str, Any] = {"epoch": 0, "document": 0, "offset": 0}
        self._resume: dict[str, Any] | None = None

    def progress(self, epoch: int, document: int | None, offset: int) -> None:
        self._state = {"epoch": epoch, "document": document, "offset": offset}

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume, self._state = dict(state), dict(state)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        state, self._resume = self._resume, None
        if state is None:
            yield from super().__iter__()
            return
        self.epoch = state["epoch"] + 1
        if state["document"] is None:  # the epoch was over
            return
        yield from self.sequences(state["epoch"], state["document"], state["offset"])


def _missing() -> str | None:
    if importlib.util.find_spec("torchdata") is None:
        return "torchdata is not installed (pip install -c constraints.txt -e '.[bench]')"
    return None


def _build(samples: int, workload: str) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(
        StatefulPipeline(samples, workload=WORKLOADS[workload]),
        batch_size=None if WORKLOADS[workload].plain_batches_itself else BATCH,
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
    )


def torchdata_contender() -> Contender:
    """torchdata 0.11's ``StatefulDataLoader`` over :class:`StatefulPipeline`, at defaults."""
    return Contender(
        "torchdata",
        build=_build,
        save=lambda loader: loader.state_dict(),
        load=lambda loader, state: loader.load_state_dict(state),
        close=shutdown_workers,
        missing=_missing,
    )


def _real_loader(workload: str, folder: Path) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    if workload == "llm":
        return StatefulDataLoader(StatefulDocs(folder), **llm.LOADER_OPTIONS)
    return StatefulDataLoader(vision.wds_dataset(folder), **vision.LOADER_OPTIONS)


def torchdata_real_contender(workload: str, folder: Path) -> Contender:
    """torchdata 0.11's ``StatefulDataLoader`` on a real workload over ``folder``'s data."""
    return attrs.evolve(
        torchdata_contender(),
        build=bound_to_folder(functools.partial(_real_loader, workload), folder, workload),
    )
