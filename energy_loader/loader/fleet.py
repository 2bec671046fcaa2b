"""The worker processes as the main process sees them: channels, books, replies, failures.

A :class:`WorkerFleet` belongs to one loader. While the loader's workers run it holds, per
worker, a command channel (a duplex pipe; the worker's end travels in the worker-side dataset)
and a :class:`~energy_loader.state.positions.PositionBook` fed with the snapshots that come
with each item, plus the shared array of bundle caps and the transport's arenas. It answers:

- where each worker stands for a save (:meth:`positions`), from the books, with no message;
- what each worker has been doing (:meth:`poll_stats`), over the command channels, for
  ``loader.stats()``;
- which worker a torch error came from (:meth:`error_of`), as a ``WorkerError``;

and it shuts the workers down (:meth:`close`). Physical worker ``p`` runs logical worker
``(p + offset) % num_workers`` (see :mod:`energy_loader.workers.side`); the fleet translates.
Not thread-safe: the loader's iterating thread only.
"""

from __future__ import annotations

import itertools
import multiprocessing
import re
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from torch.utils.data import DataLoader

from ..errors import StateMismatchError, WorkerError, WorkerStateMismatchError
from ..state.positions import Position, PositionBook, Snapshot
from ..torch_internals import (
    has_iterator,
    outstanding_tasks,
    shut_down_iterator,
    worker_processes,
)
from ..transport import Transport
from ..workers.protocol import WorkerItem
from ..workers.side import WorkerSideDataset
from .progress import Mark

_WORKER_IN_MESSAGE = re.compile(r"worker process (\d+)")
_PIDS_IN_MESSAGE = re.compile(r"\b(\d{2,})\b")

# Counters of a worker that has not started (or a loader without workers): ``None``.
Readings = list[dict[str, float] | None]


