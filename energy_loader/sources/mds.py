"""MDSSource: MosaicML Streaming's MDS shards read where they lie, as a savable, elastic source.

Order, downloads and state are :mod:`energy_loader.sources._offset_shards`'; format, encodings
and compressions: docs/sources/mds.md.
"""

from __future__ import annotations

import decimal
import io
import json
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import SourceDataError
from ._download import parse_json
from ._offset_shards import DEFAULT_PREDOWNLOAD, OffsetShardSource
from .shard_writer import ShardInfo

__all__ = ["MDSSource", "raw_pil_image"]

_COMPRESSIONS = {"zstd": "zstd", "gz": "gzip", "bz2": "bz2"}
# ndarray's dynamic dtype byte -> dtype, and shape-size codes (Mosaic's NDArray encoding).
_NDARRAY_DTYPES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
_SCALARS = tuple(_NDARRAY_DTYPES.values())  # the scalar encodings: the same dtypes
_SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")

Decoder = Callable[[bytes], Any]


def raw_pil_image(data: bytes) -> Any:
    """A PIL image stored raw: ``uint32 width, height, mode length | mode | pixels`` (the
    layout of MDS's ``pil`` encoding and of litdata's PIL serializer)."""
    from PIL import Image

    width, height, mode_size = np.frombuffer(data[:12], np.uint32).tolist()
    mode = data[12 : 12 + mode_size].decode("utf-8")
    return Image.frombytes(mode, (width, height), data[12 + mode_size :])


def _image_file(data: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(data))


def _list_of(element: Decoder) -> Decoder:
    def decode(data: bytes) -> list[Any]:
        count = int(np.frombuffer(data[4:8], np.uint32)[0])
        sizes = np.frombuffer(data[8 : 8 + 4 * count], np.uint32).tolist()
        if len(sizes) != count:
            raise ValueError(f"a list of {count} elements holds {len(sizes)} sizes")
        at, out = 8 + 4 * count, []
        for size in sizes:
            out.append(element(data[at : at + size]))
            at += size
        return out

    return decode


def _jpeg_array(data: bytes) -> list[Any]:
    if len(data) < 4:
        raise ValueError("too short to hold a jpeg array")
    count = int(np.frombuffer(data[:4], np.uint32)[0])
    if count <= 0 or len(data) < 4 + 4 * count:
        raise ValueError(f"a jpeg array of {count} images does not fit its {len(data)} bytes")
    sizes = np.frombuffer(data[4 : 4 + 4 * count], np.uint32).tolist()
    at, out = 4 + 4 * count, []
    for size in sizes:
        out.append(_image_file(data[at : at + size]))
        at += size
    return out


def _ndarray(config: str) -> tuple[Decoder, int | None]:
    """The decoder and fixed size of ``ndarray[:dtype[:shape]]``."""
    args = config.split(":") if config else []
    if len(args) > 2 or (args and args[0] not in _NDARRAY_DTYPES.values()):
        raise ValueError(f"ndarray:{config} is not an ndarray encoding Mosaic writes")
    dtype = args[0] if args else None
    shape = tuple(int(dim) for dim in args[1].split(",")) if len(args) == 2 else None

    def decode(data: bytes) -> Any:
        at = 0
        kind = dtype
        if kind is None:
            kind = _NDARRAY_DTYPES[data[0]]
            at = 1
        dims = shape
        if dims is None:
            byte = data[at]
            at += 1
            ndim, code = byte >> 2, byte % 4
            width = ndim * 2**code
            dims = tuple(np.frombuffer(data[at : at + width], _SHAPE_DTYPES[code]).tolist())
            at += width
        return np.frombuffer(data[at:], kind).reshape(dims)

    size = None
    if dtype is not None and shape is not None:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return decode, size


def _scalar(dtype: str) -> Decoder:
    def decode(data: bytes) -> Any:
        return np.frombuffer(data, dtype)[0]

    return decode


