"""Where a map-style drop-in loader stands in its index stream, and how a restore gets back there
(the pure part of a save and a restore, run by :class:`~.map_style.MapEngine`).

- :class:`Units` is the one way the sampler is pulled, by the running loader and by a restore
  alike, with the *epoch-end rule*: when the epoch's last unit is pulled, the sampler is pulled
  once more, past it, right then (torch's ``RandomSampler`` draws its next permutation there),
  so the generators at an epoch's end do not depend on who pulled last;
- :func:`positioned_iterator` re-runs a saved epoch's sampler to its position, loading nothing;
- :func:`verify_replay` checks the re-run against the state's proof and raises
  ``StateMismatchError`` naming the sampler where it re-derived another position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from ...errors import StateMismatchError
from . import global_rngs
from .sampling import EpochStart, SamplerRng, stateful_part
from .state import MapState

_NONE: Any = object()
# Replayed.last when no unit was re-made (position 0, or a Stateful sampler that loaded its own
# state).
NOT_REPLAYED: Any = _NONE


class Units:
    """A sampler iterator, counted, under the epoch-end rule (see the module docstring): ``pulled``
    units taken before it, ``total`` the epoch's (or None); ``ended`` once the pull past the last
    unit finds nothing."""

    __slots__ = ("_ahead", "_iterator", "_peeked", "ended", "pulled", "total")

    def __init__(self, iterator: Iterator[Any], pulled: int, total: int | None) -> None:
        self._iterator = iterator
        self._ahead: Any = _NONE  # the unit the pull past a last unit found (a long sampler)
        self._peeked: Any = _NONE  # a unit pulled (and counted) already, handed out next
        self.pulled = pulled
        self.total = total
        self.ended = False

    def __iter__(self) -> Units:
        return self

    def __next__(self) -> Any:
        if self._peeked is not _NONE:
            unit, self._peeked = self._peeked, _NONE
            return unit
        if self._ahead is not _NONE:
            unit, self._ahead = self._ahead, _NONE
        elif self.ended:
            raise StopIteration
        else:
            unit = next(self._iterator)
        self.pulled += 1
        if self.pulled == self.total:
            self._ahead = next(self._iterator, _NONE)  # the epoch's end draws happen now
            self.ended = self._ahead is _NONE
        return unit

    def peek(self) -> Any:
        """The next unit (``_NONE`` at the end), pulled now and handed out by the next
        ``next()``."""
        if self._peeked is _NONE:
            self._peeked = next(self, _NONE)
        return self._peeked


def plain_unit(unit: Any) -> Any:
    """A sampler's unit as plain data: a list of indices, or one index."""
    if isinstance(unit, (list, tuple)):
        return [int(index) if isinstance(index, int) else index for index in unit]
    if isinstance(unit, torch.Tensor):
        return unit.tolist()
    return int(unit) if isinstance(unit, int) else unit


def unit_digest(unit: Any) -> str:
    """A short digest of one unit (a batch's indices, or an index)."""
    return hashlib.blake2b(repr(plain_unit(unit)).encode(), digest_size=8).hexdigest()


def own_generators_digest(rng: SamplerRng, states: Sequence[torch.Tensor]) -> str:
    """A digest of the loader's and samplers' own generators among ``states`` (torch's global
    generator is the training process's too, so it proves nothing); "" if there are none."""
    own = states[1:] if rng.uses_global else states
    if not own:
        return ""
    hasher = hashlib.blake2b(digest_size=8)
    for state in own:
        hasher.update(state.numpy().tobytes())
    return hasher.hexdigest()


def saved_after_last_batch(state: MapState) -> bool:
    """Whether ``state`` was saved after its epoch's last batch (the next ``iter()`` runs the
    next epoch). Counted in the saving loader's batches: under a DistributedSampler those of
    the dealing it ran, which after a resize is shorter than ``batches_per_epoch``."""
    return state.started and state.used == units_per_epoch(state)


def units_per_epoch(state: MapState) -> int | None:
    """The saving loader's units (batches) per epoch, if known."""
    if state.distributed is not None and state.distributed["units"] >= 0:
        return state.distributed["units"]
    units = state.config.get("batches_per_epoch") if isinstance(state.config, dict) else None
    return units if isinstance(units, int) else None


