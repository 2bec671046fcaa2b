"""Argument validators shared by every public entry point.

Each raises ``TypeError`` or ``ValueError`` naming the argument, what it got and what would be
right. A module of its own so that low-level modules (the transport codec, the loader's
settings) can validate without importing the dataset protocol.
"""

from __future__ import annotations

from typing import Any


def require_callable(value: Any, name: str) -> None:
    """Raise ``TypeError`` unless ``value`` is callable."""
    if not callable(value):
        raise TypeError(f"`{name}` must be callable (got {type(value).__name__}: {value!r})")


def require_bool(value: Any, name: str) -> bool:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False (got {value!r})")
    return value


def require_int(value: Any, name: str, *, minimum: int) -> int:
    """Raise ``ValueError``/``TypeError`` unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an integer (got {type(value).__name__}: {value!r})")
    if value < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"`{name}` must be {what} (got {value})")
    return value
