"""The worker-process side of the loader: numbering, rolling checkpoints, the command thread.

Torch's DataLoader workers iterate a :class:`WorkerSideDataset`. In each worker process it

1. binds the pipeline to its :class:`~energy_loader.WorkerContext` and restores the worker's
   saved state, replaying ``skip`` items without yielding them;
2. numbers every item it yields (``index`` counts up for the life of the worker process; an
   epoch's last item is an end marker, so the main process knows this worker is done);
3. keeps a :class:`CheckpointRing` of pipeline states, each taken by the iterating thread
   right after an item is made, every ``every_n`` items (and every ``every_sec`` seconds);
4. runs a :class:`CommandServer` thread that answers ``get_checkpoint(last_index)`` with the
   newest checkpoint not after ``last_index`` and the number of items to replay from it. The
   thread only reads the ring under a short lock, so it answers while the iterating thread is
   busy making a sample;
5. encodes every sample with the batch codec (:mod:`energy_loader.transport`) when the loader
   uses it, so that what torch's result queue carries is a small packet, not tensors.

Physical worker ``p`` runs *logical* worker ``(p + offset) % num_workers``. Torch always
starts its round-robin at physical worker 0, so a restored loader sets ``offset`` to the
logical worker that was due next and the order of items is what it would have been.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import attrs
import dill
from torch.utils.data import IterableDataset, get_worker_info

from .dataset import SavableDataset, attach_restore_key
from .errors import StateMismatchError
from .state.rank_state import WorkerState
from .transport import WorkerTransport
from .worker import WorkerConfig, WorkerContext, set_process_worker

__all__ = ["CheckpointRing", "CheckpointSettings", "WorkerItem", "WorkerSideDataset"]

# How often the iterating thread offers the GIL to the command thread, in worker processes
# only. The default 5 ms would put a 5 ms floor under save latency while a sample is computed.
_WORKER_SWITCH_INTERVAL = 0.0005


@attrs.frozen
class CheckpointSettings:
    """When workers checkpoint, and how many items may be in flight per worker."""

    every_n: int
    every_sec: float | None
    capacity: int
    in_flight: int
    gc_every_n: int | None
    gc_freeze: bool


# An item travelling from a worker to the main process:
# (logical worker id, item index, is end marker, sample or None)
WorkerItem = tuple[int, int, bool, Any]


class CheckpointRing:
    """The rolling checkpoints of one worker: ``(index, state)`` pairs, oldest first.

    A checkpoint is dropped only when the next one is already at or before
    ``newest_index - in_flight``: the main process has received at least that far, so the
    next one covers every save it can still ask for. ``capacity`` bounds memory; optional
    (time-based) checkpoints are not taken when the ring is full.
    """

    def __init__(self, capacity: int, in_flight: int) -> None:
        self._entries: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
        self._lock = threading.Lock()
        self._capacity = capacity
        self._in_flight = in_flight

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def add(self, index: int, state: dict[str, Any], *, optional: bool = False) -> bool:
        """Record the state after item ``index``; returns whether it was kept."""
        with self._lock:
            entries = self._entries
            while len(entries) >= 2 and entries[1][0] <= index - self._in_flight:
                entries.popleft()
            if optional and len(entries) >= self._capacity:
                return False
            entries.append((index, state))
            return True

    def find(self, last_index: int) -> tuple[dict[str, Any], int]:
        """The newest checkpoint at or before ``last_index`` and how many items follow it."""
        with self._lock:
            for index, state in reversed(self._entries):
                if index <= last_index:
                    return state, last_index - index
            oldest = self._entries[0][0] if self._entries else None
        raise RuntimeError(
            f"no checkpoint at or before item {last_index} (oldest kept: {oldest}); "
            "n_checkpoints is too small for the prefetch depth"
        )

    def __len__(self) -> int:
        return len(self._entries)


class CommandServer(threading.Thread):
    """Answers the main process's requests on one worker's command channel."""

    def __init__(self, channel: Connection, ring: CheckpointRing, worker_id: int) -> None:
        super().__init__(name=f"energy_loader-commands-{worker_id}", daemon=True)
        self._channel = channel
        self._ring = ring

    def run(self) -> None:
        channel = self._channel
        while True:
            try:
                command, request_id, argument = channel.recv()
            except (EOFError, OSError):
                return
            try:
                reply = ("ok", request_id, self.handle(command, argument))
            except Exception:
                reply = ("error", request_id, traceback.format_exc())
            try:
                channel.send(reply)
            except (BrokenPipeError, OSError):
                return

    def handle(self, command: str, argument: Any) -> Any:
        if command == "get_checkpoint":
            return self._ring.find(int(argument))
        if command == "ping":
            return os.getpid()
        raise ValueError(f"unknown worker command {command!r}")


class _Runner:
    """The per-process driver of one (logical) worker's pipeline."""

    def __init__(self, owner: WorkerSideDataset, physical_id: int) -> None:
        workers = max(1, owner.config.num_workers)
        self.logical_id = (physical_id + owner.offset) % workers
        self.context: WorkerContext = owner.config.context(self.logical_id)
        self.pipeline = owner.pipeline
        self.settings = owner.settings
        self.ring = CheckpointRing(owner.settings.capacity, owner.settings.in_flight)
        self.index = -1
        self.last_checkpoint_index = -1
        self.last_checkpoint_time = time.monotonic()
        self.started = False
        self.restore: WorkerState | None = owner.restore_for(self.logical_id)
        self.skip_epoch = False
        self.pipeline.bind(self.context)
        if get_worker_info() is not None:
            set_process_worker(self.context)
            if self.settings.gc_freeze:
                # No collection first: walking torch's heap in every new worker costs
                # hundreds of milliseconds of start-up; freezing what exists is what matters.
                gc.freeze()
        # Until the pipeline is restored and has replayed, the answer to "where do you stand"
        # is the state it was started with: its checkpoint, ``skip`` items before index -1.
        if self.restore is None:
            self.pipeline.reset_state()
            self.ring.add(-1, self.pipeline.save_state())
        else:
            self.ring.add(-1 - self.restore.skip, self.restore.checkpoint)
        # Items leave the worker encoded by the batch codec, when the loader uses it.
        self.encode = None if owner.transport is None else owner.transport.encoder(physical_id)
        if owner.channels is not None:
            sys.setswitchinterval(_WORKER_SWITCH_INTERVAL)
            CommandServer(owner.channels[physical_id], self.ring, self.logical_id).start()

    def _checkpoint(self, *, optional: bool = False) -> None:
        if self.ring.add(self.index, self.pipeline.save_state(), optional=optional):
            self.last_checkpoint_index = self.index
            self.last_checkpoint_time = time.monotonic()

    def _start(self) -> Iterator[Any]:
        """Restore (or reset) the pipeline; returns the keyed iterator to continue with."""
        self.started = True
        pipeline, restore = self.pipeline, self.restore
        self.restore = None
        if restore is None:
            pipeline.reset_state()
            iterator = pipeline.iter_keyed()
        else:
            pipeline.restore_state(restore.checkpoint)
            self.skip_epoch = restore.done
            iterator = pipeline.iter_keyed()
            for replayed in range(restore.skip):
                if next(iterator, None) is None:
                    raise StateMismatchError(
                        f"worker {self.logical_id}: the pipeline ended after {replayed} of the "
                        f"{restore.skip} samples to replay from its checkpoint; is the "
                        "pipeline deterministic (same data, functions and seed)?"
                    )
        if restore is not None:
            self._checkpoint()
        return iterator

    def run_epoch(self, savable: bool) -> Iterator[Any]:
        """One loader epoch of this worker: numbered items, then an end marker."""
        iterator = self._start() if not self.started else self.pipeline.iter_keyed()
        if self.skip_epoch:
            self.skip_epoch = False
            return
        settings, logical, encode = self.settings, self.logical_id, self.encode
        every_n, every_sec, gc_every = settings.every_n, settings.every_sec, settings.gc_every_n
        # No ContextVar is set here: a token held across yields would be reset whenever an
        # abandoned generator is collected, inside some other loader's context. Workers have
        # the process-wide context; the main process sets it around each next().
        for key, sample in iterator:
            self.index += 1
            if self.index - self.last_checkpoint_index >= every_n:
                self._checkpoint()
            elif (
                every_sec is not None and time.monotonic() - self.last_checkpoint_time >= every_sec
            ):
                self._checkpoint(optional=True)
            if gc_every is not None and self.index % gc_every == 0:
                gc.collect()
            sample = attach_restore_key(sample, key)
            if encode is not None:
                sample = encode(sample)
            yield (logical, self.index, False, sample) if savable else sample
        if savable:
            self.index += 1
            self._checkpoint()
            yield (logical, self.index, True, None)


