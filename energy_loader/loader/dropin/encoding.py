"""Bytes in a drop-in state: base64 strings, read back with the field named in every error.

A torch generator's state (5 KB), and python's or numpy's global RNG state
(:func:`encode_global_state`: the states :mod:`.global_rngs` captures), are stored as base64
strings, so that a state stays JSON and ``torch.load(weights_only=True)`` data. Not here:
what the fields mean (:mod:`.state`).
"""

from __future__ import annotations

import base64
import random
import struct
from typing import Any

import numpy as np
import torch

from ...errors import StateFormatError

# The byte size of a CPU generator's state (mt19937 plus its normal-distribution cache).
GENERATOR_STATE_BYTES = int(torch.Generator().get_state().numel())


def encode_bytes(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def decode_bytes(text: Any, path: str) -> bytes:
    """The bytes of the base64 string ``text`` of field ``path`` (``StateFormatError``)."""
    if not isinstance(text, str):
        raise StateFormatError(f"{path} must be a base64 string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as error:
        raise StateFormatError(f"{path} is not valid base64: {error}") from None


def encode_generator_states(states: list[torch.Tensor]) -> list[str]:
    """Generator states (uint8 tensors) as base64 strings."""
    return [encode_bytes(state.numpy().tobytes()) for state in states]


def decode_generator_states(texts: list[Any], path: str) -> list[torch.Tensor]:
    """The inverse of :func:`encode_generator_states`; raises ``StateFormatError``."""
    out = []
    for index, text in enumerate(texts):
        raw = decode_bytes(text, f"{path}[{index}]")
        if len(raw) != GENERATOR_STATE_BYTES:
            raise StateFormatError(
                f"{path}[{index}] holds {len(raw)} bytes; a torch generator state has "
                f"{GENERATOR_STATE_BYTES} (truncated or not a generator state)"
            )
        out.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return out


NUMPY_WORDS = 624  # numpy's MT19937 key
_NUMPY_BYTES = 4 * NUMPY_WORDS + 16  # key, then pos, has_gauss (uint32) and the gaussian


def _python_bytes(state: Any) -> bytes:
    version, internal, gauss = state
    head = struct.pack("<II", int(version), len(internal))
    words = struct.pack(f"<{len(internal)}I", *internal)
    tail = b"\x00" + bytes(8) if gauss is None else b"\x01" + struct.pack("<d", gauss)
    return head + words + tail


def encode_global_state(name: str, state: Any) -> str:
    """The state of global RNG ``name`` (``"python"``, ``"numpy"``'s legacy tuple, ``"torch"``'s
    byte tensor) as base64."""
    if name == "python":
        raw = _python_bytes(state)
    elif name == "torch":
        return encode_generator_states([state])[0]
    else:
        kind, key, pos, has_gauss, gaussian = state
        if kind != "MT19937":
            raise ValueError(f"numpy's global RNG is a {kind}, not MT19937")
        raw = bytes(np.asarray(key, dtype="<u4").tobytes())
        raw += struct.pack("<IId", int(pos), int(has_gauss), float(gaussian))
    return encode_bytes(raw)


def decode_global_state(name: str, text: Any, path: str) -> Any:
    """The inverse of :func:`encode_global_state` (``StateFormatError`` naming ``path``)."""
    if name == "torch":
        return decode_generator_states([text], path)[0]
    raw = decode_bytes(text, path)
    if name == "numpy":
        if len(raw) != _NUMPY_BYTES:
            raise StateFormatError(
                f"{path} holds {len(raw)} bytes; numpy's global RNG state has {_NUMPY_BYTES}"
            )
        key = np.frombuffer(raw[: 4 * NUMPY_WORDS], dtype="<u4").astype(np.uint32)
        pos, has_gauss, gaussian = struct.unpack("<IId", raw[4 * NUMPY_WORDS :])
        if pos > NUMPY_WORDS:
            raise StateFormatError(f"{path}: position {pos} is past the key's {NUMPY_WORDS}")
        return ("MT19937", key, pos, has_gauss, gaussian)
    if len(raw) < 17 or (len(raw) - 17) % 4:
        raise StateFormatError(f"{path} holds {len(raw)} bytes: not a python random state")
    version, count = struct.unpack("<II", raw[:8])
    if 8 + 4 * count + 9 != len(raw):
        raise StateFormatError(f"{path} holds {len(raw)} bytes, not {count} words and a tail")
    internal = struct.unpack(f"<{count}I", raw[8 : 8 + 4 * count])
    flag, gauss = raw[8 + 4 * count], struct.unpack("<d", raw[-8:])[0]
    state = (version, internal, None if flag == 0 else gauss)
    try:
        random.Random().setstate(state)
    except (ValueError, TypeError) as error:
        raise StateFormatError(f"{path} is not a python random state: {error}") from None
    return state
