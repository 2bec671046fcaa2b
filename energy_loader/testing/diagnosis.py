"""Why a restored run differs from the uninterrupted one: the first batch that differs, and
whose fault it is (the uninterrupted run is not reproducible, the restored loop is in another
epoch, or the restore went elsewhere), told apart by running again. See docs/dropin.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..state.fingerprint import FROM_FN, user_functions
from .compare import first_difference
from .runs import UNREPLAYABLE, Batch, Chain, ChainRun, close_loader, run_chain

__all__ = ["Difference", "ResumeMismatch", "compare_runs", "diagnose", "unseeded_draws"]


@attrs.frozen
class _Words:
    """How a message names the parts of one kind of loader: a drop-in's batches are dataset
    indices made by ``__getitem__`` in a sampler's order; a pipeline's items are restore keys
    made by its stages (a source's read, a map, a filter) in an order its stages set."""

    keys: str
    maker: str
    made_from: str
    order: str
    fix_order: str


_DROPIN_WORDS = _Words(
    keys="dataset indices",
    maker="__getitem__ (or collate_fn)",
    made_from="the index",
    order="the sampler",
    fix_order="give it a seeded torch.Generator (generator=) or a state_dict()/load_state_dict()",
)
_PIPELINE_WORDS = _Words(
    keys="restore keys",
    maker="a stage of the pipeline (a map function, a filter's predicate, a source's read)",
    made_from="the sample",
    order="the pipeline's order (a source's shuffle, a filter's predicate, a buffer)",
    fix_order="make every stage a function of the sample and the seeds the loader gives it "
    "(seed_per_sample=True, the IndexedSource/ShuffleBufferDataset seeds)",
)


class ResumeMismatch(AssertionError):
    """A restored loader diverged from the uninterrupted run; the message says where and why."""


@attrs.frozen
class Difference:
    """The first batch (its number in the run) where two runs differ, and how."""

    number: int
    detail: str
    epoch_differs: bool = False
    rngs_differ: bool = False  # the batch is right; the global RNGs after it are not


def compare_runs(
    expected: Sequence[Batch], got: Sequence[Batch], *, rngs: Sequence[str] = ()
) -> Difference | None:
    """``None`` when both runs hand out the same batches in the same epochs, with the global
    RNGs named in ``rngs`` (``"python"``, ``"numpy"``, ``"torch"``) where the uninterrupted run
    had them after each batch, else the first difference."""
    for want, have in zip(expected, got):
        if want.epoch != have.epoch:
            return Difference(
                want.number,
                f"the loop was in epoch {have.epoch} where the uninterrupted run was in epoch "
                f"{want.epoch}",
                epoch_differs=True,
            )
        detail = first_difference(want.value, have.value, "batch")
        if detail is not None:
            return Difference(want.number, detail)
        moved = [
            name
            for name in rngs
            if want.rngs is not None
            and have.rngs is not None
            and want.rngs[name] != have.rngs[name]
        ]
        if moved:
            return Difference(
                want.number,
                f"the batch is right, but {' and '.join(moved)}'s global RNG stood elsewhere "
                "after it than in the uninterrupted run: the loader drew from the training "
                "process's generator differently (a model with dropout trains other weights)",
                rngs_differ=True,
            )
    if len(expected) != len(got):
        number = min(len(expected), len(got))
        longer = expected if len(expected) > len(got) else got
        return Difference(
            number,
            f"the uninterrupted run handed out {len(expected)} batches, this one {len(got)}: "
            f"batch {number} (epoch {longer[number].epoch}) is "
            f"{'missing' if longer is expected else 'one too many'}",
        )
    return None


def _where(run: Sequence[Batch], number: int) -> str:
    if number >= len(run):
        return f"batch {number}"
    epoch = run[number].epoch
    in_epoch = sum(1 for batch in run[:number] if batch.epoch == epoch)
    return f"batch {number} (epoch {epoch}, its batch {in_epoch})"


def diagnose(
    make: Callable[[int], Any],
    chain: Chain,
    epochs: int,
    seed: int,
    full: ChainRun,
    got: ChainRun,
    difference: Difference,
) -> str:
    """A sentence on the first difference between ``got`` (``chain``'s run) and ``full`` (the
    uninterrupted run), and its cause (found by running both again, see the module's doc)."""
    from ..loader.dropin.build import runs_dropin

    uninterrupted = Chain((), chain.workers[:1])
    probe = make(chain.workers[0])  # built, not iterated, to tell the words for its parts
    try:
        words = _DROPIN_WORDS if runs_dropin(probe) else _PIPELINE_WORDS
    finally:
        close_loader(probe)
    again = run_chain(make, uninterrupted, epochs, seed=seed)
    repeat = compare_runs(full.batches, again.batches)
    if repeat is not None:
        number = repeat.number
        first = run_chain(make, uninterrupted, epochs, seed=seed, peek_at=number).peeked
        second = run_chain(make, uninterrupted, epochs, seed=seed, peek_at=number).peeked
        builder = builder_differs(make, chain.workers[0])
        return (
            "the uninterrupted run itself is not reproducible: run twice from the same seeds, "
            f"{_where(full.batches, number)} differs ({repeat.detail}); "
            + (builder or _not_reproducible(first, second, words))
        )
    where = _where(full.batches, difference.number)
    if difference.rngs_differ:
        return f"{where}: {difference.detail}"
    if difference.epoch_differs:
        return (
            f"{where}: {difference.detail} (the epoch loader.epoch gives after the restore is "
            "not the uninterrupted run's: the loop skips or repeats an epoch)"
        )
    if difference.number >= min(len(full.batches), len(got.batches)):
        return f"{where}: {difference.detail}"
    theirs = run_chain(make, uninterrupted, epochs, seed=seed, peek_at=difference.number).peeked
    ours = run_chain(make, chain, epochs, seed=seed, peek_at=difference.number).peeked
    why = _restore_went_elsewhere(theirs, ours, words)
    if theirs == ours and UNREPLAYABLE not in (theirs, ours) and theirs is not None:
        probe = make(chain.workers[0])
        try:
            why += "; " + unseeded_draws(probe)
        finally:
            close_loader(probe)
    return f"{where} differs ({difference.detail}); " + why


def builder_differs(make: Callable[[int], Any], workers: int) -> str | None:
    """A sentence when two loaders ``make`` builds have different configs (the builder makes
    another loader on each call), else ``None``."""
    loaders = [make(workers), make(workers)]
    try:
        first, second = (getattr(loader, "config", None) for loader in loaders)
        if not callable(first) or not callable(second):
            return None
        difference = first_difference(first(), second(), "config")
    finally:
        for loader in loaders:
            close_loader(loader)
    if difference is None:
        return None
    return (
        f"the builder makes another loader on each call ({difference}): check_resume builds "
        "the loader anew for every run, as a restarted program does; build it from fixed "
        "arguments (no counter, clock or unseeded generator in the builder)"
    )


def unseeded_draws(loader: Any) -> str:
    """The likely cause of samples whose randomness is not reproduced from their keys, for
    ``loader``: the stages it runs with ``seed_per_sample=False`` by name, else a function
    drawing from a generator of its own, or an ``IndexedSource.from_fn`` function (unseeded
    by default) drawing random numbers."""
    stages: list[str] = []
    if getattr(loader, "seed_per_sample", True) is False:
        stages.append("the loader (SavableDataLoader(..., seed_per_sample=False))")
    config = getattr(loader, "config", None)
    functions = []
    if callable(config):  # a drop-in's config has no "pipeline": no stage to name
        functions = [f for f in user_functions(config().get("pipeline")) if f.unseeded]
        stages += [f.call() for f in functions if f.argument != FROM_FN]
    if stages:
        return (
            f"likely cause: {', '.join(stages)} draws random numbers with seed_per_sample=False, "
            "so they are not re-made from the sample's restore key; keep the default "
            "seed_per_sample=True for a function that draws random numbers"
        )
    # from_fn's function runs unseeded unless asked (most draw nothing): named beside the
    # generator of its own, not instead of it.
    from_fn = [f.call() for f in functions if f.argument == FROM_FN]
    also = (
        f"; or {', '.join(from_fn)}, which runs without per-sample seeds "
        "(seed_per_sample=False, from_fn's default), draws random numbers: build it with "
        "seed_per_sample=True"
        if from_fn
        else ""
    )
    return (
        "likely cause: a function (a map, a filter, __getitem__ or collate_fn) draws from a "
        "generator of its own that nobody seeds per sample (random.Random(), "
        "np.random.default_rng(), a torch.Generator made once); draw from python's random, "
        "numpy's global RNG or torch's default generator instead, which the loader seeds per "
        f"sample{also}"
    )


def _unseen_source(words: _Words) -> str:
    return (
        f"{words.order} depends on something the loader neither sees nor saves (re-run with "
        "python's, numpy's and torch's global RNGs elsewhere it gives other "
        f"{words.keys}: it draws from python's random or numpy's global RNG, the clock, "
        f"os.urandom); {words.fix_order}"
    )


def _not_reproducible(first: Any, second: Any, words: _Words) -> str:
    if UNREPLAYABLE in (first, second):
        return _unseen_source(words)
    if first is None or second is None:
        return (
            f"the loader cannot tell the batch's {words.keys} (an iterable dataset, or a "
            "sampler with its own state): the dataset, collate_fn or sampler depends on "
            "something besides the seeds (the clock, a counter, a generator nobody seeds)"
        )
    if first != second:
        return (
            f"its {words.keys} differ ({first} vs {second}): {words.order} draws from "
            "something nobody seeds or saves (the clock, os.urandom, a counter, a generator "
            f"of its own); {words.fix_order}"
        )
    return (
        f"the same {words.keys} ({first}) gave other samples: {words.maker} depends on "
        f"something besides {words.made_from} and the global RNGs the loader seeds per sample "
        "(it reads the clock, a counter, a file that changes, or a generator of its own); "
        f"make it a function of {words.made_from} and those RNGs"
    )


def _restore_went_elsewhere(theirs: Any, ours: Any, words: _Words) -> str:
    if UNREPLAYABLE in (theirs, ours):
        return f"the restore cannot reproduce {words.order}'s position: " + _unseen_source(words)
    if theirs is None or ours is None:
        return (
            f"the restore went elsewhere (the loader cannot tell the batch's {words.keys}: "
            "an iterable dataset, or a sampler with its own state, restored to another "
            "position, or samples whose randomness differs after the restore)"
        )
    if theirs != ours:
        return (
            f"the restored loader hands out other {words.keys} ({ours}, the uninterrupted "
            f"run {theirs}): the restore did not reproduce {words.order}'s position or its "
            "draws"
        )
    return (
        f"the same {words.keys} ({ours}) gave other samples after the restore: the "
        "samples' randomness (or the dataset's own state) differs from the uninterrupted run's"
    )
