"""``loader.skip(n)``: leave out the next items of a loader's stream, on record.

Items are skipped by taking them from the iterator the loader handed out last (the one a
``for batch in loader`` loop holds) and dropping them, so whatever the engine, layout or
restore behind it, what follows is the uninterrupted stream from there, and a save after it
restores exactly. Without a current iterator (right after a restore, between epochs) the skip
waits for the next ``iter(loader)``. The engine puts each skip on record in the saved state
(:meth:`~energy_loader.loader.engine.Engine.record_skip`). Design: docs/long-jobs.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from ..validation import require_int
from .engine import Engine

_END = object()


class Skips:
    """One loader's current iterator (held weakly) and the items a skip left for the next."""

    def __init__(self) -> None:
        self._live: weakref.ref[Any] | None = None
        self._pending = 0

    def attach(self, iterator: Any, engine: Engine) -> None:
        """``iterator`` is the loader's newest: it takes the items a skip left waiting first."""
        self._live = weakref.ref(iterator)
        pending, self._pending = self._pending, 0
        if pending:
            _skip(iterator, pending, engine)

    def skip(self, items: int, engine: Engine) -> int:
        """Skip ``items`` of the current iterator now (how many it had left), or 0 if there is
        none: then the next iterator skips them."""
        require_int(items, "items", minimum=1)
        live = self._live() if self._live is not None else None
        if live is None or not live.is_current():
            self._pending += items
            return 0
        return _skip(live, items, engine)


def _skip(iterator: Iterator[Any], items: int, engine: Engine) -> int:
    skipped = 0
    while skipped < items and next(iterator, _END) is not _END:
        skipped += 1
    if skipped:
        engine.record_skip(skipped)
    return skipped
