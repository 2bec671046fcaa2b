"""Peer loaders for the benchmark, used only when they are installed (``.[bench]``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["available_peers"]


def available_peers(
    save_every: int, workers: int, prefetch: int
) -> dict[str, Callable[[int], dict[str, Any]]]:
    """Contender functions for the peers that import; none is required."""
    return {}
