"""What the data loader is doing: cheap counters, ``loader.stats()``, and a tqdm helper.

:class:`LoaderMetrics` (main process) times each item's wait in ``next()``, its decode and the
step, and saves; :class:`WorkerCounters` (each worker) counts busy seconds, items and bytes,
read over the command channel only when ``stats()`` or the stall check asks. Call ``stats()``
from the iterating thread. Fields and how to read them: docs/observability.md.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs

__all__ = [
    "WORKER_FIELDS",
    "LoaderMetrics",
    "StallPolicy",
    "WorkerCounters",
    "clock",
    "flatten",
    "resolve_stall_policy",
    "tqdm_postfix",
]

clock = time.perf_counter

# Fold the per-item wait list into the all-time histogram once it holds this many entries.
_FOLD_AT = 65536
# Histogram resolution: buckets per doubling of the wait time (about 19% wide).
_PER_OCTAVE = 4
_QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


WORKER_FIELDS = ("wall_s", "produce_s", "checkpoint_s", "encode_s", "items", "bytes")


class WorkerCounters:
    """Counters kept by one worker's iterating thread, read by its command thread: plain
    attributes, each read whole under the GIL (a reading may be one item behind).
    """

    __slots__ = ("bytes", "checkpoint_s", "encode_s", "items", "produce_s", "started")

    def __init__(self) -> None:
        self.started = clock()
        self.produce_s = self.checkpoint_s = self.encode_s = 0.0
        self.items = self.bytes = 0

    def read(self) -> dict[str, float]:
        """The counters and the seconds since this worker started, as plain data."""
        counters = {name: getattr(self, name) for name in WORKER_FIELDS[1:]}
        return {"wall_s": clock() - self.started, **counters}


@attrs.frozen
class StallPolicy:
    """When the loader warns that the training loop is waiting for data.

    It warns (logger ``energy_loader``) when, over a window of at least ``window_seconds`` and
    ``min_steps`` items, ``next()`` waited for more than ``threshold`` of the step time; each
    warning doubles the windows the next needs (up to 64). The first item after ``iter()``
    (worker start-up) is left out.
    """

    threshold: float = 0.3
    window_seconds: float = 60.0
    min_steps: int = 20

    def __attrs_post_init__(self) -> None:
        for name in ("threshold", "window_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"`{name}` must be a positive number (got {value!r})")
        if self.threshold >= 1:
            raise ValueError(
                f"`threshold` is a fraction of the step time below 1 (got {self.threshold})"
            )
        if isinstance(self.min_steps, bool) or not isinstance(self.min_steps, int):
            raise TypeError(f"`min_steps` must be an integer (got {self.min_steps!r})")
        if self.min_steps < 1:
            raise ValueError(f"`min_steps` must be at least 1 (got {self.min_steps})")


def resolve_stall_policy(value: Any) -> StallPolicy | None:
    """The loader's ``stall_warning`` argument: True (defaults), False/None (off), a
    threshold fraction, or a :class:`StallPolicy`."""
    if value is None or value is False:
        return None
    if value is True:
        return StallPolicy()
    if isinstance(value, StallPolicy):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return StallPolicy(threshold=float(value))
    raise TypeError(
        "`stall_warning` must be True, False, None, a threshold fraction such as 0.3, or a "
        f"StallPolicy (got {type(value).__name__}: {value!r})"
    )


class _Totals:
    """Monotonic main-process totals; a consumer's window is the difference of two copies."""

    __slots__ = (
        "decode_s",
        "items",
        "save_s",
        "save_s_max",
        "saves",
        "stall_items",
        "stall_step_s",
        "stall_wait_s",
        "wait_s",
        "wait_s_max",
        "workers",
    )

    def __init__(self, workers: int) -> None:
        self.items = self.saves = 0
        self.wait_s = self.wait_s_max = self.decode_s = self.save_s = self.save_s_max = 0.0
        # Sums over items whose step time is known (not the first after iter()).
        self.stall_items = 0
        self.stall_wait_s = self.stall_step_s = 0.0
        self.workers = [dict.fromkeys(WORKER_FIELDS, 0.0) for _ in range(workers)]

    def copy(self) -> _Totals:
        other = _Totals(0)
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        other.workers = [dict(w) for w in self.workers]
        return other


def _quantile_fields(sorted_waits: list[float]) -> dict[str, float]:
    count = len(sorted_waits)
    return {
        f"wait_s_{name}": sorted_waits[min(count - 1, int(q * count))] if count else 0.0
        for name, q in _QUANTILES
    }