@attrs.frozen
class Replayed:
    """A saved epoch re-run to its position: the iterator (next: unit ``used``; None when the
    epoch has no units left), the generators' states after, and unit ``used - 1`` (``_NONE``
    when none was re-run: a position 0, or a Stateful sampler that loaded its own state)."""

    iterator: Units | None
    after: list[torch.Tensor]
    last: Any


def positioned_iterator(
    index_sampler: Any,
    rng: SamplerRng,
    start: EpochStart,
    used: int,
    sampler_state: Any,
    length: int | None,
) -> Replayed:
    """Run a saved epoch's sampler up to its ``used`` units, loading nothing and leaving the global
    RNGs as they were; ``StateMismatchError`` if it yields fewer units than were used."""
    drawn = start.global_start
    last: Any = _NONE
    with global_rngs.training_generators_kept(
        rng.uses_global, () if drawn is None else drawn.names
    ):
        stateful = stateful_part(index_sampler)
        if start.at_iter is not None:
            rng.put(start.at_iter)
        elif start.states is not None:
            rng.put(start.states)
        if drawn is not None:
            global_rngs.put(drawn.at_iter)
        loaded = stateful is not None and sampler_state is not None
        if loaded:
            stateful.load_state_dict(sampler_state)
        # A Stateful sampler's loaded state is the one saved after unit `used` (and after the
        # pull past an epoch's last unit): it continues from there.
        iterator = Units(iter(index_sampler), used if loaded else 0, length)
        if start.at_iter is not None and start.states is not None:
            rng.put(start.states)
        if drawn is not None:
            global_rngs.put(drawn.start)
        if not loaded:
            for done in range(used):
                last = next(iterator, _NONE)
                if last is _NONE:
                    raise StateMismatchError(
                        f"the sampler {rng.chain} ran out after {done} batches of the saved "
                        f"epoch, but the state says {used} were used: not the same sampler or "
                        "dataset. Restore with the dataset and sampler that saved the state"
                    )
        # An epoch of known length whose units were all used is over (its end was pulled).
        peeked = _NONE if used == length else iterator.peek()
        after = rng.capture()
    return Replayed(None if peeked is _NONE else iterator, after, last)


def verify_replay(state: MapState, replayed: Replayed, rng: SamplerRng, chain: str) -> None:
    """Raise ``StateMismatchError`` when the re-run stream's last unit (or, at an epoch's end, its
    generators) differs from the state's proof; ``chain`` names the sampler."""
    proof = state.proof
    if proof.last and replayed.last is not _NONE and unit_digest(replayed.last) != proof.last:
        raise StateMismatchError(
            f"the restore re-ran the sampler {chain} to batch {state.used} of epoch "
            f"{state.epoch}, but batch {state.used - 1} it re-made "
            f"({short_unit(replayed.last)}, digest {unit_digest(replayed.last)}) is not the "
            f"one the saving loader handed out (digest {proof.last}): the sampler does not "
            "replay (it draws from the clock, or from a generator the loader cannot see: pass "
            "it through the "
            "loader's `generator=` or give the sampler state_dict()/load_state_dict()), or the "
            "dataset or sampler changed. Pass verify_restore=False to the loader to continue "
            "from the re-derived position anyway (docs/loader.md#restores-check-themselves)"
        )
    ended = replayed.iterator is None
    if proof.end and ended and (found := own_generators_digest(rng, replayed.after)) != proof.end:
        raise StateMismatchError(
            f"the restore re-ran the sampler {chain} through epoch {state.epoch} (saved at "
            f"its end), but its generators then differ from the saving loader's (digest "
            f"{proof.end} saved, {found} now): the next epoch's order would not be the one "
            "the uninterrupted run draws (a sampler that draws differently on every run?). "
            "Pass verify_restore=False to the "
            "loader to continue anyway (docs/loader.md#restores-check-themselves)"
        )


def short_unit(unit: Any) -> str:
    """A unit as plain data, cut to 60 characters (for messages)."""
    text = repr(plain_unit(unit))
    return text if len(text) <= 60 else text[:57] + "..."
