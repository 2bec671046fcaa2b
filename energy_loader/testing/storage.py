"""Storage that counts its bytes: what a checkpoint costs each rank, measured, not estimated.

:class:`CountingReader` and :class:`CountingWriter` are DCP's file-system reader and writer
with byte counters, for ``benchmarks/bench_ranks.py`` and the tests that bound a rank's reads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

__all__ = ["CountingReader", "CountingWriter"]


class CountingReader(FileSystemReader):
    """A ``FileSystemReader`` counting the bytes this process reads: ``metadata_bytes`` (the
    whole ``.metadata`` file, which every rank reads) and ``data_bytes`` (the slices of the data
    files its load plan asks for)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.metadata_bytes = 0
        self.data_bytes = 0

    @property
    def bytes_read(self) -> int:
        return self.metadata_bytes + self.data_bytes

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = super().read_metadata(*args, **kwargs)
        self.metadata_bytes += _metadata_size(self.path)  # pickle.load reads the whole file
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Each item's slice of its data file is read whole (FileSystemReader reads it to the
        # end of the slice before handing it to the planner).
        self.data_bytes += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return super().read_data(plan, planner)


class CountingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` counting ``data_bytes`` (this rank's entries in the data files,
    from the write results) and ``metadata_bytes`` (the ``.metadata`` file, coordinator only)."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.metadata_bytes = 0
        self.data_bytes = 0

    @property
    def bytes_written(self) -> int:
        return self.metadata_bytes + self.data_bytes

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.data_bytes += sum(result.storage_data.length for result in future.value())
        return future

    def finish(self, metadata: Metadata, results: Any) -> None:
        super().finish(metadata, results)
        self.metadata_bytes += _metadata_size(self.path)


def _metadata_size(checkpoint: Any) -> int:
    path = Path(str(checkpoint)) / ".metadata"  # DCP's name for its metadata file
    return path.stat().st_size if path.exists() else 0
