"""Short digests that let a restore check the state it was given, and its own result.

A saved state carries digests of its fields (``checks``: a field edited or spliced in from
another save is a ``StateFormatError`` at load) and a *proof*: a digest of what the saving loader
handed out last (each partition's last restore key, the drop-in's last batch's indices; for a
pipeline also that item's values, :func:`content_digest`), which the restore re-makes and compares
before it yields anything new. Digests are of ``repr``s of plain values or a checkpoint's canonical
JSON, so they are the same in every process and run and survive ``json``, ``torch.save`` and DCP
round trips. 64-bit BLAKE2b: a check against accidents and mix-ups, not a signature.
"""

from __future__ import annotations

import collections.abc
import datetime
import decimal
import enum
import fractions
import hashlib
import io
import json
import math
import pathlib
import pickle
import struct
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xxhash

#: Compact JSON as a saved state's leaves hold it (``state_dict()``): no spaces, keys in order.
compact_json = json.JSONEncoder(separators=(",", ":")).encode


def digest(*parts: Any) -> str:
    """A short hex digest of plain values (their ``repr``)."""
    return _hash(repr(parts))


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class CheckpointDigest(str):
    """A checkpoint's digest, holding beside it the checkpoint's :func:`compact_json` (``text``),
    both made in the worker so a save splices ``text`` in; it behaves as the digest string."""

    text: str


def checkpoint_digest(checkpoint: Any) -> str:
    """A digest of a pipeline checkpoint as canonical JSON (lists and tuples alike, keys sorted),
    carrying the compact JSON too (:class:`CheckpointDigest`)."""
    canonical = json.dumps(checkpoint, sort_keys=True, separators=(",", ":"), allow_nan=False)
    value = CheckpointDigest(hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest())
    value.text = compact_json(checkpoint)
    return value


class KeyDigest(str):
    """A restore key's digest as a state saved it (the key itself is not kept)."""

    __slots__ = ()


# The keys whose digests were asked for last, by identity: a save asks again for the same
# key objects (each partition's last item) until new items come.
_RECENT: dict[int, tuple[Any, str]] = {}
_RECENT_SIZE = 256


def key_digest(key: Any) -> str:
    """The digest of one restore key (a batch's: of its samples' keys), as the pipeline made
    it (tuples; the replay that checks it makes the same types)."""
    found = _RECENT.get(id(key))
    if found is not None and found[0] is key:
        return found[1]
    text = _batch_key_repr(key)
    value = digest("key", key) if text is None else _hash(f"('key', {text})")
    if len(_RECENT) >= _RECENT_SIZE:
        _RECENT.clear()
    _RECENT[id(key)] = (key, value)
    return value


def _batch_key_repr(key: Any) -> str | None:
    """``repr(key)`` for a batch's key over an indexed source, a tuple of ``(index,)`` keys,
    built from the indices (~7 us for 32 instead of ~20 us: ``repr`` pays for each inner
    tuple); ``None`` for any other key."""
    if type(key) is not tuple or len(key) < 2:
        return None
    try:
        indices = [index for (index,) in key]
    except (TypeError, ValueError):
        return None
    if all(type(k) is tuple for k in key) and all(type(i) is int for i in indices):
        return "((" + ",), (".join(map(str, indices)) + ",))"
    return None


def last_digest(last: Any) -> str | None:
    """What a state saves of the last item handed out: ``None`` (nothing, or a sample that
    carries no key), a saved :class:`KeyDigest` as it was, or a key's digest."""
    if last is None or isinstance(last, KeyDigest):
        return last
    return key_digest(last)


# -- what an item holds ------------------------------------------------------------------------

#: The entry (or attribute) that carries a sample's restore key
#: (:func:`energy_loader.dataset.attach_restore_key`): not one of the sample's values.
RESTORE_KEY = "__restore_key__"

# How many values of one item :func:`content_digest` reads: elements of arrays and tensors,
# shared out among the parts of a nested item (a dict of two tensors: up to 2,048 elements of
# each). Items of a python sequence or dict cost a python step each: at most 512 of them.
_BUDGET = 4096
_ITEMS = 512
# Characters (or bytes) of a str (or bytes) read per value of the budget: an item's texts are
# read in full up to 64 Ki characters in all, then sampled.
_TEXT_PER_VALUE = 16
_TEXT_PIECES = 64
_DEPTH = 32
_DOUBLE = struct.Struct("<d")
_CHECKSUM = struct.Struct("<QQ")
_SCALARS = frozenset({int, float, bool, type(None)})
# Types whose repr is their value (never an object's address): digested by it.
_BY_REPR: tuple[type, ...] = (complex, datetime.date, datetime.time, datetime.timedelta)
_BY_REPR += (decimal.Decimal, fractions.Fraction, uuid.UUID, pathlib.PurePath, range)