_DECODERS: dict[str, Decoder] = {
    "bytes": bytes,
    "str": lambda data: data.decode("utf-8"),
    "int": lambda data: int(np.frombuffer(data, np.int64)[0]),
    "str_int": lambda data: int(data.decode("utf-8")),
    "str_float": lambda data: float(data.decode("utf-8")),
    "str_decimal": lambda data: decimal.Decimal(data.decode("utf-8")),
    "json": lambda data: json.loads(data.decode("utf-8")),
    "pil": raw_pil_image,
    "jpeg": _image_file,
    "png": _image_file,
    "list[pil]": _list_of(raw_pil_image),
    "list[jpeg]": _list_of(_image_file),
    "list[png]": _list_of(_image_file),
    "jpeg_array": _jpeg_array,
    "jpegarray": _jpeg_array,
    **{name: _scalar(name) for name in _SCALARS},
}
_FIXED_SIZES = {"int": 8, **{name: np.dtype(name).itemsize for name in _SCALARS}}


def _decoder(encoding: str, allow_unsafe_types: bool, where: str) -> tuple[Decoder, int | None]:
    """The decoder of a column encoding and the size its values all have (or ``None``)."""
    if encoding == "pkl":
        if not allow_unsafe_types:
            raise SourceDataError(
                f"{where}: a column is pickled ('pkl'), and unpickling runs code from the "
                "data; pass allow_unsafe_types=True if you trust this dataset"
            )
        return pickle.loads, None
    name, _, config = encoding.partition(":")
    if name == "ndarray":
        try:
            return _ndarray(config)
        except ValueError as error:
            raise SourceDataError(f"{where}: {error}") from None
    decoder = _DECODERS.get(encoding)
    if decoder is None:
        known = sorted([*_DECODERS, "ndarray[:dtype[:shape]]", "pkl"])
        raise SourceDataError(
            f"{where}: column encoding {encoding!r} is not one MDSSource decodes; known: {known}"
        )
    return decoder, _FIXED_SIZES.get(encoding)


@attrs.frozen
class _Layout:
    """The columns of one shard: names, decoders, fixed sizes, and which are kept."""

    names: list[str]
    decoders: list[Decoder]
    sizes: list[int | None]
    keep: list[bool]
    variable: int  # how many columns have no fixed size


