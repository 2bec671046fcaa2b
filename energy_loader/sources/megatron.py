"""MegatronIndexedSource: Megatron's indexed datasets (``.bin`` + ``.idx``) read where they lie,
one document a sample, with a local shuffle and exact, elastic resume. State: ``{"phase",
"epoch", "position"}``; restore key ``(document,)``. See docs/sources/megatron.md.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..dataset import EpochCursor, Key
from ..errors import SourceDataError
from ..rng import stable_hash
from ..state.data_fingerprint import DATA_FIELD, DataFiles, content_entry
from ..validation import require_int
from ._download import Downloads, Remote, ShardCache, resolve_cache_dir, storage_options_dict
from ._order import EpochOrder
from ._strided import PrefetchingCursor, StridedSource
from .shard_writer import ShardInfo

__all__ = ["MegatronIndexedSource", "read_megatron_index"]

HEADER = b"MMIDIDX\x00\x00"
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
DEFAULT_PREDOWNLOAD = 1024
DEFAULT_BLOCK_DOCUMENTS = 1024
_FIXED = struct.Struct("<QBQQ")


class MegatronIndex:
    """The parsed ``.idx``: dtype, per-sequence lengths (tokens) and byte pointers."""

    def __init__(self, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray) -> None:
        self.dtype = dtype
        self.lengths = lengths
        self.pointers = pointers
        #: Bytes the ``.bin`` must hold at least: the end of its furthest sequence.
        self.bin_bytes = (
            int((pointers + lengths.astype(np.int64) * dtype.itemsize).max()) if len(lengths) else 0
        )


def read_megatron_index(data: bytes | memoryview, where: str) -> MegatronIndex:
    """Parse an ``.idx`` file's bytes (format: docs/sources/megatron.md); errors name ``where``."""
    view = memoryview(data)
    head = len(HEADER) + _FIXED.size
    if len(view) < head or bytes(view[: len(HEADER)]) != HEADER:
        raise SourceDataError(
            f"{where} is not a Megatron index: it does not start with {HEADER!r} "
            "(an MMIDIDX .idx written by megatron-core's IndexedDatasetBuilder)"
        )
    version, code, sequences, documents = _FIXED.unpack_from(view, len(HEADER))
    if version != 1:
        raise SourceDataError(f"{where} has index version {version}; this release reads 1")
    if code not in DTYPES:
        raise SourceDataError(
            f"{where} names dtype code {code}; known codes are {sorted(DTYPES)} ({DTYPES})"
        )
    need = head + sequences * 12 + documents * 8
    if len(view) < need:
        raise SourceDataError(
            f"{where} is truncated: {len(view)} bytes, its header announces {sequences} "
            f"sequences and {documents} document indices ({need} bytes)"
        )
    lengths = np.frombuffer(view, dtype="<i4", count=sequences, offset=head)
    pointers = np.frombuffer(view, dtype="<i8", count=sequences, offset=head + 4 * sequences)
    dtype = np.dtype(DTYPES[code])
    if sequences and (lengths.min() < 0 or pointers.min() < 0 or (pointers % dtype.itemsize).any()):
        raise SourceDataError(
            f"{where} is damaged: it holds negative sequence lengths or pointers, or pointers "
            f"that are not multiples of its dtype's size ({dtype})"
        )
    return MegatronIndex(dtype, lengths, pointers)