# The dtypes whose CPU tensors numpy reads without a copy (bfloat16 and float8: torch picks).
_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32})
_NUMPY_DTYPES |= {torch.int64, torch.uint16, torch.uint32, torch.uint64, torch.float16}
_NUMPY_DTYPES |= {torch.float32, torch.float64, torch.complex64, torch.complex128}

_Update = Callable[[Any], object]


def content_digest(value: Any) -> str:
    """A short digest of an item's values as the pipeline made it (a sample, or a batch as
    collated), the same in every process and run for equal values; what it reads and cannot see:
    docs/restores.md. Items are digested before the loader attaches their restore key."""
    kind = type(value)
    if (kind is list or kind is tuple) and value and type(value[0]) is np.ndarray:
        arrays = _arrays_digest(value)
        if arrays is not None:
            return arrays
    pickled = _pickled(value)
    if pickled is not None:
        return xxhash.xxh3_64_hexdigest(pickled)  # (starts with the protocol: its own domain)
    hasher = hashlib.blake2b(digest_size=8)
    _feed(hasher.update, value, _BUDGET, 0)
    return hasher.hexdigest()


def _arrays_digest(value: list[Any] | tuple[Any, ...]) -> str | None:
    """A list or tuple of small numpy arrays (documents of tokens batched as a list: a third
    of the cost of pickling them), read in full; ``None`` for any other sequence."""
    hasher, shapes, dtypes = xxhash.xxh3_64(b"L" if type(value) is list else b"U"), [], []
    for array in value:
        if type(array) is not np.ndarray:
            return None
        code = _dtype_code(array.dtype)
        if array.nbytes > _SMALL_ARRAY or not code:
            return None
        try:
            hasher.update(array)  # type: ignore[arg-type]  # (an array is a buffer)
        except ValueError:  # not contiguous: its elements in order
            hasher.update(np.ascontiguousarray(array))  # type: ignore[arg-type]
        shapes.append(array.shape)
        dtypes.append(code)
    hasher.update(f"{shapes!r}{dtypes!r}".encode())  # the layout after the elements
    return hasher.hexdigest()


_DTYPE_CODES: dict[np.dtype[Any], str] = {}


def _dtype_code(dtype: np.dtype[Any]) -> str:
    """``dtype.str`` (~270 ns a call: cached, 60), or ``""`` for a dtype that holds objects."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPE_CODES[dtype] = "" if dtype.hasobject else dtype.str
    return code


# Pickled items larger than this are walked instead (which samples long texts and lists).
_PICKLED_LIMIT = 8 << 20
# Arrays and tensors of at most this many bytes are read in full (a sample's tokens).
_SMALL_ARRAY = 64 << 10


class _Walk(Exception):
    """Raised while pickling an item that :func:`content_digest` walks instead."""


def _leaf(*parts: Any) -> tuple[Any, ...]:
    """What a non-plain value pickles as in :func:`_pickled`: a call of this function on its digest,
    or on a small array's dtype, shape and bytes."""
    return parts


_LEAF_MEMO = {id(_leaf): (0, _leaf)}


class _ValuePickler(pickle.Pickler):
    """Pickles plain python values without the memo (equal values, equal bytes), small arrays and
    tensors as dtype, shape and bytes, anything else as its digest; a set raises :class:`_Walk`."""

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is np.ndarray:
            code = _DTYPE_CODES.get(obj.dtype) or _dtype_code(obj.dtype)  # (inlined: per array)
            if code and obj.nbytes <= _SMALL_ARRAY:
                return _leaf, (code, obj.shape, obj.tobytes())
        elif obj is set or obj is frozenset:  # a set's elements pickle in hash order
            raise _Walk
        elif (
            kind is torch.Tensor
            and obj.is_cpu
            and obj.dtype in _NUMPY_DTYPES
            and obj.layout is torch.strided
            and obj.numel() * obj.element_size() <= _SMALL_ARRAY
        ):
            if obj.requires_grad or obj.is_conj() or obj.is_neg():  # its values, as a copy
                obj = obj.detach().resolve_conj().resolve_neg()
            return _leaf, (str(obj.dtype), tuple(obj.shape), obj.numpy().tobytes())
        hasher = hashlib.blake2b(digest_size=8)
        _feed(hasher.update, obj, _BUDGET, 1)
        return _leaf, (hasher.digest(),)


