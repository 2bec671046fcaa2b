"""ShardWriter: samples into size-bounded shard files plus an ``index.json``, for ShardedSource.
A shard is ``b"ELSHARD1" | uint64 count | uint64 offsets[count + 1] | records``, one sample a
record in :mod:`energy_loader.sources._codec`. See docs/sources/sharded.md.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
from types import TracebackType
from typing import Any

import attrs

from ..state.atomic import write_atomically
from ..validation import require_int
from ._codec import encode_sample

__all__ = ["INDEX", "ShardInfo", "ShardWriter"]

INDEX = "index.json"
FORMAT = "energy_loader.shards"
VERSION = 1
MAGIC = b"ELSHARD1"
COMPRESSIONS = (None, "gzip", "zstd")
SUFFIX = {None: "", "gzip": ".gz", "zstd": ".zst"}
DEFAULT_MAX_SHARD_BYTES = 1 << 26  # 64 MiB


@attrs.frozen
class ShardInfo:
    """One shard as listed in ``index.json``."""

    name: str  # the file as stored on the remote (compressed or not)
    samples: int
    bytes: int
    sha256: str  # "" where the format's index has none (MDS, litdata, Megatron): size only
    raw_name: str  # the uncompressed file, as kept in the local cache
    raw_bytes: int
    raw_sha256: str  # "" likewise: the uncompressed size is checked instead


def shard_header_size(count: int) -> int:
    """Bytes before the first record of a shard of ``count`` samples."""
    return len(MAGIC) + 8 + 8 * (count + 1)


def build_shard(records: list[bytes]) -> bytes:
    """The uncompressed shard file holding ``records`` in order."""
    offsets = [shard_header_size(len(records))]
    for record in records:
        offsets.append(offsets[-1] + len(record))
    header = MAGIC + struct.pack(f"<Q{len(offsets)}Q", len(records), *offsets)
    return header + b"".join(records)


def compress(data: bytes, compression: str | None) -> bytes:
    """``data`` compressed with ``compression`` (``None``: unchanged)."""
    if compression == "gzip":
        return gzip.compress(data, compresslevel=6, mtime=0)
    if compression == "zstd":
        return zstd_module().ZstdCompressor(level=3).compress(data)
    return data


def zstd_module() -> Any:
    """The ``zstandard`` package, or an ImportError that says how to get it."""
    try:
        import zstandard
    except ImportError:
        raise ImportError(
            "zstd shards need the 'zstandard' package: pip install zstandard "
            "(or use compression='gzip' or None)"
        ) from None
    return zstandard


class ShardWriter:
    """Write samples (dicts, lists, tuples or single values of tensors, arrays, numbers, strings
    and bytes) at ``path`` (local or fsspec) into shards of at most ``max_shard_bytes``
    uncompressed (a larger sample gets a shard of its own); the ``index.json`` is written when
    the ``with`` block ends without an exception, or at :meth:`close`. Example::

        with ShardWriter("data/", max_shard_bytes=1 << 26, compression="zstd") as writer:
            for sample in samples:
                writer.write(sample)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        compression: str | None = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"`path` must be a directory or an fsspec URL (got {path!r})")
        self.max_shard_bytes = require_int(max_shard_bytes, "max_shard_bytes", minimum=1)
        if compression not in COMPRESSIONS:
            raise ValueError(f"`compression` must be one of {COMPRESSIONS} (got {compression!r})")
        if compression == "zstd":
            zstd_module()
        self.compression = compression
        self.url = os.fspath(path)
        import fsspec

        self._fs, self._root = fsspec.core.url_to_fs(self.url)
        if self._fs.exists(self._join(INDEX)):
            raise FileExistsError(
                f"{self._join(INDEX)} exists: {self.url} already holds a sharded dataset; "
                "write to an empty directory"
            )
        self._fs.makedirs(self._root, exist_ok=True)
        self._records: list[bytes] = []
        self._pending_bytes = 0
        self.shards: list[ShardInfo] = []
        self.samples_written = 0
        self._closed = False

    def _join(self, name: str) -> str:
        return f"{self._root.rstrip('/')}/{name}"

    def write(self, sample: Any) -> None:
        """Append one sample (raises ``TypeError`` naming a part that cannot be stored)."""
        if self._closed:
            raise ValueError("this ShardWriter is closed")
        record = encode_sample(sample)
        count = len(self._records)
        grown = shard_header_size(count + 1) + self._pending_bytes + len(record)
        if count and grown > self.max_shard_bytes:
            self._flush()
        self._records.append(record)
        self._pending_bytes += len(record)
        self.samples_written += 1

    def _flush(self) -> None:
        if not self._records:
            return
        raw = build_shard(self._records)
        stored = compress(raw, self.compression)
        raw_name = f"shard-{len(self.shards):05d}.els"
        name = raw_name + SUFFIX[self.compression]
        self._put(name, stored)
        self.shards.append(
            ShardInfo(
                name=name,
                samples=len(self._records),
                bytes=len(stored),
                sha256=hashlib.sha256(stored).hexdigest(),
                raw_name=raw_name,
                raw_bytes=len(raw),
                raw_sha256=hashlib.sha256(raw).hexdigest(),
            )
        )
        self._records = []
        self._pending_bytes = 0

    def _put(self, name: str, data: bytes) -> None:
        """Write one file; atomically (temporary file, fsync, rename) on a local disk."""
        target = self._join(name)
        if not _is_local(self._fs):
            self._fs.pipe_file(target, data)
            return
        write_atomically(target, data)

    def close(self) -> None:
        """Write the last shard and ``index.json``. Idempotent."""
        if self._closed:
            return
        self._flush()
        index = {
            "format": FORMAT,
            "version": VERSION,
            "compression": self.compression,
            "total_samples": self.samples_written,
            "shards": [attrs.asdict(shard) for shard in self.shards],
        }
        self._put(INDEX, json.dumps(index, indent=1).encode())
        self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:
            self._closed = True


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")
