"""The drop-in loader's index stream: the user's sampler, run in the main process, recorded.

As in torch, the sampler runs in the main process and its units go to the workers in order.
This module records what a restore needs to make the same stream again without loading a
sample: the states of the generators that drive the sampler (the loader's ``generator``, a
sampler's own, torch's global one where they draw from it), captured before the epoch's first
pull and before ``iter(sampler)`` when that call draws; or a ``Stateful`` sampler's own
``state_dict()`` after every unit. A restore puts them in place, calls ``iter(sampler)``, skips
the units already used and puts torch's global generator back as the training left it. From
the second epoch on, a sampler that draws from torch's global generator draws from a stream of
(job seed, epoch) (:class:`~.global_rngs.PrivateGlobal`), which the training never moves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from ...dataset import is_stateful
from ...errors import StateMismatchError
from ...rng import fold_key, stable_hash
from .encoding import encode_generator_states
from .global_rngs import GlobalStart


def _chain(sampler: Any) -> Iterator[Any]:
    """The sampler and the samplers it wraps (``.sampler``, ``.batch_sampler``), outermost first."""
    seen: set[int] = set()
    while sampler is not None and id(sampler) not in seen:
        seen.add(id(sampler))
        yield sampler
        inner = getattr(sampler, "sampler", None)  # (not `or`: an empty sampler is falsy)
        sampler = inner if inner is not None else getattr(sampler, "batch_sampler", None)


def stateful_part(index_sampler: Any) -> Any:
    """The outermost sampler of the chain that has ``state_dict``/``load_state_dict``, or None."""
    for sampler in _chain(index_sampler):
        if is_stateful(sampler):
            return sampler
    return None


def describe_chain(index_sampler: Any) -> str:
    """The sampler chain's classes, outermost first: ``"BatchSampler(RandomSampler)"``."""
    names = [type(sampler).__name__ for sampler in _chain(index_sampler)]
    return "(".join(names) + ")" * (len(names) - 1)


def _draws_nothing(index_sampler: Any) -> bool:
    """Samplers that draw no random numbers (their order is a function of their settings)."""
    samplers = list(_chain(index_sampler))
    return all(type(s) in (BatchSampler, SequentialSampler, DistributedSampler) for s in samplers)


# The generators a SamplerRng's ``kinds`` name, for messages.
_KIND_NAMES = {
    "global": "torch's global generator",
    "loader": "the loader's generator=",
    "sampler": "a sampler's generator",
}


class SamplerRng:
    """The generators that drive one loader's sampler: capture and put back their states."""

    def __init__(self, loader_generator: torch.Generator | None, index_sampler: Any) -> None:
        generators: list[torch.Generator] = []
        uses_global = loader_generator is None
        kinds = [] if uses_global else ["loader"]
        if loader_generator is not None:
            generators.append(loader_generator)
        for sampler in _chain(index_sampler):
            if not hasattr(sampler, "generator"):
                continue
            generator = sampler.generator
            if generator is None:
                uses_global = True
            elif isinstance(generator, torch.Generator) and all(
                generator is not g for g in generators
            ):
                generators.append(generator)
                kinds.append("sampler")
        self.draws = not _draws_nothing(index_sampler)
        # torch's global generator, if used, comes first; it is put back after a restore.
        self.uses_global = uses_global
        self.generators = ([torch.default_generator] if uses_global else []) + generators
        # Which generators drive the loader, for the config a state must match.
        self.kinds = (["global"] if uses_global else []) + kinds
        # Whether a restore needs their states: the sampler draws, or a generator of the
        # loader's own moves (torch draws the base seed from the loader's ``generator``).
        self.recorded = self.draws or len(self.generators) > int(uses_global)
        self.chain = describe_chain(index_sampler)

    def count_mismatch(self, saved: int) -> StateMismatchError:
        """The refusal of a state holding ``saved`` generator states, not one per generator."""
        named = ", ".join(_KIND_NAMES[kind] for kind in self.kinds)
        return StateMismatchError(
            f"the state holds {saved} generator state(s) of the sampler, this loader's "
            f"sampler {self.chain} is driven by {len(self.generators)}"
            f"{f' ({named})' if named else ''}: not the same sampler setup. Build the loader "
            "with the sampler and generator= of the loader that saved the state"
        )

    def capture(self) -> list[torch.Tensor]:
        """Every generator's state now (copies)."""
        return [generator.get_state() for generator in self.generators]

    def put(self, states: list[torch.Tensor]) -> None:
        """Put back every generator (a state's count was checked at its load:
        :func:`~.stream.check_restorable`)."""
        for generator, state in zip(self.generators, states, strict=True):
            generator.set_state(state)

    def put_own(self, states: list[torch.Tensor]) -> None:
        """Put back every generator but torch's global one."""
        skip = 1 if self.uses_global else 0
        for generator, state in zip(self.generators[skip:], states[skip:]):
            generator.set_state(state)


class EpochStart:
    """How one epoch's index stream began: the generator states before the sampler drew (``states``
    before its first pull, ``at_iter`` before ``iter(sampler)``, ``global_start``)."""

    def __init__(
        self,
        epoch: int,
        states: list[torch.Tensor] | None,
        at_iter: list[torch.Tensor] | None,
        *,
        encoded: tuple[list[str] | None, list[str] | None] | None = None,
        global_start: GlobalStart | None = None,
    ) -> None:
        self.epoch = epoch
        self.states = states
        self.at_iter = at_iter
        self.global_start = global_start
        self._encoded = encoded

    def encoded(self) -> tuple[list[str] | None, list[str] | None]:
        """``states`` and ``at_iter`` as base64 strings (``state.rng``, ``state.rng_at_iter``)."""
        if self._encoded is None:
            self._encoded = (
                None if self.states is None else encode_generator_states(self.states),
                None if self.at_iter is None else encode_generator_states(self.at_iter),
            )
        return self._encoded

    def global_plain(self) -> dict[str, dict[str, str | None]] | None:
        """``global_start`` as plain data (``state.global_rngs``)."""
        return None if self.global_start is None else self.global_start.to_plain()


def job_seed(generator: torch.Generator) -> int:
    """The seed of a job: a hash of the state of the generator that drives its loader."""
    raw = hashlib.blake2b(generator.get_state().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(raw, "little")


def epoch_seed(seed: int, epoch: int) -> int:
    """The per-sample seeds' base of one epoch of a job."""
    return fold_key(fold_key(stable_hash("dropin-epoch"), seed), epoch)
