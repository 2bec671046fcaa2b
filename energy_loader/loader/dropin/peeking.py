"""What a map-style drop-in loader yields next, without yielding it (``peek_keys``,
``peek_batches``, ``python -m energy_loader replay``).

The sampler is re-run from the epoch's recorded start in this process and the batches are made
by the loader's own fetcher with the epoch's per-sample seeds; every generator is put back
after, so the live loader is untouched.
"""

from __future__ import annotations

from typing import Any

from ...rng import kept_rng_state
from ...workers.fetch import FetchTask
from .map_style import MapEngine
from .position import plain_unit, positioned_iterator
from .sampling import epoch_seed
from .state import MapState


def peek_units(engine: MapEngine, count: int, saved: MapState | None = None) -> list[Any]:
    """The units of the next ``count`` batches of the current epoch, or of ``saved``'s (fewer if it
    ends first), re-run from the epoch's recorded start here; every generator is put back."""
    if engine.stateful is not None:
        raise TypeError(
            "peek_keys cannot re-run a sampler with state_dict()/load_state_dict() without "
            "changing it; iterate a copy of the loader instead"
        )
    if saved is None and engine.pending is None and engine.epoch is None:
        state = None  # (a record now would pin the job's start: pin.py)
    else:
        state = saved or (
            engine.pending if engine.pending is not None else engine.state_at(0, 1, 0)
        )
    if state is None or not state.started:
        raise ValueError(
            "nothing to peek before the first iter(): torch draws the epoch's order then"
        )
    kept = engine.rng.capture()
    try:
        iterator = positioned_iterator(
            engine.index_sampler, engine.rng, state.start, state.used, None, engine.length
        ).iterator
        if iterator is None:
            return []
        return [plain_unit(unit) for _, unit in zip(range(count), iterator)]
    finally:
        engine.rng.put(kept)


def make_units(engine: MapEngine, units: list[Any], saved: MapState) -> list[Any]:
    """The batches of ``units`` (:func:`peek_units` of ``saved``) made here by the loader's own
    fetcher, as the workers made them (same seeds and ``collate_fn``; global RNGs put back)."""
    if not saved.started:
        raise ValueError("nothing was made before the first iter(): no batches to make")
    task = FetchTask(saved.used, tuple(units), epoch_seed(saved.job.seed, saved.epoch))
    with kept_rng_state():  # the fetcher keeps them only when it seeds
        result = engine.fetcher[task]
    if result.failure is not None:
        raise result.failure
    return result.batches()
