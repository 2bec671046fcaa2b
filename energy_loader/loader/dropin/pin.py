"""A map-style drop-in job's start, pinned by a save before its first ``iter()``.

Why. A job's first ``iter()`` takes what every epoch derives from: the job seed (a hash of
the generator that drives the loader, :func:`~.sampling.job_seed`) and the first epoch's order
(torch draws its base seed from that generator, then the sampler draws, from the same
generators). A checkpoint written at step 0 is saved before that ``iter()``, and a restarted
program whose global torch RNG stands elsewhere at its ``iter()`` (one draw more in another
model's init) would take another seed and another order. So the first save before the first
``iter()`` pins the job's start as that ``iter()`` would take it at that moment: the job seed,
and the states of the generators that drive the sampler (``state.rng`` of a state with
``started`` false). The loader that saved and every loader that restores the state start their
first epoch from the pin (:meth:`Pin.moved` tells which way):

- where the generators still stand where the pin says (nothing drew from them since the save:
  the usual case), the first ``iter()`` runs as it always does, torch's draws included: the
  loader that saved yields exactly what it would have without the save;
- where they moved (the restarted program drew more before iterating, or the script drew
  between the save and its ``iter()``), the loader sets its own generators (``generator=``, a
  sampler's) to the pinned states and lets the sampler draw from torch's global generator *as
  pinned*, in a stream of its own for the first epoch (:class:`~.sampling.PrivateGlobal`),
  adding torch's base-seed draw to that stream where torch draws it from the global generator.
  The training process's global generator is left as it is, as after any restore (torch's
  base-seed draw from it is taken back).

A pin holds digests of the global RNGs the loader does not drive (python's, numpy's, and
torch's where no generator state covers it) at the save too (:mod:`.global_rngs`): a restored
sampler that draws its first order from one that the restarted program has elsewhere is
refused.

Not here: a started epoch's position (:mod:`.stream`), the state's layout (:mod:`.state`).
"""

from __future__ import annotations

import attrs
import torch

from ...state.digests import digest
from . import global_rngs
from .sampling import SamplerRng, job_seed
from .state import JobStart, MapState, decode_generator_states, encode_generator_states

__all__ = ["Pin"]


@attrs.frozen
class Pin:
    """The job's start as the first ``iter()`` would take it at the save: ``job`` (its seed),
    the states of the generators that drive the sampler (None when none needs recording:
    :attr:`SamplerRng.recorded`), as tensors and as saved, and digests of the global RNGs the
    loader does not drive."""

    job: JobStart
    states: list[torch.Tensor] | None
    encoded: list[str] | None
    rng_check: str
    at_save: dict[str, str]

    @classmethod
    def now(
        cls,
        rng: SamplerRng,
        base_generator: torch.Generator,
        job: JobStart,
        watched: tuple[str, ...],
    ) -> Pin:
        """The pin of a loader that never iterated (``base_generator``: the one torch draws
        the base seed from; ``job``: the job it would start, its seed to fill in;
        ``watched``: the global RNGs it does not drive, :func:`.global_rngs.watched`)."""
        states = rng.capture() if rng.recorded else None
        encoded = None if states is None else encode_generator_states(states)
        return cls(
            attrs.evolve(job, seed=job_seed(base_generator)),
            states,
            encoded,
            digest("rng", encoded),
            global_rngs.digests_now(watched),
        )

    @classmethod
    def of(cls, state: MapState) -> Pin | None:
        """The pin a restored state holds (None: not saved before the first ``iter()``, or
        saved by a release whose states pinned nothing)."""
        if not state.pinned:
            return None
        assert state.job is not None  # (pinned)
        states = None if state.rng is None else decode_generator_states(state.rng, "state.rng")
        return cls(
            state.job, states, state.rng, state.rng_check, dict(state.global_rngs_at_save or {})
        )

    def state(self, rank: int, world_size: int, config: dict[str, object]) -> MapState:
        """The state a save before the first ``iter()`` writes."""
        return MapState(
            rank,
            world_size,
            config,
            False,
            0,
            0,
            self.job,
            self.encoded,
            None,
            None,
            self.rng_check,
            "",
            global_rngs_at_save=self.at_save,
        )

    def moved(self, rng: SamplerRng) -> bool:
        """Whether the generators that drive the sampler stand elsewhere than pinned."""
        states = self.states
        if states is None:
            return False
        return any(not torch.equal(a, b) for a, b in zip(states, rng.capture()))
