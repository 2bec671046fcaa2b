"""Plain-data helpers: reading saved states field by field, and restore keys.

A saved state is nested dicts, lists, str, int, float, bool and None. It reaches us from a
file, a collective or a user, so every field is checked as it is read: :class:`StateReader`
raises :class:`~energy_loader.errors.StateFormatError` naming the exact path of a missing or
mistyped field (``state.workers[1].checkpoint.inner.pos``) instead of a ``KeyError`` deep in
a worker.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Mapping
from typing import Any

from ..errors import StateFormatError

_SCALARS = (str, int, float, bool, type(None))


def to_key(value: Any, path: str = "key") -> tuple[Any, ...]:
    """Turn a restore key that went through JSON (lists) back into nested tuples."""
    if not isinstance(value, (list, tuple)):
        raise StateFormatError(f"{path} must be a restore key (a list/tuple), got {value!r}")
    return tuple(_key_part(part, path) for part in value)


def _key_part(part: Any, path: str) -> Any:
    if isinstance(part, (list, tuple)):
        return tuple(_key_part(p, path) for p in part)
    if isinstance(part, _SCALARS):
        return part
    raise StateFormatError(f"{path} holds {type(part).__name__}, not a plain value")


def check_plain(value: Any, path: str = "state") -> None:
    """Raise ``StateFormatError`` unless ``value`` is plain data (tuples count as lists)."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise StateFormatError(f"{path} is {value!r}; states hold finite numbers only")
        return
    if isinstance(value, Mapping):
        for name, item in value.items():
            if not isinstance(name, str):
                raise StateFormatError(f"{path} has a non-string key {name!r}")
            check_plain(item, f"{path}.{name}")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_plain(item, f"{path}[{index}]")
        return
    raise StateFormatError(f"{path} is a {type(value).__name__}, which is not plain data")


def is_keyed_by(value: Any, prefixes: str | tuple[str, ...]) -> bool:
    """Whether ``value`` is a non-empty dict whose keys all start with one of ``prefixes``:
    a ``state_dict()`` of JSON leaves (a loader's), not one plain state."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(key, str) and key.startswith(prefixes) for key in value)
    )


def json_leaf(text: str, path: str) -> Any:
    """A state dict's JSON string leaf, parsed (``StateFormatError`` naming ``path``)."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise StateFormatError(f"{path} is not valid JSON (truncated?): {error}") from None


def check_format(reader: StateReader, name: str, version: int, what: str) -> None:
    """``StateFormatError`` unless ``reader``'s dict is tagged ``"format": name`` and ``"version":
    version`` (``what``: the kind of thing, e.g. "checkpoint file")."""
    if not reader.has("format") or reader.raw("format") != name:
        raise StateFormatError(f"{reader.path} is not an energy_loader {what} (no {name!r} tag)")
    found = reader.int("version")
    if found != version:
        raise StateFormatError(
            f"{reader.path} is {what} version {found}; this release reads {version}"
        )


class StateReader:
    """Typed, path-aware access to one dict of a saved state."""

    __slots__ = ("_data", "path")

    def __init__(self, data: Any, path: str = "state") -> None:
        if not isinstance(data, Mapping):
            raise StateFormatError(f"{path} must be a dict, got {type(data).__name__}")
        self._data = data
        self.path = path

    def _get(self, name: str) -> Any:
        try:
            return self._data[name]
        except KeyError:
            raise StateFormatError(f"{self.path} has no field {name!r}") from None

    def has(self, name: str) -> bool:
        """Whether the field exists."""
        return name in self._data

    def int(self, name: str, *, minimum: int | None = 0) -> int:
        """An integer field, at least ``minimum`` unless that is ``None``."""
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise StateFormatError(f"{self.path}.{name} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise StateFormatError(f"{self.path}.{name} must be >= {minimum}, got {value}")
        return value

    def bool(self, name: str) -> bool:
        """A boolean field."""
        value = self._get(name)
        if not isinstance(value, bool):
            raise StateFormatError(f"{self.path}.{name} must be true or false, got {value!r}")
        return value

    def str(self, name: str, *, choices: tuple[str, ...] | None = None) -> str:
        """A string field, one of ``choices`` when given."""
        value = self._get(name)
        if not isinstance(value, str):
            raise StateFormatError(f"{self.path}.{name} must be a string, got {value!r}")
        if choices is not None and value not in choices:
            raise StateFormatError(f"{self.path}.{name} must be one of {choices}, got {value!r}")
        return value

    def list(self, name: builtins.str) -> builtins.list[Any]:
        """A list field (a tuple is accepted: torch.load keeps tuples)."""
        value = self._get(name)
        if not isinstance(value, (list, tuple)):
            raise StateFormatError(f"{self.path}.{name} must be a list, got {type(value).__name__}")
        return list(value)

    def keys(self, name: builtins.str) -> builtins.list[tuple[Any, ...]]:
        """A list of restore keys."""
        return [to_key(k, f"{self.path}.{name}[{i}]") for i, k in enumerate(self.list(name))]

    def sub(self, name: builtins.str) -> StateReader:
        """A nested dict field."""
        return StateReader(self._get(name), f"{self.path}.{name}")

    def raw(self, name: builtins.str) -> Any:
        """A field as it is, unchecked."""
        return self._get(name)


def pack_keys(keys: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
    """Encode a list of restore keys compactly: plain ints when every key is ``(int,)`` (~6 bytes a
    key in JSON instead of ~9)."""
    if all(len(k) == 1 and type(k[0]) is int for k in keys):
        return {"indices": [k[0] for k in keys]}
    return {"keys": [list(k) for k in keys]}


def unpack_keys(reader: StateReader) -> list[tuple[Any, ...]]:
    """Decode what :func:`pack_keys` wrote (validated)."""
    if reader.has("indices"):
        out = []
        for i, value in enumerate(reader.list("indices")):
            if isinstance(value, bool) or not isinstance(value, int):
                raise StateFormatError(f"{reader.path}.indices[{i}] must be an integer")
            out.append((value,))
        return out
    return reader.keys("keys")
