"""check_resume: prove that save -> fresh loader -> restore -> continue is exact.

The uninterrupted run is recorded as a list of *events*: every sample, and an ``END`` event
each time ``iter(loader)`` reported the end of an epoch. A stop point ``k`` means "the training
loop consumed the first ``k`` events, then saved": stopping right before an ``END`` is a save
after the last sample of an epoch, right after one is a save after the end was reported. The
restored loader must then produce exactly ``events[k:]``: the same samples, restore keys
included, and the same epoch ends.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from ..dataset import SavableDataset, restore_key_of
from ..loader import SavableDataLoader
from .compare import first_difference

__all__ = ["END", "ResumeMismatch", "ResumeReport", "check_resume", "record_events"]


class _End:
    def __repr__(self) -> str:
        return "END"


END: Any = _End()


class ResumeMismatch(AssertionError):
    """A restored loader diverged from the uninterrupted run; the message says where."""


@attrs.frozen
class ResumeReport:
    """What :func:`check_resume` checked."""

    events: int
    epochs: int
    stop_points: tuple[int, ...]
    state_bytes: int


def _make_loader(
    build_fn: Callable[[], Any], num_workers: int, loader_kwargs: dict[str, Any]
) -> SavableDataLoader:
    built = build_fn()
    if isinstance(built, SavableDataLoader):
        return built
    if isinstance(built, SavableDataset):
        return SavableDataLoader(built, num_workers=num_workers, **loader_kwargs)
    raise TypeError(
        f"build_fn must return a SavableDataset or a SavableDataLoader (got {type(built).__name__})"
    )


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


def _round_trip(state: dict[str, Any], via_torch: bool) -> tuple[dict[str, Any], int]:
    text = json.dumps(state)
    if not via_torch:
        return json.loads(text), len(text)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True), len(text)


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
    stop_points: Sequence[int] | None = None,
    loader_kwargs: dict[str, Any] | None = None,
    check_restore_sample: bool = True,
) -> ResumeReport:
    """Check that a pipeline resumes exactly; raise :class:`ResumeMismatch` if not.

    ``build_fn()`` returns a fresh pipeline (a ``SavableDataset``, wrapped in a
    ``SavableDataLoader(num_workers=..., **loader_kwargs)``) or a fresh loader. For each stop
    point the loader is run to that point, its state goes through ``json`` (and, for every
    other stop point, ``torch.save``/``torch.load(weights_only=True)``), a new loader from
    ``build_fn()`` restores it, and its continuation must equal the uninterrupted run's (an
    epoch whose items had all been taken when the state was saved is over: the restored
    loader goes on with the next epoch).
    Default stop points: the start, the first sample, mid-epoch, right before and right after
    the first epoch end, and the last sample. Use it in your own test suite::

        def test_my_pipeline_resumes():
            check_resume(lambda: build_my_pipeline(small=True), num_workers=2)
    """
    kwargs = dict(loader_kwargs or {})
    full, _ = record_events(_make_loader(build_fn, num_workers, kwargs), epochs)
    if stop_points is None:
        first_end = full.index(END)
        stop_points = sorted({0, 1, first_end // 2, first_end, first_end + 1, len(full) - 1})
    largest = 0
    for number, stop in enumerate(stop_points):
        if not 0 <= stop <= len(full):
            raise ValueError(f"stop point {stop} is outside the run of {len(full)} events")
        loader = _make_loader(build_fn, num_workers, kwargs)
        head, ended = record_events(loader, epochs, stop=stop)
        state, size = _round_trip(loader.save_state_rank(), via_torch=number % 2 == 1)
        largest = max(largest, size)
        del loader
        if stop < len(full) and full[stop] is END:
            # Every item of the epoch was taken: the epoch is over, and the restored loader's
            # next iter() starts the next one without reporting this end again.
            head, ended = [*head, END], ended + 1
        restored = _make_loader(build_fn, num_workers, kwargs)
        restored.restore_state_rank(state)
        tail, _ = record_events(restored, epochs - ended)
        problem = compare_events(full, head + tail)
        if problem is not None:
            raise ResumeMismatch(
                f"resume after {stop} events (num_workers={num_workers}) is not exact: {problem}"
            )
        if check_restore_sample and tail:
            sample = next((e for e in tail if e is not END), None)
            key = restore_key_of(sample) if sample is not None else None
            if key is not None:
                rebuilt = restored.restore_sample(key)
                detail = first_difference(sample, rebuilt)
                if detail is not None:
                    raise ResumeMismatch(
                        f"restore_sample({key!r}) differs from the sample: {detail}"
                    )
        del restored
    return ResumeReport(
        events=len(full), epochs=epochs, stop_points=tuple(stop_points), state_bytes=largest
    )
