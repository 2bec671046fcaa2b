"""``loader.skip(n)``: leave out the next items of a loader's stream, on record.

Items are skipped by taking them from the iterator the loader handed out last (the one a
``for batch in loader`` loop holds) and dropping them, so whatever the engine, layout or
restore behind it, what follows is the uninterrupted stream from there, and a save after it
restores exactly. Without a current iterator (right after a restore, between epochs) the skip
makes the one the next ``iter(loader)`` would, and that ``iter(loader)`` returns it. The
engine puts each skip on record in the saved state
(:meth:`~energy_loader.loader.engine.Engine.record_skip`). Design: docs/long-jobs.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from ..validation import require_int
from .engine import Engine

_END = object()


class Skips:
    """One loader's current iterator (held weakly), and the one a skip made (held until the
    next ``iter(loader)`` takes it)."""

    def __init__(self) -> None:
        self._live: weakref.ref[Any] | None = None
        self._made: Any = None

    def made_by_skip(self) -> Any:
        """The iterator a skip made, for ``iter(loader)`` to return, while it is current."""
        made, self._made = self._made, None
        return made if made is not None and made.is_current() else None

    def track(self, iterator: Any) -> None:
        """``iterator`` is the loader's newest."""
        self._live = weakref.ref(iterator)

    def skip(self, items: int, loader: Iterable[Any], engine: Engine) -> int:
        """Skip ``items`` of the current iterator, or of a new ``iter(loader)`` (kept for the
        next ``iter(loader)``) when there is none; how many there were."""
        require_int(items, "items", minimum=1)
        live = self._live() if self._live is not None else None
        if live is None or not live.is_current():
            live = self._made = iter(loader)
        return _skip(live, items, engine)


def _skip(iterator: Iterator[Any], items: int, engine: Engine) -> int:
    skipped = 0
    while skipped < items and next(iterator, _END) is not _END:
        skipped += 1
    if skipped:
        engine.record_skip(skipped)
    return skipped
