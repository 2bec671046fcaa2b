"""The common reader of the shard formats whose files start with an offset table (``uint32
count | uint32 offsets[count + 1] | samples``): MDS and litdata subclass it with their index
parsing and decoding. Order and resume are ShardedSource's, downloads its cache's. State:
``{"phase", "epoch", "position"}``; restore key ``(shard, row)``.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..errors import SourceDataError
from ..rng import stable_hash
from ..state.data_fingerprint import DataFiles, content_entry
from ._download import Remote, ShardCache, resolve_cache_dir
from ._strided import RestoreShard, ShardRowSource
from .shard_writer import ShardInfo

DEFAULT_PREDOWNLOAD = 1024


class OffsetShardFile:
    """One local shard opened for random access: the file, ``magic | count | offsets[count +
    1]`` (little-endian unsigned, ``width`` bytes each), checked, then the samples."""

    magic, width = b"", 4
    #: A short header, a count other than the index's, a short table, a table past the file's
    #: end (fields where, size, samples, magic, count, end; no last: the end is not checked).
    damage: tuple[str, ...] = (
        "{where} is truncated: {size} bytes, no sample count",
        "{where} holds {count} samples, index.json says {samples}: the file is damaged or "
        "belongs to another index",
        "{where} is truncated ({size} bytes): its offset table",
        "{where} is truncated or damaged: {size} bytes, its offset table runs to {end}",
    )

    def __init__(self, path: str, samples: int, where: str) -> None:
        self.where = where
        self.file = open(path, "rb")  # noqa: SIM115 (closed by close())
        try:
            size = os.fstat(self.file.fileno()).st_size
            magic, width, damage = self.magic, self.width, self.damage
            fields = {"where": where, "size": size, "samples": samples, "magic": magic}
            head = self.file.read(len(magic) + width)
            if len(head) != len(magic) + width or not head.startswith(magic):
                raise SourceDataError(damage[0].format(**fields))
            count = int.from_bytes(head[len(magic) :], "little")
            if count != samples:
                raise SourceDataError(damage[1].format(count=count, **fields))
            table = self.file.read(width * (count + 1))
            if len(table) != width * (count + 1):
                raise SourceDataError(damage[2].format(**fields))
            offsets = np.frombuffer(table, dtype=f"<u{width}")
            end = int(offsets[-1])
            if len(damage) > 3 and (end > size or (np.diff(offsets.astype(np.int64)) < 0).any()):
                raise SourceDataError(damage[3].format(end=end, **fields))
            self._bounds: list[int] = offsets.tolist()  # python ints: ~0.3 us a read
        except BaseException:
            self.file.close()
            raise

    def read(self, row: int) -> bytes:
        """The bytes of sample ``row``."""
        start, stop = self._bounds[row], self._bounds[row + 1]
        self.file.seek(start)
        data = self.file.read(stop - start)
        if len(data) != stop - start:
            raise SourceDataError(f"{self.where} is truncated (sample {row})")
        return data

    def close(self) -> None:
        self.file.close()


class OffsetShardSource(ShardRowSource):
    """A directory of offset-table shards listed in an ``index.json`` (see the module
    documentation). Subclasses implement :meth:`parse_index` and :meth:`decode`."""

    #: The format's name in messages and the default cache directory.
    format_name = "shards"

    def __init__(
        self,
        dir_or_url: str | os.PathLike[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        num_canonical_partitions: int | None = None,
        allow_unsafe_types: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        predownload: int = DEFAULT_PREDOWNLOAD,
        cache_limit: int | None = None,
        download_retries: int = 2,
        download_timeout: float = 60.0,
    ) -> None:
        if not isinstance(allow_unsafe_types, bool):
            raise TypeError(f"`allow_unsafe_types` must be a bool (got {allow_unsafe_types!r})")
        super().__init__()
        self.allow_unsafe_types = allow_unsafe_types
        if not isinstance(dir_or_url, (str, os.PathLike)):
            raise TypeError(
                f"`dir_or_url` must be a directory or an fsspec URL holding {self.format_name} "
                f"shards and their index.json (got {dir_or_url!r})"
            )
        self._set_order(shuffle, seed, num_canonical_partitions)
        self._set_downloads(predownload, cache_limit, download_retries, download_timeout)
        self.remote = Remote(os.fspath(dir_or_url), storage_options)
        self.location = self.remote.url
        self.is_local = "://" not in self.location
        self.cache_dir = resolve_cache_dir(cache_dir, self.format_name.lower(), self.location)
        if self.is_local and self.cache_dir == Path(self.location):
            raise ValueError(
                f"`cache_dir` ({self.cache_dir}) must be a directory apart from the dataset"
            )
        where = self.remote.where("index.json")
        try:
            data = self.fetch(self.remote, "index.json")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{where} does not exist: `dir_or_url` must be a {self.format_name} dataset "
                "directory (index.json plus its shards)"
            ) from None
        self.compression, self.shards = self.parse_index(data, where)
        # In the cache every shard is one flat file (an index may name shards in folders).
        self._cached_shards = tuple(
            attrs.evolve(info, raw_name=info.raw_name.replace("/", "__")) for info in self.shards
        )
        self.total = sum(info.samples for info in self.shards)
        # Local uncompressed shards are read where they lie; the rest through the cache.
        self.cached = not self.is_local or self.compression is not None
        if self.cached:
            self._require_room(self.shards)
        self._fingerprint = stable_hash(
            *((info.name, info.samples, info.bytes) for info in self.shards)
        )
        self._index_entry = content_entry("index.json", data)
        self._data_files: DataFiles | None = None
        self._restore: RestoreShard[OffsetShardFile] = RestoreShard()

    # -- what a format defines -------------------------------------------------------------------

    @abstractmethod
    def parse_index(self, data: bytes, where: str) -> tuple[str | None, tuple[ShardInfo, ...]]:
        """The compression (``None``, ``"gzip"``, ``"zstd"`` or ``"bz2"``) and the shards of an
        ``index.json``; a malformed one is a :class:`SourceDataError` naming ``where``."""

    @abstractmethod
    def decode(self, data: bytes, shard: int, row: int) -> Any:
        """One sample from its bytes; damage is a :class:`SourceDataError` naming the shard."""

    # -- reading ---------------------------------------------------------------------------------

    def where(self, shard: int) -> str:
        """The shard's location as stored (for messages)."""
        return self.remote.where(self.shards[shard].name)

    def cache(self) -> ShardCache:
        """This process's view of the download cache (remote or compressed shards only)."""
        if not self.cached:
            raise RuntimeError("local uncompressed shards are read in place; there is no cache")
        return self._shard_cache(
            self.remote,
            self.cache_dir,
            self._cached_shards,
            compression=self.compression,
            remedy=f"the shard does not match the {self.format_name} index.json beside it",
        )

    def open_shard(self, shard: int) -> OffsetShardFile:
        """Open one shard for random access (downloading or decompressing it first if needed)."""
        info = self.shards[shard]
        if not self.cached:
            path = str(Path(self.location) / info.raw_name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"shard {path} listed in index.json does not exist")
            return OffsetShardFile(path, info.samples, path)
        local = self.cache().local_path(shard, f"shard {self.where(shard)}")
        return OffsetShardFile(str(local), info.samples, f"{self.where(shard)} (cached as {local})")

    def data_files(self) -> DataFiles:
        """The shards and index.json: local shards sampled, remote ones by index.json's
        sizes (and sha256 where it has one)."""
        if self._data_files is None:
            if self.is_local:
                names = (info.name for info in self.shards)
                self._data_files = DataFiles.local(self.location, names, self._index_entry)
            else:
                listed = ((info.name, info.bytes, info.sha256) for info in self.shards)
                self._data_files = DataFiles.listed(listed, self._index_entry)
        return self._data_files

    # -- protocol --------------------------------------------------------------------------

    def read_row(self, file: OffsetShardFile, shard: int, row: int) -> Any:
        return self.decode(file.read(row), shard, row)

    def _key_scope(self) -> str:
        return self.location