def _pickled(value: Any) -> bytes | None:
    """``value`` pickled by :class:`_ValuePickler`, or ``None`` where the walk reads it."""
    buffer = io.BytesIO()
    pickler = _ValuePickler(buffer, 3)
    pickler.fast = True  # no memo: the bytes depend on the values, not on shared objects
    # ... but for _leaf, written as a reference to slot 0 (half the cost of each array).
    pickler.memo = _LEAF_MEMO
    try:
        pickler.dump(value)
    except (_Walk, pickle.PicklingError, ValueError, TypeError, RecursionError, RuntimeError):
        return None  # a set, a cycle (fast mode refuses it), a value pickle cannot name
    pickled = buffer.getvalue()
    if len(pickled) > _PICKLED_LIMIT:
        return None
    return pickled


def _feed(update: _Update, value: Any, share: int, depth: int) -> None:
    """Feed ``value`` to ``update``, reading about ``share`` of its elements."""
    kind = type(value)
    if depth >= _DEPTH:  # a container too deep (or holding itself): by its type
        update(b"o" + kind.__qualname__.encode())
    elif kind is dict:
        _feed_mapping(update, value, share, depth)
    elif kind is int:
        update(b"i%x;" % value)
    elif kind is float:
        update(b"f" + _DOUBLE.pack(value))
    elif kind is str:
        _feed_text(update, b"s", value, share)
    elif value is None:
        update(b"N")
    elif kind is bool:
        update(b"T" if value else b"F")
    elif kind is list or kind is tuple:
        _feed_sequence(update, b"l" if kind is list else b"t", value, share, depth)
    elif isinstance(value, torch.Tensor):
        _feed_tensor(update, value, share, depth)
    elif isinstance(value, np.ndarray):
        _feed_array(update, b"A%s" % value.dtype.str.encode(), value, share, depth)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _feed_text(update, b"b", value, share)
    elif isinstance(value, enum.Enum):
        update(b"e" + f"{kind.__qualname__}.{value.name}".encode())
    elif isinstance(value, np.generic):
        _feed_array(update, b"g%s" % value.dtype.str.encode(), np.asarray(value), share, depth)
    elif isinstance(value, (int, float, str)):  # subclasses: the type, then the value
        update(b"<" + kind.__qualname__.encode())
        base = next(t for t in (int, float, str) if isinstance(value, t))
        _feed(update, base(value), share, depth + 1)
    elif isinstance(value, (list, tuple)):  # named tuples, torch.Size, list subclasses
        update(b"<" + kind.__qualname__.encode())
        _feed_sequence(update, b"t", tuple(value), share, depth)
    elif isinstance(value, collections.abc.Mapping):
        update(b"<" + kind.__qualname__.encode())
        _feed_mapping(update, value, share, depth)
    elif isinstance(value, (set, frozenset)):
        _feed_set(update, value, share, depth)
    elif isinstance(value, _BY_REPR):
        update(b"r" + f"{kind.__qualname__}:{value!r}".encode())
    else:
        update(b"o" + kind.__qualname__.encode())


