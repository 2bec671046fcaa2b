"""The training program the resume checks run: the loop people write, killed and restarted.

A *program* seeds the global RNGs, builds a loader, maybe restores, and runs ``while
loader.epoch < epochs: for batch in loader``. A *save point* stops after ``batches`` batches,
inside the loop or (``after_loop``) right after it; a *chain* restarts at each save point in
turn. Every batch is recorded with the epoch the loop was in.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from ..rng import kept_rng_state

__all__ = [
    "Batch",
    "Chain",
    "ChainRun",
    "RunFailed",
    "SavePoint",
    "UNREPLAYABLE",
    "TrainingLoop",
    "global_rng_digests",
    "load",
    "move_global_rngs",
    "program_start",
    "round_trip",
    "run_chain",
    "training_step",
]


@attrs.frozen
class Batch:
    """One batch of a run: the loop's epoch, the batch, its 0-based number in the run, and
    where python's, numpy's and torch's global RNGs stood right after the loader handed it
    out (:func:`global_rng_digests`; not part of equality: :func:`compare_runs` compares them
    where asked)."""

    epoch: int
    number: int
    value: Any
    rngs: dict[str, str] | None = attrs.field(default=None, eq=False)


@attrs.frozen(order=True)
class SavePoint:
    """Where a program stops and saves: after ``batches`` batches in all, inside the ``for``
    loop, or right after it ended (``after_loop``)."""

    batches: int
    after_loop: bool = False

    def __str__(self) -> str:
        count = f"{self.batches} batch{'' if self.batches == 1 else 'es'}"
        if self.after_loop:
            return f"after {count}, after the for loop ended"
        return f"after {count} (in the loop)" if self.batches else "at the start"


@attrs.frozen
class Chain:
    """Save points in order (each program saves at one, the next restores it) and the
    ``num_workers`` of each program: ``workers[0]`` runs the first, ``workers[i]`` the
    program that restores the ``i``-th save."""

    points: tuple[SavePoint, ...]
    workers: tuple[int, ...]

    def __str__(self) -> str:
        steps = [f"num_workers={self.workers[0]}"]
        for point, workers in zip(self.points, self.workers[1:]):
            steps.append(f"save {point}, restore on num_workers={workers}")
        return " -> ".join(steps)


class RunFailed(AssertionError):
    """A program could not run its loop (the loader raised, or its epoch never advanced)."""


def program_start(seed: int) -> None:
    """What a training script does first: seed python's, numpy's and torch's global RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def training_step() -> None:
    """A step's own draws (dropout, augmentation in the loop) from every global RNG."""
    torch.rand(3)
    random.random()
    np.random.rand()


def global_rng_digests() -> dict[str, str]:
    """A short digest of each global RNG's state (``python``, ``numpy``, ``torch``): what a
    training step would draw next from each."""
    python = random.getstate()
    numpy: Any = np.random.get_state()
    return {
        "python": _hex(repr(python).encode()),
        "numpy": _hex(numpy[1].tobytes() + repr(numpy[2:]).encode()),
        "torch": _hex(torch.get_rng_state().numpy().tobytes()),
    }


