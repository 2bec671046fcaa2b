"""The stall warning: one clear log line when training waits for data, with a likely cause.

:class:`~energy_loader.metrics.LoaderMetrics` closes a window every
``StallPolicy.window_seconds``; when ``next()`` waited for more than ``threshold`` of the step
time in it, :class:`StallWarner` reads the window's worker numbers and logs one WARNING on the
``energy_loader`` logger naming the likely cause and what to try:

- ``num_workers=0``: the pipeline runs in the training process itself;
- one worker much busier than the others: a slow source or shard (a straggler);
- workers busy nearly all the time: the pipeline is slower than training (saturated);
- workers mostly idle while the loop waits: moving items to the main process is the
  bottleneck (transport bound), or the prefetch is too shallow to hide bursts.

Warnings back off: after one, the next needs 1, 2, 4, ... (up to 64) more stalled windows.
"""

from __future__ import annotations

import logging
from typing import Any

LOGGER = logging.getLogger("energy_loader")

_SATURATED = 0.7  # torch's own queue work counts as idle: 70% busy is flat out
_IDLE = 0.5


def diagnose(window: dict[str, Any], num_workers: int) -> str:
    """The likely cause of a data-bound window and what to try, in one or two sentences."""
    workers = window["workers"]
    busy = [w["busy_fraction"] for w in workers]
    if num_workers == 0:
        return (
            "the pipeline runs in the training process (num_workers=0), so every item is made "
            "while training waits; use num_workers > 0"
        )
    if not busy:
        return "no worker numbers were available; check the workers are alive"
    slowest = max(range(len(busy)), key=busy.__getitem__)
    if busy[slowest] >= _SATURATED and min(busy) < _IDLE and len(busy) > 1:
        return (
            f"worker {slowest} is busy {100 * busy[slowest]:.0f}% of the time while another is "
            f"busy only {100 * min(busy):.0f}%: a slow source or shard holds the others back "
            "(torch takes items from the workers in turn); look at that worker's partitions "
            "(cache misses, slow storage) or use more partitions per worker"
        )
    mean = sum(busy) / len(busy)
    if mean >= _SATURATED:
        return (
            f"the workers are saturated (busy {100 * mean:.0f}% of the time): making items "
            f"is slower than training consumes them; try more workers (now {num_workers}), a "
            "lighter map function (move augmentation to the GPU), or cheaper decoding"
        )
    items = max(1, window["items"])
    per_item = window["transport_bytes"] / items
    decode_share = window["decode_s"] / window["wait_s_sum"] if window["wait_s_sum"] > 0 else 0
    if mean < _IDLE:
        return (
            f"the workers are mostly idle (busy {100 * mean:.0f}%) while training waits, and "
            f"decoding takes {100 * decode_share:.0f}% of the wait ({per_item / 1e6:.2f} MB "
            "per item): moving items to the training process is the bottleneck (transport "
            "bound); try a larger prefetch_factor, smaller items (e.g. uint8 instead of "
            "float32), or pin_memory=False if it is on"
        )
    return (
        f"the workers are busy {100 * mean:.0f}% of the time, with bursts: try a larger "
        "prefetch_factor to hide uneven item costs, or more workers"
    )


class StallWarner:
    """Logs the stall warning for stalled windows, with exponential backoff."""

    def __init__(self, num_workers: int, threshold: float) -> None:
        self._num_workers = num_workers
        self._threshold = threshold
        self._skip = 0
        self._gap = 1
        self.warnings = 0

    def __call__(self, window: dict[str, Any]) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        self._skip, self._gap = self._gap, min(64, self._gap * 2)
        self.warnings += 1
        LOGGER.warning(
            "energy_loader: the training loop waited for data %.0f%% of its step time over the "
            "last %.1f s (%d steps, %.1f items/s, mean wait %.1f ms; warning threshold %.0f%%). "
            "Likely cause: %s. (Turn this off with SavableDataLoader(..., "
            "stall_warning=False).)",
            100 * window["wait_fraction"],
            window["seconds"],
            window["items"],
            window["items_per_s"],
            1000 * window["wait_s_mean"],
            100 * self._threshold,
            diagnose(window, self._num_workers),
        )
