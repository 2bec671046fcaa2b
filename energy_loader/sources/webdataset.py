"""WebDatasetSource: WebDataset tar shards, local or through fsspec, with random access through
per-shard member indexes. State: ``{"phase", "epoch", "position", "skipped"}``; restore key
``(shard, row)``. See docs/sources/webdataset.md.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..dataset import EpochCursor, callable_name
from ..errors import DownloadError, SourceDataError
from ..rng import stable_hash
from ..state.atomic import write_atomically
from ..state.data_fingerprint import DataFiles, relative_names
from ..state.plain import StateReader
from ._download import Remote, ShardCache, list_files, resolve_cache_dir, storage_options_dict
from ._download import is_url as _is_url
from ._strided import RestoreShard, ShardRowCursor, ShardRowSource
from ._tar_index import INDEX_SUFFIX, TarIndex, build_index, check_header, parse_index
from .shard_writer import ShardInfo

__all__ = ["DEFAULT_DECODERS", "WebDatasetSource", "expand_urls"]

LOGGER = logging.getLogger("energy_loader.sources.webdataset")
DEFAULT_PREDOWNLOAD = 1024
ON_ERROR = ("raise", "skip")
_BRACES = re.compile(r"\{(\d+)\.\.(\d+)\}")
_REMEDY = (
    "the shard changed after it was indexed: rebuild the index (python -m energy_loader index)"
)

Decoder = Callable[[bytes], Any]


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _integer(data: bytes) -> int:
    return int(data.decode("utf-8").strip())


def _npy(data: bytes) -> Any:
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


def _torch(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _image(data: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def _default_decoders() -> dict[str, Decoder]:
    decoders: dict[str, Decoder] = {"json": json.loads}
    decoders.update(dict.fromkeys(("txt", "text"), _text))
    decoders.update(dict.fromkeys(("cls", "cls2", "index", "inx", "id", "int"), _integer))
    decoders["npy"] = _npy
    decoders.update(dict.fromkeys(("pt", "pth"), _torch))
    try:
        import PIL.Image  # noqa: F401
    except ImportError:  # images stay bytes without Pillow
        return decoders
    images = ("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "webp", "bmp", "tif", "tiff")
    decoders.update(dict.fromkeys(images, _image))
    return decoders


#: The decoders used with ``decode=True``, by the last part of a member's extension.
DEFAULT_DECODERS: Mapping[str, Decoder] = _default_decoders()


def expand_urls(pattern: str) -> list[str]:
    """Expand WebDataset's numeric brace ranges: ``shard-{000..002}.tar`` -> three names."""
    match = _BRACES.search(pattern)
    if match is None:
        return [pattern]
    first, last = match.group(1), match.group(2)
    width = len(first) if first.startswith("0") else 0
    out = []
    for number in range(int(first), int(last) + 1):
        head = pattern[: match.start()] + str(number).zfill(width)
        out += [head + tail for tail in expand_urls(pattern[match.end() :])]
    return out


def _list_shards(location: str, storage_options: dict[str, Any]) -> list[str]:
    """The ``.tar`` files of a directory (local or fsspec URL), sorted by name."""
    missing, empty = "is neither a .tar shard nor a directory of shards", "holds no .tar shards"
    return list_files(location, storage_options, (".tar",), missing, empty)


def _flat(name: str) -> str:
    return name.replace("/", "__")