def _bucket(seconds: float) -> int:
    if seconds <= 0:
        return -(10**6)
    mantissa, exponent = math.frexp(seconds)  # seconds = mantissa * 2**exponent, 0.5 <= m < 1
    return exponent * _PER_OCTAVE + int((mantissa - 0.5) * 2 * _PER_OCTAVE)


def _bucket_value(bucket: int) -> float:
    """The middle of a histogram bucket, in seconds."""
    if bucket == -(10**6):
        return 0.0
    exponent, sub = divmod(bucket, _PER_OCTAVE)
    low = (0.5 + sub / (2 * _PER_OCTAVE)) * 2.0**exponent
    high = (0.5 + (sub + 1) / (2 * _PER_OCTAVE)) * 2.0**exponent
    return (low + high) / 2


def _histogram_quantiles(histogram: Counter[int]) -> dict[str, float]:
    count = sum(histogram.values())
    out = {f"wait_s_{name}": 0.0 for name, _ in _QUANTILES}  # an empty histogram's
    for name, q in _QUANTILES:
        rank, seen = min(count - 1, int(q * count)), 0
        for bucket in sorted(histogram):
            seen += histogram[bucket]
            if seen > rank:
                out[f"wait_s_{name}"] = _bucket_value(bucket)
                break
    return out


