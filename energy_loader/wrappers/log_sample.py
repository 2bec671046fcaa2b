"""LogSampleDataset: a JSON-lines audit trail of which samples each worker produced.

One line a sample to ``log_dir/partitionPPPPP-of-NNNNN.jsonl`` or the ``energy_loader.samples``
logger; ``index`` is saved and continues after a restore. State: ``{"phase", "epoch",
"inner_done", "inner", "count"}``. See docs/wrappers.md, "LogSampleDataset".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import IO, Any

from ..dataset import BaseWrapperDataset, EpochCursor, Key, SavableDataset, WrapperCursor
from ..state.plain import StateReader

__all__ = ["LogSampleDataset"]

_LOGGER = logging.getLogger("energy_loader.samples")


class _LogCursor(WrapperCursor):
    dataset: LogSampleDataset

    def __init__(self, dataset: LogSampleDataset) -> None:
        super().__init__(dataset)
        self.count = 0

    def resume(self) -> Iterator[tuple[Key, Any]]:
        context = self.dataset.context
        head = {"rank": context.rank, "worker": context.worker_id, "partition": context.partition}
        stream = self.dataset.open_stream()
        for key, sample in self.inner_samples():
            line = json.dumps({**head, "index": self.count, "epoch": self.epoch, "key": key})
            if stream is None:
                _LOGGER.info(line)
            else:
                stream.write(line + "\n")
            self.count += 1
            yield key, sample

    def fields(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_fields(self, reader: StateReader) -> None:
        self.count = reader.int("count")


class LogSampleDataset(BaseWrapperDataset):
    """Log every sample's restore key with rank, worker and index, for audits.
    Example::

        LogSampleDataset(pipeline, log_dir="runs/42/samples")
    """

    def __init__(
        self, dataset: SavableDataset, *, log_dir: str | os.PathLike[str] | None = None
    ) -> None:
        super().__init__(dataset)
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"`log_dir` must be a path or None (got {type(log_dir).__name__})")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self._stream: IO[str] | None = None
        self._stream_pid = -1

    def open_stream(self) -> IO[str] | None:
        """This partition's log file, line-buffered, opened once per process (None: logging).
        One file per logical partition: a job resumed on another layout appends to the same files.
        """
        if self.log_dir is None:
            return None
        if self._stream is None or self._stream_pid != os.getpid():
            os.makedirs(self.log_dir, exist_ok=True)
            context = self.context
            name = f"partition{context.partition:05d}-of-{context.num_partitions:05d}.jsonl"
            self._stream = open(os.path.join(self.log_dir, name), "a", buffering=1)  # noqa: SIM115
            self._stream_pid = os.getpid()
        return self._stream

    def _new_cursor(self) -> EpochCursor:
        return _LogCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_stream"] = None
        state["_stream_pid"] = -1
        return state

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]