def _feed_mapping(update: _Update, mapping: Any, share: int, depth: int) -> None:
    items = list(mapping.items())
    count = len(items)
    update(b"d%d;" % count)
    if count > _ITEMS:
        items = items[:: -(-count // _ITEMS)]
    child = max(1, share // max(1, len(items)))
    for key, item in items:
        _feed(update, key, child, depth + 1)
        _feed(update, item, child, depth + 1)


def _feed_sequence(update: _Update, tag: bytes, sequence: Any, share: int, depth: int) -> None:
    count = len(sequence)
    update(tag + b"%d;" % count)
    picked = sequence if count <= _ITEMS else sequence[:: -(-count // _ITEMS)]
    if _SCALARS.issuperset(map(type, picked)):
        try:  # ints, floats, bools and Nones: their repr at C speed
            update(repr(picked).encode())
            return
        except ValueError:  # an int too long for repr (sys.set_int_max_str_digits)
            pass
    child = max(1, share // max(1, len(picked)))
    for item in picked:
        _feed(update, item, child, depth + 1)


def _feed_set(update: _Update, value: Any, share: int, depth: int) -> None:
    """A set's elements in the order of their own digests (its iteration order depends on
    the process's string hashing); a set of more than 512 by its size only."""
    count = len(value)
    update(b"S%d;" % count)
    if not count or count > _ITEMS:
        return
    child = max(1, share // count)
    parts = []
    for item in value:
        hasher = hashlib.blake2b(digest_size=8)
        _feed(hasher.update, item, child, depth + 1)
        parts.append(hasher.digest())
    update(b"".join(sorted(parts)))


def _feed_text(update: _Update, tag: bytes, text: Any, share: int) -> None:
    """A str or bytes-like value: in full up to ``share x 16`` characters (at least 256),
    else 64 pieces at an even stride; its length either way."""
    if isinstance(text, memoryview):
        text = text.cast("B") if text.c_contiguous else text.tobytes()
    count = len(text)
    limit = max(256, share * _TEXT_PER_VALUE)
    if count > limit:
        width = limit // _TEXT_PIECES
        stride = count // _TEXT_PIECES
        text = text[:0].join(text[i : i + width] for i in range(0, stride * _TEXT_PIECES, stride))
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    update(tag + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(data), count))


def _stride(count: int, share: int, row: int) -> int:
    """The stride reading at most ``share`` of ``count`` elements, prime to ``row`` so that the
    elements read spread over a row's positions, not one column (224 x 224 images)."""
    stride = -(-count // share)
    while math.gcd(stride, row) != 1:
        stride += 1
    return stride


def _feed_tensor(update: _Update, tensor: torch.Tensor, share: int, depth: int) -> None:
    """A tensor: through numpy where it is on the CPU in a dtype numpy has (no copy); else
    the elements read are picked (and copied to the CPU) by torch."""
    header = b"T" + str(tensor.dtype).encode()
    if (
        tensor.is_cpu
        and not tensor.requires_grad
        and tensor.dtype in _NUMPY_DTYPES
        and tensor.layout is torch.strided
    ):
        try:
            array = tensor.numpy()
        except (TypeError, RuntimeError):  # a conjugate view, a tensor subclass's refusal
            pass
        else:
            _feed_array(update, header, array, share, depth)
            return
    shape = tuple(tensor.shape)
    update(header + repr(shape).encode())
    if (
        tensor.layout is not torch.strided
        or tensor.is_quantized
        or tensor.is_nested
        or tensor.device.type == "meta"
    ):
        return  # elements it cannot read: dtype and shape only
    count = tensor.numel()
    if not count:
        return
    flat = tensor.detach()
    if count <= share:
        picked = flat.reshape(-1)
    else:
        stride = _stride(count, share, count // shape[0] if len(shape) > 1 else 1)
        if flat.is_contiguous():
            picked = flat.view(-1)[::stride]
        else:
            picked = torch.take(flat, torch.arange(0, count, stride, device=flat.device))
    picked = picked.contiguous()
    if picked.is_complex():
        picked = picked.resolve_conj().resolve_neg()
    if picked.device.type != "cpu":
        picked = picked.cpu()
    _feed_elements(update, picked.view(torch.uint8).numpy())


def _feed_array(update: _Update, header: bytes, array: np.ndarray, share: int, depth: int) -> None:
    """``header`` (its kind and dtype), an array's shape and up to ``share`` elements at an
    even stride."""
    update(header + repr(array.shape).encode())
    count = array.size
    if not count:
        return
    if count <= share:
        picked = array.reshape(-1)
    else:
        stride = _stride(count, share, count // array.shape[0] if array.ndim > 1 else 1)
        if array.flags.c_contiguous:
            picked = array.reshape(-1)[::stride]
        else:
            picked = array[np.unravel_index(np.arange(0, count, stride), array.shape)]
    if array.dtype.hasobject:
        _feed_sequence(update, b"t", tuple(picked.tolist()), share, depth)
        return
    _feed_elements(update, np.ascontiguousarray(picked).view(np.uint8))


def _feed_elements(update: _Update, data: np.ndarray) -> None:
    """The bytes of the elements read (a contiguous uint8 array), as their XXH3 and count."""
    update(_CHECKSUM.pack(xxhash.xxh3_64_intdigest(data.data), data.size))