class _TarFile:
    """One shard opened for random access: its index and the local file."""

    def __init__(self, path: str, index: TarIndex, where: str) -> None:
        self.where = where
        self.index = index
        size = os.path.getsize(path)
        if size != index.bytes:
            raise SourceDataError(
                f"{where} has {size} bytes but had {index.bytes} when it was indexed: it is "
                f"truncated or was rewritten; {_REMEDY}"
            )
        self.file = open(path, "rb")  # noqa: SIM115 (closed by close())

    def read(self, row: int) -> dict[str, Any]:
        """The raw sample ``row``: ``{"__key__": key, extension: bytes, ...}``."""
        index = self.index
        key = index.keys[row]
        members = index.members[row]
        start, stop = index.span(row)
        where = f"{self.where}, sample {row} (key {key!r})"
        self.file.seek(start)
        data = self.file.read(stop - start)
        if len(data) != stop - start:
            raise SourceDataError(f"{where} is truncated")
        sample: dict[str, Any] = {"__key__": key}
        view = memoryview(data)
        for i in range(0, len(members), 4):
            extension, header, offset, size = members[i : i + 4]
            block = bytes(view[header - start : header - start + 512])
            check_header(block, f"{key}.{extension}", where)
            sample[extension] = bytes(view[offset - start : offset - start + size])
        return sample

    def close(self) -> None:
        self.file.close()


class _WebDatasetCursor(ShardRowCursor):
    dataset: WebDatasetSource

    def __init__(self, dataset: WebDatasetSource) -> None:
        super().__init__(dataset)
        self.skipped = 0

    def on_damage(self) -> Callable[[int, int, SourceDataError], None] | None:
        return self._skip if self.dataset.on_error == "skip" else None

    def _skip(self, shard: int, row: int, error: SourceDataError) -> None:
        self.skipped += 1
        LOGGER.warning("skipped sample (%d, %d) (%d so far): %s", shard, row, self.skipped, error)

    def fields(self) -> dict[str, Any]:
        return {**super().fields(), "skipped": self.skipped}

    def load_fields(self, reader: StateReader) -> None:
        super().load_fields(reader)
        self.skipped = reader.int("skipped")


