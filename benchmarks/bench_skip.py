"""What ``loader.skip(n)`` costs against handing the same batches out, side by side.

On the reference workload (60k samples of 64 tokens, map -> shuffle buffer 1000 -> batch 32,
2 workers, prefetch 2; docs/benchmarks.md), each repetition in fresh subprocesses, interleaved:

- ``iterate``: a ``for`` loop takes ``--batches`` batches after the first and does nothing
  with them (the cost of handing them out);
- ``skip``: ``loader.skip(--batches)`` after the first batch;
- ``restore``: a state saved after the first batch, restored into a fresh loader, and its
  first batch taken (a restore's start, for scale).

Reported: the median seconds of each, and ``skip`` against ``iterate`` within a repetition.
A skip makes the items it leaves out (as a restore's replay does), so the ratio is ~1; the
number says what the loop body saves. Example::

    python benchmarks/bench_skip.py --repetitions 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
VARIANTS = ("iterate", "skip", "restore")


def _child(variant: str, batches: int) -> float:
    from energy_loader.cli.bench import savable_loader

    loader = savable_loader(60_000)
    iterator = iter(loader)
    next(iterator)  # the workers started
    if variant == "restore":
        state = loader.state_dict()
        loader.close()
        loader = savable_loader(60_000)
        began = time.perf_counter()
        loader.load_state_dict(state)
        next(iter(loader))
        return time.perf_counter() - began
    began = time.perf_counter()
    if variant == "skip":
        loader.skip(batches)
    else:
        for _, _batch in zip(range(batches), iterator):
            pass
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=1000, help="batches skipped or taken")
    parser.add_argument("--repetitions", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child is not None:
        print(json.dumps(_child(options.child, options.batches)))
        return 0
    results: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for repetition in range(options.repetitions):
        shift = repetition % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            done = subprocess.run(
                [sys.executable, __file__, "--child", variant, "--batches", str(options.batches)],
                capture_output=True, text=True, cwd=HERE, check=True,
            )  # fmt: skip
            results[variant].append(json.loads(done.stdout.splitlines()[-1]))
        print(f"repetition {repetition + 1}/{options.repetitions} done", file=sys.stderr)
    ratio = statistics.median(s / i for s, i in zip(results["skip"], results["iterate"]))
    print(f"\n{options.batches} batches of the reference workload, 2 workers, median of "
          f"{options.repetitions} interleaved repetitions\n")  # fmt: skip
    print("| variant | seconds | x iterate (paired) |\n|---|---:|---:|")
    for variant in VARIANTS:
        seconds = statistics.median(results[variant])
        shown = f"{ratio:.2f}" if variant == "skip" else ("1.00" if variant == "iterate" else "")
        print(f"| {variant} | {seconds:.3f} | {shown} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
