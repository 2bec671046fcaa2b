"""A safe binary encoding of one sample, never unpickled: ``uint32 header_len | JSON header |
padding | buffers`` (16-byte aligned), decoded over the record's own ``bytearray`` without a
copy. See docs/sources/sharded.md.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch

_ALIGN = 16
_HEADER = struct.Struct("<I")
_TAG = "\x00"  # dict keys starting with this mark encoded objects
_TUPLE, _BUFFER = _TAG + "tuple", _TAG + "buf"


def _pad(size: int) -> int:
    return -size % _ALIGN


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list[bytes | memoryview] = []
        self.specs: list[list[Any]] = []
        self.offset = 0

    def add(self, kind: str, dtype: str, shape: list[int], raw: bytes | memoryview) -> Any:
        nbytes = len(raw) if isinstance(raw, bytes) else raw.nbytes
        self.specs.append([kind, dtype, shape, self.offset, nbytes])
        self.buffers.append(raw)
        self.offset += nbytes + _pad(nbytes)
        return {_BUFFER: len(self.specs) - 1}

    def tree(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, np.ndarray):
            dtype = _numpy_dtype(value.dtype, path)
            array = np.ascontiguousarray(value)
            # numpy's stubs declare the buffer protocol only on Python 3.12+
            raw = memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
            return self.add("n", dtype, list(array.shape), raw)
        if isinstance(value, np.generic):
            dtype = _numpy_dtype(value.dtype, path)
            return self.add("s", dtype, [], np.asarray(value).tobytes())
        if isinstance(value, (bytes, bytearray)):
            return self.add("b", "", [len(value)], bytes(value))
        if isinstance(value, tuple):
            return {_TUPLE: [self.tree(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.tree(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            out = {}
            for name, item in value.items():
                if not isinstance(name, str) or name.startswith(_TAG):
                    raise TypeError(
                        f"{path} has the key {name!r}; shard samples need string keys "
                        "that do not start with '\\x00'"
                    )
                out[name] = self.tree(item, f"{path}[{name!r}]")
            return out
        raise TypeError(
            f"{path} is a {type(value).__name__}, which shards cannot store safely; use "
            "tensors, numpy arrays, numbers, strings, bytes, lists, tuples and str-keyed dicts"
        )

    def tensor(self, value: torch.Tensor, path: str) -> Any:
        if value.layout != torch.strided or value.is_quantized:
            raise TypeError(f"{path} is a {value.layout} tensor; shards store dense tensors")
        tensor = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        # numpy's stubs declare the buffer protocol only on Python 3.12+
        return self.add("t", dtype, list(tensor.shape), memoryview(raw))  # type: ignore[arg-type]


def _numpy_dtype(dtype: np.dtype, path: str) -> str:
    if dtype.hasobject or dtype.fields is not None:
        raise TypeError(f"{path} has numpy dtype {dtype}; shards store plain numeric dtypes only")
    return dtype.str


def encode_sample(sample: Any) -> bytes:
    """One sample as bytes (raises ``TypeError`` naming the part that cannot be stored)."""
    encoder = _Encoder()
    tree = encoder.tree(sample, "sample")
    header = json.dumps({"tree": tree, "bufs": encoder.specs}, separators=(",", ":")).encode()
    start = _HEADER.size + len(header)
    parts: list[bytes | memoryview] = [_HEADER.pack(len(header)), header, b"\0" * _pad(start)]
    for raw, (_, _, _, _, nbytes) in zip(encoder.buffers, encoder.specs):
        parts.extend((raw, b"\0" * _pad(nbytes)))
    return b"".join(parts)


def decode_sample(record: bytearray) -> Any:
    """The sample :func:`encode_sample` made; raises ``ValueError`` for a malformed record."""
    try:
        (length,) = _HEADER.unpack_from(record, 0)
        header = json.loads(bytes(record[_HEADER.size : _HEADER.size + length]))
        base = _HEADER.size + length
        base += _pad(base)
        buffers = [_decode_buffer(record, base, spec) for spec in header["bufs"]]
        return _rebuild(header["tree"], buffers)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ValueError(f"malformed sample record ({type(error).__name__}: {error})") from None


def _decode_buffer(record: bytearray, base: int, spec: list[Any]) -> Any:
    kind, dtype, shape, offset, nbytes = spec
    start = base + offset
    if start + nbytes > len(record):
        raise ValueError(f"buffer of {nbytes} bytes at {start} runs past the record end")
    if kind == "b":
        return bytes(record[start : start + nbytes])
    if kind == "t":
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {dtype!r}")
        if nbytes == 0:
            return torch.empty(shape, dtype=torch_dtype)
        raw = torch.frombuffer(record, dtype=torch.uint8, count=nbytes, offset=start)
        return raw.view(torch_dtype).reshape(shape)
    if kind in ("n", "s"):
        numpy_dtype = np.dtype(dtype)
        if numpy_dtype.hasobject:
            raise ValueError(f"object dtype {dtype!r} in a record")
        count = nbytes // numpy_dtype.itemsize if numpy_dtype.itemsize else 0
        array = np.frombuffer(record, dtype=numpy_dtype, count=count, offset=start)
        return array.reshape(shape) if kind == "n" else array.reshape(())[()]
    raise ValueError(f"unknown buffer kind {kind!r}")


def _rebuild(node: Any, buffers: list[Any]) -> Any:
    if isinstance(node, list):
        return [_rebuild(item, buffers) for item in node]
    if isinstance(node, dict):
        if len(node) == 1:
            if _BUFFER in node:
                return buffers[node[_BUFFER]]
            if _TUPLE in node:
                return tuple(_rebuild(item, buffers) for item in node[_TUPLE])
        return {name: _rebuild(item, buffers) for name, item in node.items()}
    return node
