"""The drop-in loader's saved state: plain data, its own format name and version.

Layout (format version 1)::

    {
      "format": "energy_loader.dropin_state", "version": 1,
      "kind": "map" | "iterable",
      "rank": 0, "world_size": 1,
      "config": {...},            # what must match on restore (dataset, sampler, batching)
      # map-style:
      "started": true,            # false: saved before the first epoch began
      "epoch": 3,                 # the epoch the position is in (0-based)
      "used": 17,                 # batches (index-sampler units) of it handed out
      "epoch_seed": 123,          # per-sample seeds of that epoch
      "rng": ["<base64>", ...] | null,      # the sampler's generators at its first pull
      "rng_at_iter": [...] | null,          # ... when iter(sampler) itself drew
      "sampler_state": {...} | null,        # a Stateful sampler's own state_dict()
      # iterable:
      "pipeline": {...}           # the rank state of the pipeline it runs (rank_state format)
    }

A torch ``Generator`` state is a 5 KB byte tensor; it is stored as a base64 string, built once
per epoch (not per save). Nothing is pickled: the state passes ``json.dumps`` when the
sampler's own state does, and ``torch.load(weights_only=True)`` always.
"""

from __future__ import annotations

import base64
from typing import Any

import attrs
import torch

from ...errors import StateFormatError, StateMismatchError
from ...state.plain import StateReader

__all__ = [
    "DROPIN_STATE_FORMAT",
    "DROPIN_STATE_VERSION",
    "MapState",
    "decode_generator_states",
    "encode_generator_states",
    "read_header",
]

DROPIN_STATE_FORMAT = "energy_loader.dropin_state"
DROPIN_STATE_VERSION = 1


def encode_generator_states(states: list[torch.Tensor]) -> list[str]:
    """Generator states (uint8 tensors) as base64 strings."""
    return [base64.b64encode(state.numpy().tobytes()).decode("ascii") for state in states]


def decode_generator_states(texts: list[Any], path: str) -> list[torch.Tensor]:
    """The inverse of :func:`encode_generator_states`; raises ``StateFormatError``."""
    out = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise StateFormatError(f"{path}[{index}] must be a base64 string")
        try:
            raw = base64.b64decode(text.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError) as error:
            raise StateFormatError(f"{path}[{index}] is not valid base64: {error}") from None
        out.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return out


def read_header(state: Any, kind: str) -> StateReader:
    """Check format, version and kind; the reader of the whole state."""
    reader = StateReader(state, "state")
    if not reader.has("format"):
        raise StateFormatError("state has no 'format' field: not a loader state from energy_loader")
    found = reader.raw("format")
    if found != DROPIN_STATE_FORMAT:
        if found == "energy_loader.rank_state":
            raise StateMismatchError(
                "the state was saved by a loader over a savable pipeline; this loader runs a "
                "plain dataset as a drop-in (pass the same kind of dataset the state was saved "
                "with)"
            )
        raise StateFormatError(
            f"state.format is {found!r}; expected {DROPIN_STATE_FORMAT!r} (a drop-in state)"
        )
    version = reader.int("version")
    if version != DROPIN_STATE_VERSION:
        raise StateFormatError(
            f"state.version is {version}; this release reads version {DROPIN_STATE_VERSION} "
            "(a state from a newer or older release?)"
        )
    saved_kind = reader.str("kind", choices=("map", "iterable"))
    if saved_kind != kind:
        raise StateMismatchError(
            f"the state was saved by a drop-in loader over a {saved_kind}-style dataset; this "
            f"one runs a {kind}-style dataset"
        )
    return reader


def check_config(saved: Any, now: dict[str, Any]) -> None:
    """Raise ``StateMismatchError`` naming every field of ``now`` the saved config differs in."""
    if not isinstance(saved, dict):
        raise StateFormatError("state.config must be a dict")
    differences = [
        f"{name}: saved {saved.get(name)!r}, now {value!r}"
        for name, value in now.items()
        if saved.get(name) != value
    ]
    if differences:
        raise StateMismatchError(
            "the state belongs to another dataset or sampling setup: " + "; ".join(differences)
        )


@attrs.frozen
class MapState:
    """A map-style drop-in loader's position (see the module docstring)."""

    rank: int
    world_size: int
    config: dict[str, Any]
    started: bool
    epoch: int
    used: int
    epoch_seed: int
    rng: list[str] | None
    rng_at_iter: list[str] | None
    sampler_state: Any

    def to_plain(self) -> dict[str, Any]:
        return {
            "format": DROPIN_STATE_FORMAT,
            "version": DROPIN_STATE_VERSION,
            "kind": "map",
            "rank": self.rank,
            "world_size": self.world_size,
            "config": self.config,
            "started": self.started,
            "epoch": self.epoch,
            "used": self.used,
            "epoch_seed": self.epoch_seed,
            "rng": self.rng,
            "rng_at_iter": self.rng_at_iter,
            "sampler_state": self.sampler_state,
        }

    @classmethod
    def from_plain(cls, state: Any) -> MapState:
        reader = read_header(state, "map")
        rng = reader.raw("rng")
        at_iter = reader.raw("rng_at_iter")
        for name, value in (("rng", rng), ("rng_at_iter", at_iter)):
            if value is not None and not isinstance(value, list):
                raise StateFormatError(f"state.{name} must be a list of base64 strings or null")
        return cls(
            rank=reader.int("rank"),
            world_size=reader.int("world_size", minimum=1),
            config=reader.raw("config"),
            started=reader.bool("started"),
            epoch=reader.int("epoch"),
            used=reader.int("used"),
            epoch_seed=reader.int("epoch_seed"),
            rng=rng,
            rng_at_iter=at_iter,
            sampler_state=reader.raw("sampler_state"),
        )
