"""The picture in docs/observability.md: ``loader.stats()`` with a fast and a slow map.

Runs the reference workload (energy_loader.cli.bench, 2 workers) under a simulated
training loop that takes ``--step-ms`` per batch, once with the reference map (fast) and once
with a map that burns ``--slow-us`` of CPU per sample, reads ``loader.stats()`` every 20
steps and plots, per window, the share of the step time spent waiting in ``next()`` and the
workers' mean busy fraction. Needs matplotlib. Example::

    python benchmarks/plot_stats.py --out docs/observability.png
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from energy_loader import (
    BatchDataset,
    IndexedSource,
    MapDataset,
    SavableDataLoader,
    ShuffleBufferDataset,
)
from energy_loader.cli.bench import BATCH, make_sample, tokenize


class SlowTokenize:
    """The reference map plus ``micros`` of busy CPU per sample (a heavy augmentation)."""

    def __init__(self, micros: int) -> None:
        self.micros = micros

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        until = time.perf_counter() + self.micros / 1e6
        while time.perf_counter() < until:
            pass
        return tokenize(sample)


def _windows(loader: SavableDataLoader, steps: int, step_s: float) -> list[dict[str, Any]]:
    iterator = iter(loader)
    next(iterator)  # worker start-up
    loader.stats()
    windows = []
    for step in range(1, steps + 1):
        next(iterator)
        until = time.perf_counter() + step_s  # the training step (busy, as a GPU launch is)
        while time.perf_counter() < until:
            pass
        if step % 20 == 0:
            windows.append(loader.stats()["since_last"])
    loader.reset_state()
    return windows


def _pipeline(slow_us: int) -> Any:
    """The reference pipeline (as energy_loader.cli.bench builds it), map swapped."""
    source = IndexedSource.from_fn(20_000, make_sample, shuffle=True, seed=0)
    mapped = MapDataset(source, SlowTokenize(slow_us) if slow_us else tokenize)
    return BatchDataset(ShuffleBufferDataset(mapped, 1000), BATCH)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/observability.png"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--slow-us", type=int, default=250)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for name, slow in (("fast map", 0), (f"slow map (+{args.slow_us} us/sample)", args.slow_us)):
        loader = SavableDataLoader(_pipeline(slow), num_workers=2, stall_warning=False)
        runs[name] = _windows(loader, args.steps, args.step_ms / 1000)
        last = runs[name][-1]
        print(
            f"{name}: wait {100 * last['wait_fraction']:.0f}% of the step, p90 wait "
            f"{1000 * last['wait_s_p90']:.2f} ms, workers busy "
            f"{100 * last['busy_fraction_mean']:.0f}%, {last['items_per_s']:.0f} batches/s"
        )
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, windows in runs.items():
        steps = [20 * (i + 1) for i in range(len(windows))]
        left.plot(steps, [100 * w["wait_fraction"] for w in windows], marker="o", label=name)
        right.plot(steps, [100 * w["busy_fraction_mean"] for w in windows], marker="o", label=name)
    left.set(xlabel="step", ylabel="% of step time waiting in next()", ylim=(0, 100))
    left.set_title("Is data my bottleneck? (wait_fraction)")
    right.set(xlabel="step", ylabel="% of time workers are busy", ylim=(0, 105))
    right.set_title("Why? (busy_fraction_mean)")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(
        f"reference workload, 2 workers, training step {args.step_ms:g} ms; stats() every 20 steps",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
