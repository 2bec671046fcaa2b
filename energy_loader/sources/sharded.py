"""ShardedSource: shards on a remote (any fsspec URL or a local directory), listed in its
``index.json`` (:class:`ShardWriter`), read through a local cache filled ahead of the reader.
State: ``{"phase", "epoch", "position"}``; restore key ``(shard, row)``. See
docs/sources/sharded.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any

from ..errors import SourceDataError
from ..state.data_fingerprint import DATA_FIELD, DataFiles
from ._codec import decode_sample
from ._download import LOCKS, Remote, ShardCache, node_lock, parse_json
from ._offset_shards import OffsetShardFile
from ._strided import RestoreShard, ShardRowSource
from .shard_writer import COMPRESSIONS, FORMAT, INDEX, MAGIC, VERSION, ShardInfo, zstd_module

__all__ = ["ShardedSource"]

DEFAULT_PREDOWNLOAD = 1024


class _ShardFile(OffsetShardFile):
    """A ShardWriter shard file (uint64 offsets; decoded tensors are views of its records)."""

    magic, width = MAGIC, 8
    damage = (
        "{where} does not start with {magic!r}",
        "{where} holds {count} samples, index.json says {samples}",
        "{where} is truncated (offset table)",
    )

    def read(self, row: int) -> bytearray:  # type: ignore[override]
        """The bytes of sample ``row`` as a ``bytearray``: tensors decoded from it are writable."""
        start, stop = self._bounds[row], self._bounds[row + 1]
        self.file.seek(start)
        data = bytearray(stop - start)
        if self.file.readinto(data) != stop - start:
            raise SourceDataError(f"{self.where} is truncated (sample {row})")
        return data


def parse_index(data: bytes, where: str) -> tuple[str | None, tuple[ShardInfo, ...]]:
    """The compression and shards of an ``index.json`` (validated; errors name ``where``)."""
    index = parse_json(data, where)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise SourceDataError(f"{where} is not a ShardWriter index (no format {FORMAT!r})")
    if index.get("version") != VERSION:
        raise SourceDataError(
            f"{where} has version {index.get('version')!r}; this release reads {VERSION}"
        )
    compression = index.get("compression")
    if compression not in COMPRESSIONS:
        raise SourceDataError(f"{where}: unknown compression {compression!r}")
    if compression == "zstd":
        zstd_module()
    entries = index.get("shards")
    if not isinstance(entries, list):
        raise SourceDataError(f"{where} has no 'shards' list")
    shards = []
    for number, entry in enumerate(entries):
        try:
            info = ShardInfo(**entry)
        except TypeError:
            raise SourceDataError(
                f"{where}: shards[{number}] must have the fields name, samples, bytes, sha256, "
                f"raw_name, raw_bytes, raw_sha256 (got {entry!r})"
            ) from None
        for field in ("samples", "bytes", "raw_bytes"):
            value = getattr(info, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SourceDataError(f"{where}: shards[{number}].{field} is {value!r}")
        for field in ("name", "raw_name"):
            name = getattr(info, field)
            if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
                raise SourceDataError(f"{where}: shards[{number}].{field} is {name!r}")
        shards.append(info)
    total = index.get("total_samples")
    if total != sum(info.samples for info in shards):
        raise SourceDataError(
            f"{where}: total_samples is {total!r} but the shards hold "
            f"{sum(info.samples for info in shards)} samples"
        )
    return compression, tuple(shards)


class ShardedSource(ShardRowSource):
    """Read ShardWriter shards from a remote (fsspec URL or directory) through the local cache
    directory ``local``, downloading ahead; reader ``s`` of ``S`` reads positions ``s, s + S,
    ...``. Download settings, cache bound and errors: docs/sources/sharded.md. Example::

        source = ShardedSource("s3://bucket/data", "/local/cache", shuffle=True, seed=1234)
    """

    cached = True
    _tuple_keys = False

    def __init__(
        self,
        remote: str | os.PathLike[str],
        local: str | os.PathLike[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        num_canonical_partitions: int | None = None,
        predownload: int = DEFAULT_PREDOWNLOAD,
        cache_limit: int | None = None,
        download_retries: int = 2,
        download_timeout: float = 60.0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(remote, (str, os.PathLike)):
            raise TypeError(f"`remote` must be an fsspec URL or a directory (got {remote!r})")
        if not isinstance(local, (str, os.PathLike)) or "://" in os.fspath(local):
            raise TypeError(f"`local` must be a local directory path (got {local!r})")
        self._set_order(shuffle, seed, num_canonical_partitions)
        self._set_downloads(predownload, cache_limit, download_retries, download_timeout)
        self.remote = Remote(os.fspath(remote), storage_options)
        self.local = Path(local).resolve()
        if "://" not in self.remote.url and Path(self.remote.url).resolve() == self.local:
            raise ValueError(
                f"`local` ({self.local}) must be a cache directory apart from the remote"
            )
        self.compression, self.shards = self._load_index()
        self.total = sum(info.samples for info in self.shards)
        self._require_room(self.shards)
        self._restore: RestoreShard[_ShardFile] = RestoreShard()
        # The shards as index.json lists them (a download checks its size and sha256).
        listed = ((info.name, info.bytes, info.sha256) for info in self.shards)
        self._data_files = DataFiles.listed(listed)

    def _load_index(self) -> tuple[str | None, tuple[ShardInfo, ...]]:
        where = self.remote.where(INDEX)
        try:
            data = self.fetch(self.remote, INDEX)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{where} is missing: the remote must hold a ShardWriter dataset "
                "(index.json plus shards)"
            ) from None
        parsed = parse_index(data, where)
        self.local.mkdir(parents=True, exist_ok=True)
        local_index = self.local / INDEX
        with node_lock(self.local / LOCKS / "index.lock", 60.0, "index"):
            if local_index.exists():
                if local_index.read_bytes() != data:
                    raise SourceDataError(
                        f"the cache directory {self.local} holds the shards of a different "
                        f"index.json than {where}; use another `local` directory or empty it"
                    )
            else:
                temporary = self.local / f".{INDEX}.{os.getpid()}.tmp"
                temporary.write_bytes(data)
                os.replace(temporary, local_index)
        self._index_sha = hashlib.sha256(data).hexdigest()[:16]
        return parsed

    def cache(self) -> ShardCache:
        """This process's view of the local cache (made lazily in each process)."""
        return self._shard_cache(self.remote, self.local, self.shards, compression=self.compression)

    def open_shard(self, shard: int) -> _ShardFile:
        """Open one shard for reading, downloading it first if needed (again, if another process
        evicted it after ``ensure`` found it); once open, an eviction cannot take it away."""
        for _ in range(2):
            with contextlib.suppress(FileNotFoundError):
                return self._ensure_and_open(shard)
        return self._ensure_and_open(shard)

    def _ensure_and_open(self, shard: int) -> _ShardFile:
        path = self.cache().local_path(shard, f"shard {self.shards[shard].name}")
        return _ShardFile(str(path), self.shards[shard].samples, f"shard file {path}")

    # -- protocol --------------------------------------------------------------------------

    def read_row(self, file: _ShardFile, shard: int, row: int) -> Any:
        record = file.read(row)
        try:
            return decode_sample(record)
        except ValueError as error:
            raise SourceDataError(f"{file.where}, sample {row}: {error}") from None

    def _key_scope(self) -> str:
        return self.remote.url

    def data_files(self) -> DataFiles:
        """The shards as index.json lists them (:mod:`energy_loader.state.data_fingerprint`)."""
        return self._data_files

    def _config_fields(self) -> dict[str, Any]:
        return {
            "index": self._index_sha,
            DATA_FIELD: self._data_files.plain,
            "shards": len(self.shards),
            "total_samples": self.total,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "num_canonical_partitions": self.num_canonical_partitions,
        }
