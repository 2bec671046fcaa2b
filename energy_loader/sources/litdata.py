"""LitDataSource: litdata's optimized chunks read where they lie, as a savable, elastic source.

Order, downloads and state are :mod:`energy_loader.sources._offset_shards`'; format, leaves and
refusals: docs/sources/litdata.md.
"""

from __future__ import annotations

import itertools
import pickle
import struct
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..errors import SourceDataError
from ._download import parse_json
from ._offset_shards import OffsetShardSource
from .mds import raw_pil_image
from .shard_writer import ShardInfo

__all__ = ["LitDataSource"]

# litdata's dtype tables (litdata.constants), by the index its data formats name.
_TORCH_DTYPES = (
    torch.float32,
    torch.float,
    torch.float64,
    torch.double,
    torch.complex64,
    torch.cfloat,
    torch.complex128,
    torch.cdouble,
    torch.float16,
    torch.half,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.short,
    torch.int32,
    torch.int,
    torch.int64,
    torch.long,
    torch.bool,
    torch.uint16,
)
_NUMPY_DTYPES = tuple(
    np.dtype(kind)
    for kind in (
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        bool,
    )
)
_UNREAD = {
    "jpeg": "litdata decodes JPEG leaves with torchvision",
    "jpeg_array": "litdata decodes JPEG leaves with torchvision",
    "json": "litdata's binary JSON leaves are not read",
}

Decoder = Callable[[bytes], Any]


def _table(table: tuple[Any, ...], index: str, what: str) -> Any:
    number = int(index)
    if not 0 <= number < len(table):
        raise ValueError(f"{what} dtype number {number} is not one litdata writes")
    return table[number]


def _numpy(data: bytes) -> np.ndarray:
    dtype = _table(_NUMPY_DTYPES, str(int(np.frombuffer(data[0:4], np.uint32)[0])), "numpy")
    ndim = int(np.frombuffer(data[4:8], np.uint32)[0])
    shape = np.frombuffer(data[8 : 8 + 4 * ndim], np.uint32).tolist()
    return np.frombuffer(data[8 + 4 * ndim :], dtype=dtype).copy().reshape(shape)


def _tensor(data: bytes) -> torch.Tensor:
    number, rank = struct.unpack_from(">II", data, 0)
    dtype = _table(_TORCH_DTYPES, str(number), "tensor")
    shape = struct.unpack_from(f">{rank}I", data, 8)
    values = data[8 + 4 * rank :]
    if not values:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(values), dtype=dtype).reshape(shape)


def _flat_tensor(dtype: torch.dtype) -> Decoder:
    def decode(data: bytes) -> torch.Tensor:
        if not data:
            return torch.empty((0,), dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype)

    return decode


def _flat_numpy(dtype: np.dtype) -> Decoder:
    def decode(data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=dtype).copy()

    return decode


_INT = struct.Struct("<q")
_FLOAT = struct.Struct("<d")
_DECODERS: dict[str, Decoder] = {
    "str": lambda data: data.decode("utf-8"),
    "text": lambda data: data.decode("utf-8"),
    "bool": lambda data: data[0] != 0,
    "int": lambda data: _INT.unpack(data)[0],
    "float": lambda data: _FLOAT.unpack(data)[0],
    "bytes": bytes,
    "numpy": _numpy,
    "tensor": _tensor,
    "pil": raw_pil_image,
}


def _decoder(data_format: str, allow_unsafe_types: bool, where: str) -> Decoder:
    name, _, argument = data_format.partition(":")
    try:
        if name == "no_header_numpy":
            return _flat_numpy(_table(_NUMPY_DTYPES, argument, "numpy"))
        if name == "no_header_tensor":
            return _flat_tensor(_table(_TORCH_DTYPES, argument, "tensor"))
    except ValueError as error:
        raise SourceDataError(f"{where}: data format {data_format!r}: {error}") from None
    if name == "pickle":
        if not allow_unsafe_types:
            raise SourceDataError(
                f"{where}: a leaf is pickled, and unpickling runs code from the data; pass "
                "allow_unsafe_types=True if you trust this dataset"
            )
        return pickle.loads
    decoder = _DECODERS.get(name)
    if decoder is None:
        reason = _UNREAD.get(name, "LitDataSource does not decode it")
        known = sorted([*_DECODERS, "no_header_numpy:<k>", "no_header_tensor:<k>", "pickle"])
        raise SourceDataError(
            f"{where}: data format {data_format!r} is not read ({reason}); LitDataSource reads "
            f"{known}"
        )
    return decoder


def _rebuilder(spec: Any) -> Callable[[Iterator[Any]], Any] | None:
    """A function that rebuilds an item of ``spec`` from an iterator over its leaves, made once
    (torch's ``tree_unflatten`` walks the spec for every item: ~10 us an item of 3 leaves), for
    specs of dicts, tuples and lists; ``None`` for any other node type."""
    if spec.is_leaf():
        return next
    children = [_rebuilder(child) for child in spec.children()]
    if any(child is None for child in children):
        return None
    built: list[Callable[[Iterator[Any]], Any]] = children  # type: ignore[assignment]
    if spec.type is dict:
        keys = list(spec.context)
        return lambda leaves: {key: child(leaves) for key, child in zip(keys, built)}
    if spec.type is tuple:
        return lambda leaves: tuple([child(leaves) for child in built])
    if spec.type is list:
        return lambda leaves: [child(leaves) for child in built]
    return None