class WorkerSideDataset(IterableDataset[Any]):
    """What torch's DataLoader iterates: the pipeline plus the worker protocol around it.

    With ``savable=False`` (``BasicDataLoader``) items are plain samples and no checkpoints
    are kept. Under spawn/forkserver the pipeline travels to the workers serialized with dill
    (a recipe, never a state), so lambdas and closures work.
    """

    def __init__(
        self,
        pipeline: SavableDataset,
        config: WorkerConfig,
        settings: CheckpointSettings,
        *,
        savable: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.config = attrs.evolve(config, data_parallel_group=None)
        self.settings = settings
        self.savable = savable
        self.channels: list[Connection] | None = None
        self.transport: WorkerTransport | None = None
        self.offset = 0
        self.restores: tuple[WorkerState, ...] | None = None
        self._runner: _Runner | None = None
        self._runner_pid = -1

    def restore_for(self, logical_id: int) -> WorkerState | None:
        return None if self.restores is None else self.restores[logical_id]

    def runner(self) -> _Runner:
        """This process's runner, created on first use in each process."""
        if self._runner is None or self._runner_pid != os.getpid():
            info = get_worker_info()
            self._runner = _Runner(self, info.id if info is not None else 0)
            self._runner_pid = os.getpid()
        return self._runner

    def drop_runner(self) -> None:
        """Forget the in-process runner (the main process's, when ``num_workers == 0``)."""
        self._runner = None

    def __iter__(self) -> Iterator[Any]:
        return self.runner().run_epoch(self.savable)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["pipeline"] = dill.dumps(self.pipeline, recurse=True)
        state["_runner"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["pipeline"] = dill.loads(state["pipeline"])
        self.__dict__.update(state)