def _hex(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def move_global_rngs() -> None:
    """A restarted program is elsewhere in its global RNGs than the one that saved."""
    torch.rand(5)
    random.random()
    np.random.rand(2)


def set_epoch_of(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler (or batch sampler's sampler) where it has
    one, as a training loop over a ``DistributedSampler`` calls it."""
    for sampler in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        inner = getattr(sampler, "sampler", None)
        for candidate in (sampler, inner):
            set_epoch = getattr(candidate, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
                return


def round_trip(loader: Any, via_torch: bool) -> tuple[Any, int]:
    """Save the loader's state as a checkpoint holds it: ``save_state_rank()`` through ``json``, or
    ``state_dict()`` through ``torch.save``/``torch.load(weights_only=True)``. Returns ``(how,
    state as loaded)`` for :func:`load` and its size (JSON characters, or ``torch.save`` bytes).
    """
    if not via_torch:
        state = loader.save_state_rank()
        with contextlib.suppress(TypeError, ValueError):  # not JSON: it goes through torch
            text = json.dumps(state)
            return ("rank", json.loads(text)), len(text)
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)
    try:  # the rank state's own size, as the json path measures it
        size = len(json.dumps(loader.save_state_rank()))
    except (TypeError, ValueError):
        size = buffer.tell()
    buffer.seek(0)
    return ("dict", torch.load(buffer, weights_only=True)), size


def load(loader: Any, saved: tuple[str, Any]) -> None:
    """Restore what :func:`round_trip` saved, through the call that matches its save."""
    how, state = saved
    if how == "dict":
        loader.load_state_dict(state)
    else:
        loader.restore_state_rank(state)


@attrs.define
class TrainingLoop:
    """One program's loop over ``loader``, appending to ``out`` (the chain's batches so far);
    :meth:`run` stops at ``stop`` (None: the end). ``restored``: just restored; ``peek_at``: keep
    that batch's indices as the loader tells them; ``on_first``: sees a restored program's first
    batch; ``ends``: the batch counts at which a ``for`` loop ended.
    """

    loader: Any
    epochs: int
    out: list[Batch]
    stop: SavePoint | None
    restored: bool
    peek_at: int | None = None
    on_first: Callable[[Any, Any], None] | None = None
    peeked: Any = None
    ends: list[int] = attrs.field(factory=list)

    def run(self) -> bool:
        """Run the loop; True when it stopped at its save point."""
        # A restored program asked to save where it was restored saves before any iter() (an
        # epoch's last batch in the loop and after the loop are one position then).
        at_start = self.stop is not None and self.stop.batches == len(self.out)
        if at_start and (self.restored or self.stop == SavePoint(0)):
            return True
        iterations = 0
        while self.loader.epoch < self.epochs:
            iterations += 1
            if iterations > self.epochs + 1:
                raise RunFailed(
                    f"loader.epoch stayed below {self.epochs} after {iterations - 1} for loops "
                    f"(it reads {self.loader.epoch}): the loop `while loader.epoch < epochs` "
                    "never ends"
                )
            epoch = self.loader.epoch
            set_epoch_of(self.loader, epoch)
            iterator = iter(self.loader)
            while True:
                if self.peek_at == len(self.out):
                    self.peeked = _peek(self.loader)
                try:
                    value = next(iterator)
                except StopIteration:
                    break
                if self.on_first is not None and self.restored:
                    self.on_first(self.loader, value)
                    self.on_first = None
                self.out.append(Batch(epoch, len(self.out), value, global_rng_digests()))
                training_step()
                if self.stop == SavePoint(len(self.out)):
                    return True
            self.ends.append(len(self.out))
            if self.stop == SavePoint(len(self.out), after_loop=True):
                return True
        return False


class _Unreplayable:
    def __repr__(self) -> str:
        return "UNREPLAYABLE"


UNREPLAYABLE: Any = _Unreplayable()


def _peek(loader: Any) -> Any:
    """The dataset indices (or restore keys) of the next batch, where the loader tells them
    (None where it cannot). The loader tells them by re-running the sampler: where a second
    re-run, with python's, numpy's and torch's global RNGs elsewhere, tells others, the
    sampler draws from something the loader neither sees nor saves: ``UNREPLAYABLE``."""
    try:
        keys = loader.peek_keys(1)
        with kept_rng_state():
            move_global_rngs()
            again = loader.peek_keys(1)
    except (TypeError, ValueError, AttributeError, NotImplementedError):
        return None
    if keys != again:
        return UNREPLAYABLE
    return keys[0] if keys else None


@attrs.frozen
class ChainRun:
    """What a chain produced: the batches, the batch counts at which a ``for`` loop ended, the
    largest saved state, and the indices of batch ``peek_at`` as the program handing it out
    told them (None when not asked or unknown)."""

    batches: list[Batch]
    ends: list[int]
    state_size: int
    peeked: Any


def run_chain(
    make_loader: Callable[[int], Any],
    chain: Chain,
    epochs: int,
    *,
    seed: int = 0,
    restore_global_rngs: bool = False,
    restore_every_global_rng: bool = False,
    move_rngs_at_start: bool = False,
    peek_at: int | None = None,
    first_via_torch: bool = False,
    on_restored_batch: Callable[[Any, Any], None] | None = None,
) -> ChainRun:
    """Run the chain's programs one after the other (each saves, the next restores); return every
    batch in order. Restarted programs put back the saving program's global torch RNG
    (``restore_global_rngs``) or all three (``restore_every_global_rng``) after the load, else
    leave them elsewhere (``move_rngs_at_start``: also before the first batch). States alternate
    between :func:`round_trip`'s two ways; no save points is the uninterrupted run.
    ``on_restored_batch(loader, batch)`` sees each restored program's first batch.
    """
    out: list[Batch] = []
    ends: list[int] = []
    largest = 0
    peeked = None
    state: Any = None
    rng_states: tuple[Any, Any, torch.Tensor] | None = None  # python's, numpy's, torch's
    stops: Sequence[SavePoint | None] = [*chain.points, None]
    for number, (stop, workers) in enumerate(zip(stops, chain.workers)):
        program_start(seed)
        loader = make_loader(workers)
        try:
            if number:
                load(loader, state)
                if restore_every_global_rng and rng_states is not None:
                    random.setstate(rng_states[0])
                    np.random.set_state(rng_states[1])
                    torch.set_rng_state(rng_states[2])
                elif restore_global_rngs and rng_states is not None:
                    torch.set_rng_state(rng_states[2])
                elif chain.points[number - 1].batches or move_rngs_at_start:
                    # (by default a program restored from a state saved before the first
                    # batch is where a fresh start is: a checkpoint at step 0 of the same
                    # script)
                    move_global_rngs()
            program = TrainingLoop(
                loader, epochs, out, stop, number > 0, peek_at, on_restored_batch
            )
            stopped = program.run()
            ends += program.ends
            if program.peeked is not None:
                peeked = program.peeked
            if stop is not None:
                if not stopped:
                    raise RunFailed(
                        f"the run ended after {len(out)} batches, before the save point {stop}"
                    )
                state, size = round_trip(loader, via_torch=(number % 2 == 1) != first_via_torch)
                largest = max(largest, size)
                rng_states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        finally:
            close_loader(loader)
    return ChainRun(out, ends, largest, peeked)


def close_loader(loader: Any) -> None:
    """Close ``loader`` if it has a ``close()`` (a plain DataLoader has none)."""
    close = getattr(loader, "close", None)
    if close is not None:
        close()