class MDSSource(OffsetShardSource):
    """Read MosaicML Streaming's MDS shards (local or any fsspec URL) as dict samples of their
    ``columns`` (default: all), decoded as Mosaic decodes them, with a local shuffle and exact,
    elastic resume. Encodings, compressions and downloads: docs/sources/mds.md. Example::

        source = MDSSource("s3://bucket/mds/train", shuffle=True, seed=17, cache_dir="/tmp/mds")
    """

    format_name = "MDS"

    def __init__(
        self,
        dir_or_url: str | os.PathLike[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        num_canonical_partitions: int | None = None,
        columns: Sequence[str] | None = None,
        allow_unsafe_types: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        predownload: int = DEFAULT_PREDOWNLOAD,
        cache_limit: int | None = None,
        download_retries: int = 2,
        download_timeout: float = 60.0,
    ) -> None:
        if columns is not None:
            if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
                raise TypeError(f"`columns` must be a list of column names (got {columns!r})")
            columns = list(columns)
        self.columns = columns
        # Each shard's (names, encodings, fixed sizes), and the decoders made of them (in each
        # process: decoders are functions, the rest plain data).
        self._columns_of: list[tuple[list[str], list[str], list[int | None]]] = []
        self._layouts: dict[int, _Layout] = {}
        super().__init__(
            dir_or_url,
            shuffle=shuffle,
            seed=seed,
            num_canonical_partitions=num_canonical_partitions,
            allow_unsafe_types=allow_unsafe_types,
            cache_dir=cache_dir,
            storage_options=storage_options,
            predownload=predownload,
            cache_limit=cache_limit,
            download_retries=download_retries,
            download_timeout=download_timeout,
        )

    def parse_index(self, data: bytes, where: str) -> tuple[str | None, tuple[ShardInfo, ...]]:
        index = parse_json(data, where)
        entries = index.get("shards") if isinstance(index, dict) else None
        if not isinstance(entries, list) or index.get("version") != 2:
            raise SourceDataError(
                f"{where} is not an MDS index (a version 2 index.json with a 'shards' list, "
                "as streaming's MDSWriter writes)"
            )
        compressions: set[str | None] = set()
        shards = []
        for number, entry in enumerate(entries):
            shard_where = f"{where}: shards[{number}]"
            try:
                shard, compression = self._parse_shard(entry, shard_where)
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                if isinstance(error, SourceDataError):
                    raise
                raise SourceDataError(
                    f"{shard_where} is not an MDS shard entry ({type(error).__name__}: {error})"
                ) from None
            compressions.add(compression)
            shards.append(shard)
        for number, (names, _, _) in enumerate(self._columns_of):
            missing = [name for name in self.columns or () if name not in names]
            if missing:
                raise ValueError(
                    f"`columns` {missing} are not in {where}: shards[{number}] has {names}"
                )
        if len(compressions) > 1:
            raise SourceDataError(
                f"{where} mixes compressions {sorted(map(str, compressions))}; MDSSource reads "
                "datasets whose shards share one"
            )
        return (compressions.pop() if compressions else None), tuple(shards)

    def _parse_shard(self, entry: dict[str, Any], where: str) -> tuple[ShardInfo, str | None]:
        if entry.get("format") != "mds" or entry.get("version") != 2:
            raise SourceDataError(
                f"{where} is a {entry.get('format')!r} shard of version {entry.get('version')!r}; "
                "MDSSource reads MDS version 2 (Mosaic's JSON/CSV shards are not read)"
            )
        names = list(entry["column_names"])
        encodings = list(entry["column_encodings"])
        sizes = list(entry["column_sizes"])
        if not (len(names) == len(encodings) == len(sizes)):
            raise SourceDataError(f"{where} lists columns, encodings and sizes of other lengths")
        for encoding, size in zip(encodings, sizes):
            _, known = _decoder(encoding, self.allow_unsafe_types, where)
            if size and known is not None and size != known:
                raise SourceDataError(f"{where}: column size {size} for encoding {encoding!r}")
        self._columns_of.append((names, encodings, [size or None for size in sizes]))
        raw: dict[str, Any] = entry["raw_data"]
        packed: dict[str, Any] | None = entry.get("zip_data")
        compression = None
        if entry.get("compression"):
            family = str(entry["compression"]).split(":", 1)[0]
            compression = _COMPRESSIONS.get(family)
            if compression is None:
                raise SourceDataError(
                    f"{where} is compressed with {entry['compression']!r}; MDSSource reads "
                    f"{sorted(_COMPRESSIONS)} (rewrite the shards with one of those, or none)"
                )
            if not packed:
                raise SourceDataError(f"{where} is compressed but names no zip_data file")
        stored = packed if compression and packed else raw
        info = ShardInfo(
            name=str(stored["basename"]),
            samples=int(entry["samples"]),
            bytes=int(stored["bytes"]),
            sha256=str((stored.get("hashes") or {}).get("sha256", "")),
            raw_name=str(raw["basename"]),
            raw_bytes=int(raw["bytes"]),
            raw_sha256=str((raw.get("hashes") or {}).get("sha256", "")),
        )
        for name in (info.name, info.raw_name):
            if not name or name.startswith("/") or ".." in name.split("/"):
                raise SourceDataError(f"{where} names the file {name!r}")
        return info, compression

    def _layout(self, shard: int) -> _Layout:
        layout = self._layouts.get(shard)
        if layout is None:
            names, encodings, sizes = self._columns_of[shard]
            where = self.where(shard)
            decoders = [_decoder(e, self.allow_unsafe_types, where)[0] for e in encodings]
            keep = [self.columns is None or name in self.columns for name in names]
            layout = _Layout(names, decoders, sizes, keep, sum(1 for size in sizes if not size))
            self._layouts[shard] = layout
        return layout

    def decode(self, data: bytes, shard: int, row: int) -> dict[str, Any]:
        layout = self._layout(shard)
        try:
            sizes = np.frombuffer(data[: 4 * layout.variable], np.uint32).tolist()
            at = 4 * layout.variable
            variable = iter(sizes)
            sample: dict[str, Any] = {}
            for name, decoder, size, keep in zip(
                layout.names, layout.decoders, layout.sizes, layout.keep
            ):
                length = size or next(variable)
                if at + length > len(data):
                    raise ValueError(f"column {name!r} runs past the sample's end")
                if keep:
                    sample[name] = decoder(data[at : at + length])
                at += length
            return sample
        except Exception as error:
            raise SourceDataError(
                f"{self.where(shard)}, sample {row}: cannot decode ({type(error).__name__}: "
                f"{error})"
            ) from error

    def _config_fields(self) -> dict[str, Any]:
        return {**super()._config_fields(), "columns": self.columns}

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_layouts": {}}