class WorkerFleet:
    """The main process's handle on one loader's worker processes (see the module docstring)."""

    def __init__(
        self,
        loader: DataLoader[Any],
        side: WorkerSideDataset,
        num_workers: int,
        mp_context: Any,
        transport: Transport | None,
        reply_timeout: float,
    ) -> None:
        # By weak reference: the loader owns the fleet, and torch's iterator hangs off it.
        self._loader: Callable[[], DataLoader[Any] | None] = weakref.ref(loader)
        self._side = side
        self.num_workers = num_workers
        self._mp_context = mp_context
        self._transport = transport
        self._reply_timeout = reply_timeout
        self._channels: list[Connection] = []
        self._request_ids = itertools.count()
        # Per logical worker, what its items brought: snapshots and which partition made each
        # item. A save is computed from these, with no round trip.
        self._books: list[PositionBook] = []

    @property
    def running(self) -> bool:
        """Whether torch's iterator, and so the worker processes, exist."""
        loader = self._loader()
        return loader is not None and has_iterator(loader)

    # -- starting and stopping ---------------------------------------------------------------

    def open(self, starting: Callable[[int], Position]) -> None:
        """Prepare channels, books, bundle caps and arenas for workers about to start; ``starting``
        gives each logical worker's first book entry, so a save before its first item is answered.
        """
        side = self._side
        context = self._mp_context or multiprocessing.get_context()
        pairs = [context.Pipe(duplex=True) for _ in range(self.num_workers)]
        self._channels = [parent for parent, _ in pairs]
        side.channels = [child for _, child in pairs]
        settings = side.settings
        self._books = []
        for logical in range(self.num_workers):
            book = PositionBook(settings.capacity, settings.in_flight)
            book.start(Snapshot.at(starting(logical)))
            self._books.append(book)
        side.bundle_limits = context.RawArray("i", [side.items_per_transfer] * self.num_workers)
        self.open_transport()

    def open_transport(self) -> None:
        """Give the worker side fresh arenas (when the loader uses the batch codec)."""
        if self._transport is not None:
            self._side.transport = self._transport.open(self.num_workers)

    def close(self) -> None:
        """Stop the workers (torch's orderly shutdown) and drop channels, books and arenas."""
        loader = self._loader()
        if loader is not None:
            shut_down_iterator(loader)
        for channel in self._channels:
            channel.close()
        self._channels = []
        self._books = []
        side = self._side
        side.channels = None
        if self._transport is not None:
            self._transport.close()
        side.transport = None

    # -- what the workers sent -------------------------------------------------------------

    def receive(self, item: WorkerItem, key: Any = None) -> None:
        """File what came with ``item`` (its snapshots, which partition made it, its values'
        digest) and the restore key its sample carried (``None``: none, or an end marker)."""
        if self._books:
            self._books[item.worker].receive(item.number, item.slot, item.snapshots, key, item.made)

    def positions(self, mark: Mark) -> list[Position] | None:
        """Each logical worker's partitions' (checkpoint, skip, done) and its next slot at
        ``mark``; ``None`` when no worker has started (the caller knows their start)."""
        if not self.running or not self._books:
            return None
        return [
            book.position_at(mark.last_index[w], epoch_ended=mark.done[w])
            for w, book in enumerate(self._books)
        ]

    # -- asking the workers ------------------------------------------------------------------

    def poll_stats(self, offset: int) -> tuple[Readings, list[int]]:
        """Each logical worker's counters and queue depth (trips asked for, not received); ``None``
        counters and empty queues before the workers start."""
        workers = self.num_workers
        loader = self._loader()
        if loader is None or not self.running or not self._channels:
            return [None] * workers, [0] * workers
        request = next(self._request_ids)
        for channel in self._channels:
            channel.send(("stats", request, None))
        readings: Readings = [None] * workers
        for physical in range(workers):
            logical = (physical + offset) % workers
            readings[logical] = self._await_reply(physical, logical, request)
        depths = [0] * workers
        for physical in outstanding_tasks(loader):
            depths[(physical + offset) % workers] += 1
        return readings, depths

    def _await_reply(self, physical: int, logical: int, request: int) -> Any:
        channel = self._channels[physical]
        deadline = time.monotonic() + self._reply_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(
                    f"worker {logical} did not answer a request within "
                    f"{self._reply_timeout:.0f} s (worker_reply_timeout)",
                    worker_id=logical,
                )
            if channel.poll(min(0.05, remaining)):
                try:
                    status, reply_id, payload = channel.recv()
                except (EOFError, OSError) as error:
                    raise WorkerError(
                        f"worker {logical} closed its command channel", worker_id=logical
                    ) from error
                if reply_id != request:
                    continue
                if status != "ok":
                    raise WorkerError(
                        f"worker {logical} failed to answer a request:\n{payload}",
                        worker_id=logical,
                        original_traceback=payload,
                    )
                return payload
            processes = self._processes()
            if physical < len(processes) and not processes[physical].is_alive():
                raise WorkerError(
                    f"worker {logical} (pid {processes[physical].pid}) died with exit code "
                    f"{processes[physical].exitcode} before answering a request",
                    worker_id=logical,
                )

    def _processes(self) -> list[Any]:
        loader = self._loader()
        return [] if loader is None else worker_processes(loader)

    # -- failures ------------------------------------------------------------------------------

    def error_of(self, error: BaseException, offset: int) -> WorkerError:
        """The ``WorkerError`` for an exception torch raised, naming the logical worker."""
        text = str(error)
        physical = None
        match = _WORKER_IN_MESSAGE.search(text)
        if match is not None:
            physical = int(match.group(1))
        else:  # "DataLoader worker (pid(s) 4771) exited unexpectedly": find it by pid
            pids = {int(p) for p in _PIDS_IN_MESSAGE.findall(text)}
            processes = self._processes()
            physical = next((i for i, w in enumerate(processes) if w.pid in pids), None)
        logical = None
        if physical is not None:
            logical = (physical + offset) % self.num_workers
        # torch names the process it started (physical); after a restore that rotated the
        # workers the logical worker running there is another number: name both.
        who = "a worker"
        if logical is not None:
            who = f"worker {logical}"
            if logical != physical:
                who += f" (torch's worker process {physical})"
        kind = WorkerStateMismatchError if isinstance(error, StateMismatchError) else WorkerError
        return kind(
            f"{who} of the data loader failed: {type(error).__name__}: {text}",
            worker_id=logical,
            original_traceback=text,
        )
