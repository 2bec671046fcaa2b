"""Bytes in a drop-in state: base64 strings, read back with the field named in every error.

A torch generator's state (5 KB), and python's or numpy's global RNG state
(:mod:`.global_rngs`), are stored as base64 strings, so that a state stays JSON and
``torch.load(weights_only=True)`` data. Not here: what the fields mean (:mod:`.state`).
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from ...errors import StateFormatError

__all__ = [
    "GENERATOR_STATE_BYTES",
    "decode_bytes",
    "decode_generator_states",
    "encode_bytes",
    "encode_generator_states",
]

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
