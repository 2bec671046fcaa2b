"""check_resume and check_loader_resume: prove that save -> fresh loader -> restore ->
continue is exact, for a pipeline or for any loader setup of yours.

Both run :mod:`.runs`' loop uninterrupted and restarted at stop points (chains of them) and
compare every batch with its epoch; :mod:`.diagnosis` explains a difference.
:func:`record_events` and :func:`compare_events` serve other harnesses.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from torch.utils.data import IterableDataset

from ..dataset import SavableDataset, restore_key_of
from ..errors import StateMismatchError
from ..loader import SavableDataLoader
from ..validation import require_int
from .compare import first_difference
from .diagnosis import (
    ResumeMismatch,
    builder_differs,
    compare_runs,
    diagnose,
    unseeded_draws,
)
from .runs import Chain, ChainRun, RunFailed, SavePoint, close_loader, run_chain

__all__ = [
    "END",
    "ResumeMismatch",
    "ResumeReport",
    "check_loader_resume",
    "check_resume",
    "record_events",
]


class _End:
    def __repr__(self) -> str:
        return "END"


END: Any = _End()


@attrs.frozen
class ResumeReport:
    """What :func:`check_resume` or :func:`check_loader_resume` checked: the uninterrupted
    run's events (batches and loop ends), the epochs, each stop point or chain of stop
    points, and the largest saved state (JSON characters, or bytes through ``torch.save``)."""

    events: int
    epochs: int
    stop_points: tuple[int | tuple[int, ...], ...]
    state_bytes: int


def record_events(
    loader: Iterable[Any], epochs: int, *, stop: int | None = None
) -> tuple[list[Any], int]:
    """Run ``epochs`` epochs (or until ``stop`` events); returns (events, epochs ended)."""
    events: list[Any] = []
    ended = 0
    while ended < epochs:
        iterator = iter(loader)
        while True:
            if stop is not None and len(events) >= stop:
                return events, ended
            try:
                events.append(next(iterator))
            except StopIteration:
                events.append(END)
                ended += 1
                break
    return events, ended


def _describe(event: Any) -> str:
    if event is END:
        return "END (end of epoch)"
    key = restore_key_of(event)
    return f"sample with restore key {key!r}" if key is not None else f"sample {event!r}"[:200]


def compare_events(expected: Sequence[Any], got: Sequence[Any], *, offset: int = 0) -> str | None:
    """``None`` when equal, else a report of the first divergence."""
    for position, (want, have) in enumerate(zip(expected, got)):
        if want is END or have is END:
            same = want is have
            detail = None if same else "an epoch end where a sample was expected (or vice versa)"
        else:
            detail = first_difference(want, have)
        if detail is not None:
            return (
                f"first divergence at event {offset + position}: expected {_describe(want)}, "
                f"got {_describe(have)} ({detail})"
            )
    if len(expected) != len(got):
        longer = expected if len(expected) > len(got) else got
        return (
            f"expected {len(expected)} events in all, got {len(got)}; first extra or "
            f"missing: {_describe(longer[min(len(expected), len(got))])}"
        )
    return None


def check_resume(
    build_fn: Callable[[], Any],
    *,
    num_workers: int = 0,
    epochs: int = 2,
    stop_points: Sequence[int | Sequence[int]] | None = None,
    loader_kwargs: dict[str, Any] | None = None,
    check_restore_sample: bool = True,
) -> ResumeReport:
    """Check that a pipeline resumes exactly; raise :class:`ResumeMismatch` if not.

    ``build_fn()`` returns a fresh pipeline (run in ``SavableDataLoader(num_workers=...,
    **loader_kwargs)``) or loader. Stop point ``k``: save after the first ``k`` events (samples,
    and an end after each ``for`` loop); a tuple chains restarts. States go through ``json`` and
    ``torch.save`` in turn; restored runs must equal the uninterrupted one, epochs and restored
    global RNGs included. Default: the start, first and last sample, mid-epoch, around the first
    epoch end, and a chain through it::

        def test_my_pipeline_resumes():
            check_resume(lambda: build_my_pipeline(small=True), num_workers=2)
    """
    kwargs = dict(loader_kwargs or {})

    def make(workers: int) -> SavableDataLoader:
        built = build_fn()
        if isinstance(built, SavableDataLoader):
            return built
        if isinstance(built, SavableDataset):
            return SavableDataLoader(built, num_workers=workers, **kwargs)
        raise TypeError(
            "build_fn must return a SavableDataset or a SavableDataLoader (got "
            f"{type(built).__name__})"
        )

    problems: list[str] = []

    def same_sample(loader: Any, sample: Any) -> None:
        key = restore_key_of(sample)
        if key is None:
            return
        detail = first_difference(sample, loader.restore_sample(key))
        if detail is not None:
            problems.append(
                f"restore_sample({key!r}) differs from the sample: {detail}; restore_sample "
                f"re-makes a sample from its restore key alone: {unseeded_draws(loader)} (or "
                "pass check_restore_sample=False if you never replay samples)"
            )

    return _check(
        make,
        num_workers=num_workers,
        restore_workers=(num_workers,),
        epochs=epochs,
        stop_points=stop_points,
        draws=0,
        seed=0,
        on_restored_batch=same_sample if check_restore_sample else None,
        problems=problems,
    )


def check_loader_resume(
    make_loader: Callable[[int], Any],
    *,
    num_workers: int = 0,
    restore_workers: Sequence[int] | None = None,
    epochs: int = 2,
    stop_points: Sequence[int | Sequence[int]] | None = None,
    draws: int = 3,
    seed: int = 0,
) -> ResumeReport:
    """Check that your own loader setup resumes exactly; raise :class:`ResumeMismatch` if not.

    ``make_loader(num_workers)`` builds your ``SavableDataLoader`` as your script does. A
    training loop (seeded globals, ``sampler.set_epoch``, steps drawing from the global RNGs)
    runs uninterrupted, then restarted at :func:`check_resume`'s save points plus ``draws``
    chains drawn from ``seed``, on each of ``restore_workers`` (default: ``num_workers`` and one
    other). The error names the first differing batch, the chain, and why. Example::

        check_loader_resume(lambda n: SavableDataLoader(MyDataset(), batch_size=4, shuffle=True,
                                                        num_workers=n), num_workers=2)
    """
    require_int(num_workers, "num_workers", minimum=0)
    require_int(draws, "draws", minimum=0)
    if restore_workers is None:
        probe = make_loader(num_workers)
        iterable = isinstance(getattr(probe, "dataset", None), IterableDataset)
        close_loader(probe)
        restore_workers = (num_workers,) if iterable else (num_workers, 0 if num_workers else 2)
    restore_workers = tuple(restore_workers)
    if not restore_workers:
        raise ValueError("`restore_workers` must name at least one worker count (got none)")
    for count in restore_workers:
        require_int(count, "restore_workers[...]", minimum=0)
    return _check(
        make_loader,
        num_workers=num_workers,
        restore_workers=restore_workers,
        epochs=epochs,
        stop_points=stop_points,
        draws=draws,
        seed=seed,
    )


def _events_of(run: ChainRun) -> list[SavePoint]:
    """The uninterrupted run's save points in event order: index ``k`` is "after the first
    ``k`` events" (samples and loop ends)."""
    points = [SavePoint(0)]
    ends = list(run.ends)
    for count in range(len(run.batches) + 1):
        if count:
            points.append(SavePoint(count))
        while ends and ends[0] == count:
            points.append(SavePoint(count, after_loop=True))
            ends.pop(0)
    return points


