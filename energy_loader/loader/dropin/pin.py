"""A map-style drop-in job's start, pinned by a save before its first ``iter()``.

A job's first ``iter()`` takes the job seed and the first epoch's order from the generators
that drive the loader. A checkpoint written at step 0 comes before that ``iter()``, and a
restarted program whose global torch RNG stands elsewhere (one draw more in a model's init)
would take another seed and order. So the first save before the first ``iter()`` pins the
start as that ``iter()`` would take it then (the job seed and the sampler's generators'
states), and every loader that saved or restores the state starts its first epoch from it
(:meth:`Pin.moved`): where the generators still stand at the pin, ``iter()`` runs as always;
where they moved, the loader sets its own generators to the pinned states and the sampler
draws from torch's global generator *as pinned*, in a stream of its own
(:class:`~.global_rngs.PrivateGlobal`, :func:`~.global_rngs.pinned_stream`), leaving the
training's generator as it is. Digests of the global RNGs the loader does not drive are
pinned too, so a sampler that draws its first order from one that moved is refused.
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


@attrs.frozen
class Pin:
    """The job's start as the first ``iter()`` would take it at the save: ``job`` (its seed),
    ``start.states`` of the sampler's generators, and digests of the global RNGs (``at_save``)."""

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
        """The pinned job, as the first ``iter()`` of ``config``'s rank takes it (``restored``: the
        state the pin came from, None for the saving loader; ``generator``: the job seed's source).
        Rank 0 warns when another rank's pin holds another seed (docs/dropin.md, step 0)."""
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