class WebDatasetSource(ShardRowSource):
    """Read WebDataset tar shards (a directory, a shard, a brace pattern or a list; local or
    any fsspec URL) with shuffle and exact resume, as ``{"__key__": key, extension: value}``.
    ``decode`` (:data:`DEFAULT_DECODERS`, a mapping, a function), member indexes, downloads and
    ``on_error="skip"``: docs/sources/webdataset.md. Example::

        source = WebDatasetSource("/data/train", shuffle=True, seed=1234)
    """

    def __init__(
        self,
        urls_or_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        shuffle: bool = False,
        seed: int = 0,
        num_canonical_partitions: int | None = None,
        decode: bool | Mapping[str, Decoder | None] | Callable[[dict[str, Any]], Any] = True,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        predownload: int = DEFAULT_PREDOWNLOAD,
        cache_limit: int | None = None,
        download_retries: int = 2,
        download_timeout: float = 60.0,
        on_error: str = "raise",
    ) -> None:
        super().__init__()
        self._set_order(shuffle, seed, num_canonical_partitions)
        self._set_downloads(predownload, cache_limit, download_retries, download_timeout)
        if on_error not in ON_ERROR:
            raise ValueError(f"`on_error` must be one of {ON_ERROR} (got {on_error!r})")
        self.on_error = on_error
        self.storage_options = storage_options_dict(storage_options)
        self._set_decoders(decode)
        urls = self._resolve(urls_or_dir)
        self.remote: Remote | None = None
        if _is_url(urls[0]):
            base = posixpath.commonpath([posixpath.dirname(u.split("://", 1)[1]) for u in urls])
            protocol = urls[0].split("://", 1)[0]
            self.remote = Remote(f"{protocol}://{base}", self.storage_options)
            names = [u.split("://", 1)[1][len(base) :].lstrip("/") for u in urls]
            location = self.remote.url
        else:
            names = urls
            location = os.path.commonpath(urls)
        self.cached = self.remote is not None
        self.urls = tuple(urls)
        self.names = tuple(names)
        self.cache_dir = resolve_cache_dir(cache_dir, "webdataset", location)
        self._index_files: list[str] = []
        infos = []
        for number, name in enumerate(self.names):
            index, index_file = self._load_index(number)
            self._index_files.append(index_file)
            raw_name = _flat(name) if self.remote is not None else name
            size, sha256 = index.bytes, index.sha256
            infos.append(ShardInfo(name, index.samples, size, sha256, raw_name, size, sha256))
        self.shards = tuple(infos)
        self.total = sum(info.samples for info in self.shards)
        self._fingerprint = stable_hash(*(info.sha256 for info in self.shards))
        self._data_files: DataFiles | None = None
        self._indexes: dict[int, TarIndex] = {}
        self._restore: RestoreShard[_TarFile] = RestoreShard()

    # -- construction helpers ------------------------------------------------------------------

    def _set_decoders(self, decode: Any) -> None:
        self._decode_fn: Callable[[dict[str, Any]], Any] | None = None
        self._decoders: dict[str, Decoder] = {}
        if isinstance(decode, bool):
            self._decoders = dict(DEFAULT_DECODERS) if decode else {}
            self._decode_name: Any = decode
        elif isinstance(decode, Mapping):
            self._decoders = dict(DEFAULT_DECODERS)
            for extension, fn in decode.items():
                if not isinstance(extension, str) or (fn is not None and not callable(fn)):
                    raise TypeError(
                        "`decode` as a mapping is {extension: fn(bytes) -> value or None} "
                        f"(got {extension!r}: {fn!r})"
                    )
                if fn is None:
                    self._decoders.pop(extension, None)
                else:
                    self._decoders[extension] = fn
            self._decode_name = {k: callable_name(v) for k, v in self._decoders.items()}
        elif callable(decode):
            self._decode_fn = decode
            self._decode_name = callable_name(decode)
        else:
            raise TypeError(
                "`decode` must be True, False, a mapping {extension: fn(bytes)} or a function "
                f"of the raw sample dict (got {decode!r})"
            )

    def _resolve(self, urls_or_dir: Any) -> list[str]:
        if isinstance(urls_or_dir, (str, os.PathLike)):
            location = os.fspath(urls_or_dir)
            if _BRACES.search(location):
                urls = expand_urls(location)
            else:
                urls = _list_shards(location, self.storage_options)
        elif isinstance(urls_or_dir, Sequence) and urls_or_dir:
            urls = []
            for url in urls_or_dir:
                if not isinstance(url, (str, os.PathLike)):
                    raise TypeError(f"shard locations must be paths or URLs (got {url!r})")
                urls.append(os.fspath(url))
        else:
            raise TypeError(
                "`urls_or_dir` must be a directory, a shard, a brace pattern or a non-empty list "
                f"of shards (got {urls_or_dir!r})"
            )
        protocols = {u.split("://", 1)[0] if _is_url(u) else "" for u in urls}
        if len(protocols) > 1:
            raise ValueError(
                f"all shards must be local or share one fsspec protocol (got {sorted(protocols)})"
            )
        if not _is_url(urls[0]):
            urls = [str(Path(u).resolve()) for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError("`urls_or_dir` lists a shard more than once")
        return urls

    def data_files(self) -> DataFiles:
        """The tars: local ones sampled, remote ones by their indexes' sizes and sha256."""
        if self._data_files is None:
            if self.remote is None:
                self._data_files = DataFiles.local(*relative_names(self.urls))
            else:
                listed = ((info.name, info.bytes, info.sha256) for info in self.shards)
                self._data_files = DataFiles.listed(listed)
        return self._data_files

    def where(self, shard: int) -> str:
        """The shard's location (for messages)."""
        return self.urls[shard]

    def _load_index(self, shard: int) -> tuple[TarIndex, str]:
        """The shard's index and the local file it can be re-read from (built if missing)."""
        where = self.urls[shard]
        cached = self.cache_dir / "indexes" / (_flat(self.names[shard].lstrip("/")) + INDEX_SUFFIX)
        if self.remote is None:
            beside = Path(where + INDEX_SUFFIX)
            for candidate in (beside, cached):
                if candidate.exists():
                    index = parse_index(candidate.read_bytes(), str(candidate))
                    size = os.path.getsize(where)
                    if size != index.bytes:
                        raise SourceDataError(
                            f"{where} has {size} bytes but had {index.bytes} when it was "
                            f"indexed ({candidate}): {_REMEDY}"
                        )
                    return index, str(candidate)
            with open(where, "rb") as file:
                data = build_index(file, Path(where).name, where)
            target = beside
            try:
                write_atomically(beside, json.dumps(data).encode())
            except OSError:
                target = cached
                write_atomically(cached, json.dumps(data).encode())
            LOGGER.info("indexed %s (%d samples) into %s", where, data["samples"], target)
            return TarIndex(data), str(target)
        remote = self.remote
        name = self.names[shard]
        if cached.exists():
            return parse_index(cached.read_bytes(), str(cached)), str(cached)
        try:
            raw = self.fetch(remote, name + INDEX_SUFFIX)
            index = parse_index(raw, where + INDEX_SUFFIX)
        except FileNotFoundError:
            try:
                with remote.open(name) as file:
                    data = build_index(file, posixpath.basename(name), where)
            except FileNotFoundError:
                raise FileNotFoundError(f"shard {where} does not exist") from None
            except OSError as error:
                raise DownloadError(f"cannot read {where} to index it: {error}") from error
            index, raw = TarIndex(data), json.dumps(data).encode()
            LOGGER.info("indexed %s (%d samples) into %s", where, index.samples, cached)
        write_atomically(cached, raw)  # the index file as fetched or built
        return index, str(cached)

    # -- reading -----------------------------------------------------------------------------

    def cache(self) -> ShardCache:
        """This process's view of the download cache (remote shards only; made lazily)."""
        if self.remote is None:
            raise RuntimeError("local shards are read in place; there is no download cache")
        return self._shard_cache(
            self.remote, self.cache_dir, self.shards, compression=None, remedy=_REMEDY
        )

    def index(self, shard: int) -> TarIndex:
        """The member index of ``shard`` (re-read lazily in each process, a few kept)."""
        index = self._indexes.get(shard)
        if index is None:
            path = self._index_files[shard]
            index = parse_index(Path(path).read_bytes(), path)
            if index.bytes != self.shards[shard].bytes or index.sha256 != self.shards[shard].sha256:
                raise SourceDataError(f"{path} changed after the source was built: {_REMEDY}")
            if len(self._indexes) >= 8:
                self._indexes.pop(next(iter(self._indexes)))
            self._indexes[shard] = index
        return index

    def open_shard(self, shard: int) -> _TarFile:
        """Open one shard for random access (downloading it first if it is remote)."""
        if self.remote is None:
            path = self.urls[shard]
        else:
            path = str(self.cache().local_path(shard, f"shard {self.urls[shard]}"))
        return _TarFile(path, self.index(shard), self.urls[shard])

    def decode_sample(self, raw: dict[str, Any], shard: int, row: int) -> Any:
        """Decode one raw sample; a decoder failure is a :class:`SourceDataError`."""
        if self._decode_fn is not None:
            try:
                return self._decode_fn(raw)
            except Exception as error:
                raise SourceDataError(
                    f"{self.urls[shard]}, sample {row} (key {raw['__key__']!r}): "
                    f"{callable_name(self._decode_fn)} raised {type(error).__name__}: {error}"
                ) from error
        decoders = self._decoders
        if not decoders:
            return raw
        out: dict[str, Any] = {}
        for extension, value in raw.items():
            decoder = decoders.get(extension.rsplit(".", 1)[-1].lower())
            if decoder is None or extension == "__key__":
                out[extension] = value
                continue
            try:
                out[extension] = decoder(value)
            except Exception as error:
                raise SourceDataError(
                    f"{self.urls[shard]}, sample {row} (key {raw['__key__']!r}): cannot decode "
                    f"member {extension!r}: {type(error).__name__}: {error}"
                ) from error
        return out

    # -- protocol --------------------------------------------------------------------------

    def _new_cursor(self) -> EpochCursor:
        return _WebDatasetCursor(self)

    def read_row(self, file: _TarFile, shard: int, row: int) -> Any:
        return self.decode_sample(file.read(row), shard, row)

    def _config_fields(self) -> dict[str, Any]:
        return {**super()._config_fields(), "decode": self._decode_name, "on_error": self.on_error}

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_indexes": {}}