class LoaderMetrics:
    """The main-process side: per-item timings, save timings, worker polls, windows. ``poll``
    returns each worker's :meth:`WorkerCounters.read` (None if it cannot be asked) and queue
    depths; ``on_window`` gets each closed stall window's numbers.
    """

    def __init__(
        self,
        workers: int,
        poll: Callable[[], tuple[list[dict[str, float] | None], list[int]]],
        stall: StallPolicy | None,
        on_window: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._poll = poll
        self._stall = stall
        self._on_window = on_window
        self.totals = _Totals(workers)
        self._waits: list[float] = []
        self._histogram: Counter[int] = Counter()
        self._last_end: float | None = None
        self._worker_seen: list[tuple[float, dict[str, float]] | None] = [None] * workers
        self._born = clock()
        self._base = self.totals.copy()
        self._base_time = self._born
        self._stall_base = self.totals.copy()
        self._stall_time = self._born
        self._check_at = math.inf if stall is None else self._born + stall.window_seconds

    def new_iterator(self) -> None:
        """A new ``iter()``: the next item's wait includes starting up, its step is unknown."""
        self._last_end = None

    def item(self, began: float, decode_s: float) -> None:
        """One item handed out; ``next()`` began at ``began`` (a :func:`clock` reading)."""
        end = clock()
        wait = end - began
        totals = self.totals
        totals.items += 1
        totals.wait_s += wait
        totals.decode_s += decode_s
        if wait > totals.wait_s_max:
            totals.wait_s_max = wait
        waits = self._waits
        waits.append(wait)
        if len(waits) >= _FOLD_AT:
            self._fold()
        last, self._last_end = self._last_end, end
        if last is not None:
            totals.stall_items += 1
            totals.stall_wait_s += wait
            totals.stall_step_s += end - last
        if end >= self._check_at:
            self._close_stall_window(end)

    def save(self, seconds: float) -> None:
        """One ``save_state_rank()`` took ``seconds``."""
        totals = self.totals
        totals.saves += 1
        totals.save_s += seconds
        totals.save_s_max = max(totals.save_s_max, seconds)

    def _fold(self) -> None:
        histogram = self._histogram
        for wait in self._waits:
            histogram[_bucket(wait)] += 1
        self._waits = []

    def _refresh_workers(self) -> list[int]:
        """Add every worker's progress since the last poll to the totals; the queue depths."""
        readings, depths = self._poll()
        totals = self.totals.workers
        for logical, reading in enumerate(readings):
            if reading is None or logical >= len(totals):
                continue
            previous = self._worker_seen[logical]
            # A restarted worker (its wall clock went back) counts from zero again.
            if previous is not None and reading["wall_s"] >= previous[1]["wall_s"]:
                before = previous[1]
            else:
                before = dict.fromkeys(WORKER_FIELDS, 0.0)
            for name in WORKER_FIELDS:
                totals[logical][name] += reading[name] - before[name]
            self._worker_seen[logical] = (clock(), reading)
        return depths

    @staticmethod
    def _section(now: _Totals, base: _Totals, seconds: float) -> dict[str, Any]:
        items = now.items - base.items
        wait = now.wait_s - base.wait_s
        step = now.stall_step_s - base.stall_step_s
        saves = now.saves - base.saves
        save_s = now.save_s - base.save_s
        workers = []
        for index, (a, b) in enumerate(zip(now.workers, base.workers)):
            delta = {name: a[name] - b[name] for name in WORKER_FIELDS}
            wall = delta.pop("wall_s")
            delta["busy_fraction"] = min(1.0, delta["produce_s"] / wall) if wall > 0 else 0.0
            workers.append({"worker": index, **delta})
        return {
            "seconds": seconds,
            "items": items,
            "items_per_s": items / seconds if seconds > 0 else 0.0,
            "wait_s_sum": wait,
            "wait_s_mean": wait / items if items else 0.0,
            "wait_fraction": ((now.stall_wait_s - base.stall_wait_s) / step if step > 0 else 0.0),
            "decode_s": now.decode_s - base.decode_s,
            "saves": saves,
            "save_s_sum": save_s,
            "save_s_mean": save_s / saves if saves else 0.0,
            "checkpoint_s": sum(w["checkpoint_s"] for w in workers),
            "encode_s": sum(w["encode_s"] for w in workers),
            "transport_bytes": int(sum(w["bytes"] for w in workers)),
            "busy_fraction_mean": (
                sum(w["busy_fraction"] for w in workers) / len(workers) if workers else 0.0
            ),
            "workers": workers,
        }

    def stats(self) -> dict[str, Any]:
        """Numbers since the previous call and in total, and each worker's queue depth."""
        depths = self._refresh_workers()
        now, at = self.totals, clock()
        window_waits = sorted(self._waits)
        since_last = self._section(now, self._base, at - self._base_time)
        since_last.update(_quantile_fields(window_waits))
        since_last["wait_s_max"] = window_waits[-1] if window_waits else 0.0
        self._fold()
        total = self._section(now, _Totals(len(now.workers)), at - self._born)
        total.update(_histogram_quantiles(self._histogram))
        total["wait_s_max"] = now.wait_s_max
        total["save_s_max"] = now.save_s_max
        self._base, self._base_time = now.copy(), at
        return {"since_last": since_last, "total": total, "queue_depth": depths}

    def _close_stall_window(self, end: float) -> None:
        stall = self._stall
        if stall is None:
            return
        now, base = self.totals, self._stall_base
        if now.stall_items - base.stall_items < stall.min_steps:
            return
        self._check_at = end + stall.window_seconds
        step = now.stall_step_s - base.stall_step_s
        fraction = (now.stall_wait_s - base.stall_wait_s) / step if step > 0 else 0.0
        if fraction > stall.threshold and self._on_window is not None:
            self._refresh_workers()
            self._on_window(self._section(now, base, end - self._stall_time))
        self._stall_base, self._stall_time = now.copy(), end


def flatten(stats: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """``stats()`` as one flat dict of numbers, e.g. ``{"since_last/wait_s_p50": 0.001}``, lists as
    ``workers/0/busy_fraction``: for loggers that take scalars (TensorBoard, wandb, MLflow).
    """
    if not isinstance(stats, dict):
        raise TypeError(f"`stats` must be the dict loader.stats() returns (got {stats!r})")
    out: dict[str, float] = {}
    for name, value in stats.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{key}/"))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, dict):
                    item = {k: v for k, v in item.items() if k != "worker"}
                    out.update(flatten(item, f"{key}/{index}/"))
                else:
                    out[f"{key}/{index}"] = item
        else:
            out[key] = value
    return out


def tqdm_postfix(stats: dict[str, Any], section: str = "since_last") -> dict[str, str]:
    """A short summary of ``stats()`` for ``tqdm``'s ``set_postfix``. Example::

    bar = tqdm(loader)
    for step, batch in enumerate(bar):
        if step % 100 == 0:
            bar.set_postfix(energy_loader.metrics.tqdm_postfix(loader.stats()))
    """
    if not isinstance(stats, dict) or section not in stats:
        raise ValueError(
            f"`stats` must be the dict loader.stats() returns, with a {section!r} section "
            "(section is 'since_last' or 'total')"
        )
    part = stats[section]
    return {
        "it/s": f"{part['items_per_s']:.1f}",
        "wait": f"{100 * part['wait_fraction']:.0f}%",
        "p90": f"{1000 * part['wait_s_p90']:.1f}ms",
        "busy": f"{100 * part['busy_fraction_mean']:.0f}%",
    }
