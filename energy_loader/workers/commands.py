"""In a worker process: the command thread, and a clean exit when the main process is gone.

The command thread answers the main process's requests (its counters, for ``loader.stats()``)
while the worker computes; saves never go through it (snapshots travel with the items).
"""

from __future__ import annotations

import multiprocessing.util
import os
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from ..metrics import WorkerCounters


class CommandServer(threading.Thread):
    """Answers the main process's requests on one worker's command channel."""

    def __init__(
        self, channel: Connection, worker_id: int, counters: WorkerCounters | None = None
    ) -> None:
        super().__init__(name=f"energy_loader-commands-{worker_id}", daemon=True)
        self._channel = channel
        self._counters = counters

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
        if command == "ping":
            return os.getpid()
        if command == "stats" and self._counters is not None:
            return self._counters.read()
        raise ValueError(f"unknown worker command {command!r}")


def exit_without_flushing_if_orphaned() -> None:
    """Let this worker process exit at once if its main process has died: at exit an orphan's
    result-queue feeder thread would wait forever to write a bundle nobody reads; a finalizer with
    priority >= 0 runs before that join."""
    parent = os.getppid()

    def exit_if_orphaned() -> None:
        if os.getppid() != parent:
            os._exit(0)

    multiprocessing.util.Finalize(None, exit_if_orphaned, exitpriority=10)
