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
import pickle
import random
from collections.abc import Iterator
from typing import Any

import attrs
from torch.utils.data import get_worker_info

from .contender import Contender, shutdown_workers
from .workloads import BATCH, PREFETCH, WORKERS, WORKLOADS, PlainPipeline, collate, epoch_order

__all__ = ["StatefulPipeline", "torchdata_contender"]


@attrs.define
class _Progress:
    """Where one worker's pass over its shard stands."""

    epoch: int
    consumed: int
    buffer: list[dict[str, Any]]
    rng: random.Random
    # None while the shard streams through the buffer; then how many of the shuffled
    # remainder were yielded.
    drained: int | None = None


class StatefulPipeline(PlainPipeline):
    """:class:`PlainPipeline` with torchdata's ``Stateful`` protocol."""

    def __init__(self, samples: int, seed: int = 0, workload: str = "reference") -> None:
        super().__init__(samples, seed, workload)
        self._resume: dict[str, Any] | None = None
        self._progress: _Progress | None = None

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

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        progress = self._start(worker)
        self._progress, self._resume = progress, None
        self.epoch = progress.epoch + 1
        indices = epoch_order(self.samples, self.seed, progress.epoch)[worker::workers]
        samples = self._stream(progress, indices)
        if not self.workload.plain_batches_itself:
            yield from samples
            return
        batch: list[dict[str, Any]] = []
        for sample in samples:
            batch.append(sample)
            if len(batch) == BATCH:
                ready, batch = collate(batch), []
                yield ready
        if batch:
            yield collate(batch)

    def _start(self, worker: int) -> _Progress:
        state = self._resume
        if state is None or "consumed" not in state:
            return _Progress(self.epoch, 0, [], random.Random(worker))
        rng = random.Random()
        version, internal, gauss = state["rng"]
        rng.setstate((version, tuple(internal), gauss))
        buffer = [self.workload.sample(index) for index in state["buffer"]]
        return _Progress(state["epoch"], state["consumed"], buffer, rng, state["drained"])

    def _stream(self, progress: _Progress, indices: list[int]) -> Iterator[dict[str, Any]]:
        """The shuffle buffer of :class:`PlainPipeline`, resumable from ``progress``."""
        size, buffer, rng = self.workload.buffer, progress.buffer, progress.rng
        if progress.drained is None:
            while progress.consumed < len(indices):
                sample = self.workload.sample(indices[progress.consumed])
                progress.consumed += 1
                if len(buffer) < size:
                    buffer.append(sample)
                    continue
                slot = rng.randrange(size)
                buffer[slot], sample = sample, buffer[slot]
                yield sample
            rng.shuffle(buffer)
            progress.drained = 0
        while progress.drained < len(buffer):
            progress.drained += 1
            yield buffer[progress.drained - 1]


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


def _restore(samples: int, workload: str, state: Any) -> Any:
    loader = _build(samples, workload)
    loader.load_state_dict(state)
    return loader


def torchdata_contender() -> Contender:
    """torchdata 0.11's ``StatefulDataLoader`` over :class:`StatefulPipeline`, at defaults."""
    return Contender(
        "torchdata",
        build=_build,
        save=lambda loader: loader.state_dict(),
        restore=_restore,
        state_bytes=lambda state: len(pickle.dumps(state)),
        close=shutdown_workers,
        missing=_missing,
    )
