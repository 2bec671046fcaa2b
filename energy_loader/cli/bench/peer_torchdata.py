"""torchdata's ``StatefulDataLoader`` running the bench workload, as its users would write it.

torchdata saves an ``IterableDataset`` exactly only when the dataset is ``Stateful``
(``state_dict``/``load_state_dict``); otherwise it counts the items a worker yielded and
replays them on restore. So the peer here is :class:`StatefulPipeline`: the plain pipeline
(same order, same sharding, same shuffle buffer, same batches) whose progress lives in one
object that ``state_dict`` reads: the epoch, how many of the worker's indices were consumed,
the indices in the shuffle buffer (samples are rebuilt from them on restore), and the buffer's
``random.Random`` state. The loader runs at torchdata's defaults (``snapshot_every_n_steps=1``:
every batch carries its worker's state to the main process), with the same workers, prefetch
and persistence as the plain DataLoader.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

from .contender import Contender, shutdown_workers
from .workloads import BATCH, PREFETCH, WORKERS, WORKLOADS, PlainPipeline, ShuffleProgress

__all__ = ["StatefulPipeline", "torchdata_contender"]


class StatefulPipeline(PlainPipeline):
    """:class:`PlainPipeline` with torchdata's ``Stateful`` protocol."""

    def __init__(self, samples: int, seed: int = 0, workload: str = "reference") -> None:
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

    def _start(self, worker: int) -> ShuffleProgress:
        state, self._resume = self._resume, None
        if state is None or "consumed" not in state:
            self._progress = super()._start(worker)
            return self._progress
        rng = random.Random()
        version, internal, gauss = state["rng"]
        rng.setstate((version, tuple(internal), gauss))
        buffer = [self.workload.sample(index) for index in state["buffer"]]
        self._progress = ShuffleProgress(
            state["epoch"], state["consumed"], buffer, rng, state["drained"]
        )
        return self._progress


def _missing() -> str | None:
    if importlib.util.find_spec("torchdata") is None:
        return "torchdata is not installed (pip install -c constraints.txt -e '.[bench]')"
    return None


def _build(samples: int, workload: str) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(
        StatefulPipeline(samples, workload=workload),
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
