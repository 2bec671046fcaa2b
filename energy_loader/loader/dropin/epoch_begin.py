"""How an epoch of the map-style drop-in begins: the sampler's ``iter()``, torch's base-seed
draw, a start pinned by a save before the first ``iter()``, and the global RNGs a sampler may
draw from unseen.

:class:`EpochBeginning` is a part of :class:`~energy_loader.loader.dropin.map_style.MapEngine`
(its base class), kept apart because these are the rules that decide which random numbers an
epoch's order is drawn from, in which order, before its first unit leaves: what a save must
record and a restore must put back for the order to be the same
(:mod:`.pin`, :mod:`.global_rngs`, :mod:`.sampling`). Nothing here runs a worker or touches a
saved state's layout.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from . import global_rngs
from .global_rngs import GlobalStart
from .position import Units
from .sampling import PrivateGlobal, SamplerRng
from .state import MapState
from .stream import Epoch, IndexStream

if TYPE_CHECKING:
    from .pin import Pin

__all__ = ["EpochBeginning"]


class EpochBeginning:
    """The beginning of each epoch of a map-style drop-in engine (see the module's doc)."""

    # What the engine holds (set in MapEngine.__init__).
    rng: SamplerRng
    stream: IndexStream
    watched: tuple[str, ...]
    index_sampler: Any
    stateful: Any
    distributed: Any
    base_seed_generator: torch.Generator
    base_fixup: str | None
    before_base_seed: torch.Tensor | None

    @property
    def length(self) -> int | None:
        """Batches per epoch (the sampler's ``len()``), None without one."""
        return self.stream.length

    def _start_pinned(self, epoch: Epoch, pin: Pin, *, restored: bool) -> None:
        """The first epoch of a job whose start a save pinned (pin.py): from the pinned
        generators where they moved since; watching, after a restore, the global RNGs the
        restarted program has elsewhere than at the save (global_rngs.py)."""
        rng = self.rng
        if pin.moved(rng):
            assert pin.states is not None  # (moved)
            rng.put_own(pin.states)
            if rng.uses_global:
                epoch.private = PrivateGlobal(pin.states[0])
                if self.base_seed_generator is torch.default_generator:
                    epoch.base_draw = "due"
        if self.stream.verify:
            epoch.watch = global_rngs.elsewhere(pin.at_save)
            epoch.watch_refuses = restored

    def _check_global_rngs(self, state: MapState) -> None:
        """Refuse a restore whose sampler drew from python's or numpy's global RNG when the
        restarted program has that RNG elsewhere than the saving one had it at the save."""
        start, at_save = state.global_rngs, state.global_rngs_at_save
        if start is None or at_save is None:
            return
        moved = global_rngs.elsewhere({n: at_save[n] for n in start.names if n in at_save})
        if moved:
            raise global_rngs.refusal(moved, self.stream.config["sampler"])

    def _pay_base_draw(self, epoch: Epoch) -> None:
        """torch's base-seed draw, in the epoch's own stream, once torch drew it (pin.py)."""
        if epoch.base_draw == "owed" and epoch.private is not None:
            with epoch.private:
                torch.empty((), dtype=torch.int64).random_()
            epoch.base_draw = None

    def _iter_sampler(self, epoch: Epoch) -> None:
        """Call ``iter(sampler)`` for a fresh epoch, noting what that call drew: the
        generators' states before it, where it moved them, and the global RNGs it moved."""
        rng = self.rng
        globals_before = global_rngs.capture(self.watched)
        with epoch.sampling():
            before = rng.capture() if rng.draws else None
            iterator = Units(iter(self.index_sampler), 0, self.length)
            at_iter = None
            if before is not None and any(
                not torch.equal(a, b) for a, b in zip(before, rng.capture())
            ):
                at_iter = before  # iter(sampler) itself drew random numbers
        drawn = global_rngs.moved(globals_before, global_rngs.capture(self.watched))
        epoch.iterator, epoch.at_iter = iterator, at_iter
        epoch.global_at_iter = {name: globals_before[name] for name in drawn}
        epoch.iters += 1

    def _note_before_base_seed(self) -> None:
        """torch draws the base seed right after it opens the stream (the first time)."""
        if self.base_fixup == "undo" and self.before_base_seed is None:
            self.before_base_seed = self.base_seed_generator.get_state()

    def begin(self, epoch: Epoch) -> None:
        """Once an epoch, before its first unit goes anywhere (its task stream's first pull,
        or a save that comes first, so that what a save records is what the epoch runs):
        take back or add torch's base-seed draw; put a restored epoch's own generators where
        the saving job had them; or capture a fresh epoch's start and pull its first unit,
        noting the global RNGs that pull moved (global_rngs.py)."""
        if epoch.begun:
            return
        epoch.begun = True
        self._fix_base_seed()
        if epoch.resume is not None:
            self.rng.put_own(epoch.resume[1])
        else:
            self._pay_base_draw(epoch)
            calls = epoch.iter_calls
            while calls is not None and epoch.iters < calls:  # as often as the job's iterator
                self._iter_sampler(epoch)
            iterator = epoch.iterator
            assert iterator is not None  # (open_stream ran)
            epoch.start = start = self.stream.capture_start(epoch, epoch.at_iter)
            stateful = self.stateful
            if stateful is not None and epoch.pulled not in epoch.snapshots:
                epoch.snapshots[epoch.pulled] = stateful.state_dict()
            before = global_rngs.capture(self.watched)
            with epoch.sampling():
                iterator.peek()
            drawn = global_rngs.moved(before, global_rngs.capture(self.watched))
            if drawn or epoch.global_at_iter:
                start.global_start = GlobalStart(
                    epoch.global_at_iter, {name: before[name] for name in drawn}
                )
                watched = [n for n in epoch.watch if n in start.global_start.names]
                if watched:
                    chain = self.stream.config["sampler"]
                    if epoch.watch_refuses:
                        raise global_rngs.refusal(watched, chain)
                    warnings.warn(global_rngs.moved_since_pin(watched, chain), stacklevel=2)
        if epoch.dealing is None and self.distributed is not None:
            self.stream.deal_as_the_sampler(epoch, self.distributed)

    def _fix_base_seed(self) -> None:
        """Take back or add torch's base-seed draw, once per iter() (see :meth:`iterate`)."""
        fixup, self.base_fixup = self.base_fixup, None
        if fixup == "undo" and self.before_base_seed is not None:
            self.base_seed_generator.set_state(self.before_base_seed)
        elif fixup == "draw":
            torch.empty((), dtype=torch.int64).random_(generator=self.base_seed_generator)
        self.before_base_seed = None