class LitDataSource(OffsetShardSource):
    """Read litdata's optimized chunks (local or any fsspec URL) as the items
    ``litdata.StreamingDataset`` returns, with a local shuffle and exact, elastic resume. Decoded
    and refused leaves, downloads: docs/sources/litdata.md. Example::

        source = LitDataSource("s3://bucket/optimized", shuffle=True, seed=3, cache_dir="/tmp/ld")
    """

    format_name = "litdata"
    _formats: tuple[str, ...] = ()
    _spec_text = ""
    # Made from the two above in each process (functions are not sent to workers).
    # (the leaves' decoders, the item header's layout)
    _decoding: tuple[list[Decoder], struct.Struct] | None = None
    _spec: Any = None
    _rebuild: Callable[[Iterator[Any]], Any] | None = None

    def parse_index(self, data: bytes, where: str) -> tuple[str | None, tuple[ShardInfo, ...]]:
        from torch.utils._pytree import treespec_loads

        index = parse_json(data, where)
        config = index.get("config") if isinstance(index, dict) else None
        chunks = index.get("chunks") if isinstance(index, dict) else None
        if not isinstance(config, dict) or not isinstance(chunks, list):
            raise SourceDataError(
                f"{where} is not a litdata index (a 'chunks' list and a 'config', as "
                "litdata.optimize writes)"
            )
        loader = config.get("item_loader", "PyTreeLoader")
        if loader != "PyTreeLoader":
            raise SourceDataError(
                f"{where} was written for litdata's {loader}; LitDataSource reads the default "
                "PyTreeLoader layout"
            )
        for setting in ("compression", "encryption"):
            if config.get(setting):
                raise SourceDataError(
                    f"{where}: the chunks have {setting} {config[setting]!r}, which "
                    "LitDataSource does not read; optimize without it"
                )
        formats = config.get("data_format")
        if not isinstance(formats, list) or not all(isinstance(f, str) for f in formats):
            raise SourceDataError(f"{where}: config.data_format is {formats!r}")
        for data_format in formats:
            _decoder(data_format, self.allow_unsafe_types, where)
        self._formats = tuple(formats)
        try:
            self._spec_text = str(config["data_spec"])
            spec = treespec_loads(self._spec_text)
        except Exception as error:
            raise SourceDataError(
                f"{where}: config.data_spec is not a torch pytree spec ({error})"
            ) from None
        if spec.num_leaves != len(formats):
            raise SourceDataError(
                f"{where}: config.data_spec has {spec.num_leaves} leaves, data_format "
                f"{len(formats)}"
            )
        shards = []
        for number, chunk in enumerate(chunks):
            try:
                name, samples = chunk["filename"], int(chunk["chunk_size"])
                size = int(chunk["chunk_bytes"])
                info = ShardInfo(name, samples, size, "", name, size, "")
            except (KeyError, TypeError, ValueError) as error:
                raise SourceDataError(
                    f"{where}: chunks[{number}] is not a litdata chunk entry "
                    f"({type(error).__name__}: {error})"
                ) from None
            if not isinstance(name, str) or not name or name.startswith("/") or ".." in name:
                raise SourceDataError(f"{where}: chunks[{number}] names the file {name!r}")
            shards.append(info)
        return None, tuple(shards)

    def _prepare_decoding(self) -> tuple[list[Decoder], struct.Struct]:
        """The leaves' decoders, the header's layout and the item's rebuilder, made once a
        process (they are not pickled to the workers)."""
        from torch.utils._pytree import treespec_loads

        where = self.remote.where("index.json")
        decoders = [_decoder(f, self.allow_unsafe_types, where) for f in self._formats]
        self._spec = treespec_loads(self._spec_text)
        self._rebuild = _rebuilder(self._spec)
        self._decoding = decoders, struct.Struct(f"<{len(decoders)}I")
        return self._decoding

    def decode(self, data: bytes, shard: int, row: int) -> Any:
        decoders, header = self._decoding or self._prepare_decoding()
        try:
            ends = list(itertools.accumulate(header.unpack_from(data, 0), initial=header.size))
            if ends[-1] > len(data):
                raise ValueError("a leaf runs past the item's end")
            leaves = [read(data[start:end]) for read, start, end in zip(decoders, ends, ends[1:])]
            if self._rebuild is not None:
                return self._rebuild(iter(leaves))
            from torch.utils._pytree import tree_unflatten

            return tree_unflatten(leaves, self._spec)
        except Exception as error:
            raise SourceDataError(
                f"{self.where(shard)}, item {row}: cannot decode ({type(error).__name__}: {error})"
            ) from error

    def _config_fields(self) -> dict[str, Any]:
        return {**super()._config_fields(), "allow_unsafe_types": self.allow_unsafe_types}

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_decoding": None, "_spec": None, "_rebuild": None}