def _default_stops(events: list[SavePoint]) -> list[tuple[int, ...]]:
    total = len(events) - 1
    first_end = next((k for k, p in enumerate(events) if p.after_loop), total) - 1
    last = total - 1 if events[total].after_loop else total
    singles = {0, min(1, total), first_end // 2, first_end, first_end + 1, last}
    later = sorted({max(first_end + 1, (first_end + total) // 2), last})
    chain = (first_end, first_end, *(k for k in later if k > first_end))
    out: list[tuple[int, ...]] = [(k,) for k in sorted(singles) if 0 <= k <= total]
    return [*out, chain] if all(0 <= k <= total for k in chain) else out


def _check(
    make: Callable[[int], Any],
    *,
    num_workers: int,
    restore_workers: tuple[int, ...],
    epochs: int,
    stop_points: Sequence[int | Sequence[int]] | None,
    draws: int,
    seed: int,
    on_restored_batch: Callable[[Any, Any], None] | None = None,
    problems: list[str] | None = None,
) -> ResumeReport:
    """The shared core: the uninterrupted run, then each chain of stop points against it
    (``problems``: what ``on_restored_batch`` found, raised once the batches are equal)."""
    require_int(epochs, "epochs", minimum=1)
    full = run_chain(make, Chain((), (num_workers,)), epochs, seed=seed)
    events = _events_of(full)
    total = len(events) - 1
    if stop_points is None:
        chains = _default_stops(events)
    else:
        chains = [(stop,) if isinstance(stop, int) else tuple(stop) for stop in stop_points]
    draw = random.Random(seed)
    for _ in range(draws):
        chains.append(tuple(sorted(draw.randint(0, total) for _ in range(draw.randint(1, 3)))))
    largest = 0
    for number, stops in enumerate(chains):
        for stop in stops:
            if not 0 <= stop <= total:
                raise ValueError(f"stop point {stop} is outside the run of {total} events")
        if list(stops) != sorted(stops):
            raise ValueError(f"the stop points of a chain must not decrease (got {list(stops)})")
        workers = tuple(
            restore_workers[(number + i) % len(restore_workers)] for i in range(len(stops))
        )
        chain = Chain(tuple(events[k] for k in stops), (num_workers, *workers))
        # Every other chain follows the docs' recipe (the restarted program puts back the
        # global RNG states saved with the checkpoint) and then must draw as the uninterrupted
        # run did after every batch: a model with dropout trains the same weights. The others
        # leave them elsewhere, as a program that does not save them.
        recipe = number % 2 == 0
        try:
            got = run_chain(
                make,
                chain,
                epochs,
                seed=seed,
                restore_every_global_rng=recipe,
                first_via_torch=number % 2 == 1,
                on_restored_batch=on_restored_batch,
            )
        except RunFailed as failure:
            raise ResumeMismatch(f"{chain}: {failure}") from None
        except StateMismatchError as refusal:  # the restore checked itself: not resumable
            builder = builder_differs(make, num_workers)
            why = f" ({builder})" if builder else ""
            raise ResumeMismatch(
                f"{chain}: the restore refused to continue: {refusal}{why}"
            ) from None
        largest = max(largest, got.state_size)
        rngs = ("python", "numpy", "torch") if recipe else ()
        difference = compare_runs(full.batches, got.batches, rngs=rngs)
        if difference is not None:
            why = diagnose(make, chain, epochs, seed, full, got, difference)
            raise ResumeMismatch(f"resume is not exact ({chain}): {why}")
        if problems:
            raise ResumeMismatch(f"{chain}: {problems[0]}")
    return ResumeReport(
        events=total,
        epochs=epochs,
        stop_points=tuple(c[0] if len(c) == 1 else c for c in chains),
        state_bytes=largest,
    )