class _MegatronCursor(PrefetchingCursor):
    dataset: MegatronIndexedSource

    def resume(self) -> Iterator[tuple[Key, Any]]:
        source = self.dataset
        stride, start = source.context.num_shards, source.context.shard_index
        order = source.epoch_order(self.epoch)
        predownload = source.predownload if source.remote is not None else 0
        block = source.block_documents
        with self.prefetching(order, predownload, source.cache, lambda unit: 0) as progress:
            tokens = source.tokens()
            lengths, pointers, itemsize = source.lengths, source.pointers, source.dtype.itemsize
            for units, rows in order.blocks(self.position, stride):
                documents = units * block + rows
                firsts = (pointers[documents] // itemsize).tolist()
                counts = lengths[documents].tolist()
                for document, first, count in zip(documents.tolist(), firsts, counts):
                    sample = {"tokens": np.array(tokens[first : first + count]), "index": document}
                    self.position += stride
                    progress.step = (self.position - start) // stride
                    yield (document,), sample


class MegatronIndexedSource(Downloads, StridedSource):
    """Read a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``, either suffix
    accepted, local or fsspec), one document a sample: ``{"tokens": <1-D array>, "index": n}``.
    Blocks, downloads and packing: docs/sources/megatron.md. Example::

        source = MegatronIndexedSource("/data/pile/pile_text_document", shuffle=True, seed=1)
    """

    def __init__(
        self,
        path_prefix: str | os.PathLike[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        num_canonical_partitions: int | None = None,
        block_documents: int = DEFAULT_BLOCK_DOCUMENTS,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        predownload: int = DEFAULT_PREDOWNLOAD,
        cache_limit: int | None = None,
        download_retries: int = 2,
        download_timeout: float = 600.0,
    ) -> None:
        super().__init__()
        if not isinstance(path_prefix, (str, os.PathLike)):
            raise TypeError(
                "`path_prefix` must be the path or fsspec URL of a Megatron dataset without "
                f"its .bin/.idx suffix (got {path_prefix!r})"
            )
        self._set_order(shuffle, seed, num_canonical_partitions)
        self.block_documents = require_int(block_documents, "block_documents", minimum=1)
        self._set_downloads(predownload, cache_limit, download_retries, download_timeout)
        prefix = os.fspath(path_prefix)
        prefix = prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix
        self.remote: Remote | None = None
        if "://" in prefix:
            base, name = prefix.rsplit("/", 1)
            self.remote = Remote(base, storage_options)
            self.prefix = prefix
            self._name = name
        else:
            storage_options_dict(storage_options)  # checked, though unused
            self.prefix = str(Path(prefix).resolve())
            self._name = Path(self.prefix).name
        self.cache_dir = resolve_cache_dir(cache_dir, "megatron", self.prefix)
        self.idx_where = self.prefix + ".idx"
        self.bin_where = self.prefix + ".bin"
        index_bytes = self._index_bytes()
        index = read_megatron_index(index_bytes, self.idx_where)
        self._idx_entry = content_entry(self._name + ".idx", index_bytes)
        self._data_files: DataFiles | None = None
        self.dtype = index.dtype
        self.lengths = index.lengths
        self.pointers = index.pointers
        self.total = len(index.lengths)
        self._bin_bytes = index.bin_bytes
        self._shard = self._bin_info()
        if self.remote is None:
            self._bin_size(lambda: os.path.getsize(self.bin_where))
        elif self.cache_limit is not None and self.cache_limit < self._shard.raw_bytes:
            raise ValueError(
                f"`cache_limit` ({self.cache_limit} bytes) must hold {self.bin_where} "
                f"({self._shard.raw_bytes} bytes)"
            )
        self._fingerprint = stable_hash(self._shard.bytes, self.total, str(self.dtype))
        self._tokens: np.ndarray | None = None
        self._tokens_pid = -1

    # -- construction helpers ------------------------------------------------------------------

    def _index_bytes(self) -> bytes:
        if self.remote is None:
            try:
                return Path(self.idx_where).read_bytes()
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"{self.idx_where} does not exist: `path_prefix` must name a Megatron "
                    "dataset's files without suffix (<prefix>.bin and <prefix>.idx)"
                ) from None
        try:
            return self.fetch(self.remote, self._name + ".idx")
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.idx_where} does not exist") from None

    def _bin_info(self) -> ShardInfo:
        """The ``.bin`` as the one shard of the download cache (size checked, no hash)."""
        if self.remote is None:
            size = self._bin_bytes
        else:
            fs, root = self.remote.filesystem()
            path = f"{root.rstrip('/')}/{self._name}.bin"
            size = self._bin_size(lambda: int(fs.size(path)))
        name = self._name + ".bin"
        return ShardInfo(name, self.total, size, "", name, size, "")

    def data_files(self) -> DataFiles:
        """The ``.idx`` and the ``.bin``: sampled where local, the remote ``.bin`` by size."""
        if self._data_files is None:
            if self.remote is None:
                folder = Path(self.prefix).parent
                self._data_files = DataFiles.local(folder, [self._shard.name], self._idx_entry)
            else:
                listed = [(self._shard.name, self._shard.bytes, "")]
                self._data_files = DataFiles.listed(listed, self._idx_entry)
        return self._data_files

    def _bin_size(self, size_of: Callable[[], int]) -> int:
        """The ``.bin``'s size by ``size_of()``, checked to reach the end of its last document."""
        try:
            size = size_of()
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.bin_where} does not exist") from None
        if size < self._bin_bytes:
            raise SourceDataError(
                f"{self.bin_where} is truncated: {size} bytes, its index {self.idx_where} needs "
                f"{self._bin_bytes} (the end of its last document)"
            )
        return size

    # -- reading -------------------------------------------------------------------------------

    def epoch_order(self, epoch: int, partitions: int | None = None) -> EpochOrder:
        """The global order of ``epoch`` over the blocks of documents."""
        block, total = self.block_documents, self.total
        sizes = [min(block, total - first) for first in range(0, total, block)]
        return self._order_of(sizes, epoch, partitions)

    def global_order(self, epoch: int, partitions: int | None = None) -> list[int]:
        """The epoch's documents in global order (for tests and audits: O(N))."""
        order = self.epoch_order(epoch, partitions)
        return [unit * self.block_documents + row for unit, row in order.walk(0, 1)]

    def cache(self) -> ShardCache:
        """This process's view of the download cache (remote datasets only; made lazily)."""
        if self.remote is None:
            raise RuntimeError("a local dataset is read in place; there is no download cache")
        return self._shard_cache(
            self.remote,
            self.cache_dir,
            (self._shard,),
            compression=None,
            remedy="the remote .bin does not match its .idx",
        )

    def tokens(self) -> np.ndarray:
        """This process's memory map of the ``.bin`` as a flat array of its dtype."""
        if self._tokens is None or self._tokens_pid != os.getpid():
            if self.remote is None:
                path = self.bin_where
            else:
                path = str(self.cache().local_path(0, self.bin_where))
            self._bin_size(lambda: os.path.getsize(path))
            count = self._bin_bytes // self.dtype.itemsize
            if count:
                # A plain ndarray over the map: slicing an np.memmap costs ~5 us more a document.
                mapped = np.memmap(path, dtype=self.dtype, mode="r", shape=(count,))
                self._tokens = mapped.view(np.ndarray)
            else:
                self._tokens = np.zeros(0, dtype=self.dtype)
            self._tokens_pid = os.getpid()
        return self._tokens

    # -- protocol --------------------------------------------------------------------------

    def _new_cursor(self) -> EpochCursor:
        return _MegatronCursor(self)

    def validate_key(self, key: Key) -> None:
        if (
            isinstance(key, tuple)
            and len(key) == 1
            and isinstance(key[0], int)
            and not isinstance(key[0], bool)
            and 0 <= key[0] < self.total
        ):
            return
        raise ValueError(
            f"MegatronIndexedSource restore keys are (document,) with 0 <= document < "
            f"{self.total}; got {key!r}"
        )

    def restore_sample(self, key: Key) -> Any:
        self.validate_key(key)
        (document,) = key
        first = int(self.pointers[document]) // self.dtype.itemsize
        count = int(self.lengths[document])
        return {"tokens": np.array(self.tokens()[first : first + count]), "index": document}

    def can_restore_sample(self) -> bool:
        return True

    def _config_fields(self) -> dict[str, Any]:
        return {
            "documents": self.total,
            "dtype": str(self.dtype),
            "fingerprint": self._fingerprint,
            DATA_FIELD: self.data_files().plain,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "block_documents": self.block_documents,
            "num_canonical_partitions": self.num_canonical_partitions,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_tokens": None, "_tokens_pid": -1}
