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
  pinned*, in a stream of its own for the first epoch (:class:`~.global_rngs.PrivateGlobal`),
  adding torch's base-seed draw to that stream where torch draws it from the global generator
  (:func:`~.global_rngs.pinned_stream`). The training process's global generator is left as it
  is, as after any restore (torch's base-seed draw from it is taken back).

A pin holds digests of the global RNGs the loader does not drive (python's, numpy's, and
torch's where no generator state covers it) at the save too (:mod:`.global_rngs`): a restored
sampler that draws its first order from one that the restarted program has elsewhere is
refused.

Not here: a started epoch's position (:mod:`.stream`), the state's layout (:mod:`.state`).
"""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import torch

from ...worker import WorkerConfig
from . import global_rngs
from .sampling import EpochStart, SamplerRng, job_seed
from .state import JobStart, MapState

__all__ = ["Pin"]


@attrs.frozen
class Pin:
    """The job's start as the first ``iter()`` would take it at the save: ``job`` (its seed),
    the states of the generators that drive the sampler (``start.states``; None when none
    needs recording: :attr:`SamplerRng.recorded`), and digests of the global RNGs the loader
    does not drive (``at_save``)."""

    job: JobStart
    start: EpochStart
    at_save: dict[str, str]

    @classmethod
    def now(
        cls,
        rng: SamplerRng,
        base_generator: torch.Generator,
        *,
        persistent: bool,
        workers: bool,
        watched: tuple[str, ...],
    ) -> Pin:
        """The pin of a loader that never iterated (``base_generator``: the one torch draws
        the base seed from, whose hash is the job's seed; ``persistent``, ``workers``: its
        own; ``watched``: the global RNGs it does not drive, :func:`.global_rngs.watched`)."""
        states = rng.capture() if rng.recorded else None
        return cls(
            JobStart.new(job_seed(base_generator), persistent=persistent, workers=workers),
            EpochStart(0, states, None),
            global_rngs.digests_now(watched),
        )

    @classmethod
    def of(cls, state: MapState) -> Pin | None:
        """The pin a restored state holds (None: not saved before the first ``iter()``)."""
        if state.started:
            return None
        return cls(state.job, state.start, dict(state.global_rngs_at_save or {}))

    def state(
        self, rank: int, world_size: int, config: dict[str, Any], code: dict[str, Any]
    ) -> MapState:
        """The state a save before the first ``iter()`` writes."""
        return MapState(
            rank=rank,
            world_size=world_size,
            config=config,
            started=False,
            epoch=0,
            used=0,
            job=self.job,
            start=self.start,
            global_rngs_at_save=self.at_save,
            code=code,
        )

    def job_for(
        self, restored: MapState | None, config: WorkerConfig, generator: torch.Generator
    ) -> JobStart:
        """The pinned job, as the first ``iter()`` of the loader of ``config``'s rank takes it
        (``restored``: the state the pin came from, None for the loader that saved it;
        ``generator``: the one the job seed is a hash of).

        Warns (``UserWarning``) on rank 0 when the pin was saved by another rank of a
        multi-rank job and pins another seed than rank 0's generator gives now: the job takes
        rank 0's seed at its first ``iter()`` (:mod:`.job`), and a
        ``torch.distributed.checkpoint`` of a step-0 save keeps one rank's entry (the position
        is every rank's), so where the ranks seed differently the restored job would augment
        as that rank's seed does without a word. Ranks seeded alike give the same seed (no
        warning); rank 0's generator moved since the save is the one case warned for nothing.
        """
        if (
            restored is not None
            and config.rank == 0
            and restored.world_size > 1
            and restored.rank != 0
            and self.job.seed != job_seed(generator)
        ):
            warnings.warn(
                f"this loader restored a state saved before the first iter() by rank "
                f"{restored.rank} of {restored.world_size} (a torch.distributed.checkpoint keeps "
                f"one rank's entry of such a save), and its job seed differs from the one rank "
                f"0's generator gives now: if your ranks seed differently (torch.manual_seed(1000 "
                f"+ rank)), the restored job augments every sample as rank {restored.rank}'s seed "
                f"does, not as the job that saved. Seed every rank alike, checkpoint after the "
                f"first batch, or restore from per-rank files (save_state_rank_file); if the "
                f"ranks seed alike and only rank 0's generator moved since the save, the restore "
                f"is exact (docs/dropin.md#a-checkpoint-at-step-0)",
                stacklevel=4,
            )
        return self.job

    def moved(self, rng: SamplerRng) -> bool:
        """Whether the generators that drive the sampler stand elsewhere than pinned."""
        states = self.start.states
        if states is None:
            return False
        return any(not torch.equal(a, b) for a, b in zip(states, rng.capture()))
