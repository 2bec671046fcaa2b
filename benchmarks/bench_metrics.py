"""What ``loader.stats()``'s always-on counters cost: this tree vs a tree without them.

Runs the reference workload (energy_loader.cli.bench: 64-token samples -> map ->
shuffle buffer of 1000 -> batch of 32, 2 workers, prefetch 2) for one epoch with this
checkout's ``energy_loader`` and with a baseline checkout (the commit before the counters),
each run in a fresh subprocess, interleaved over ``--repetitions`` rounds in alternating
order. Prints the median samples/s of each and the median of the per-round ratios. Example::

    git archive af91761 energy_loader | tar -x -C /tmp/el-base
    python benchmarks/bench_metrics.py --baseline /tmp/el-base --repetitions 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_RUN = """
import json, sys, time
from energy_loader import SavableDataLoader
try:
    from energy_loader.cli.bench import savable_pipeline
except ImportError:  # a tree from before the bench's workloads left cli/bench/
    from energy_loader.cli.bench.workloads import savable_pipeline
loader = SavableDataLoader(savable_pipeline({samples}), num_workers=2, prefetch_factor=2)
iterator = iter(loader)
first = next(iterator)
count, start = 0, time.perf_counter()
for batch in iterator:
    count += len(batch["index"])
elapsed = time.perf_counter() - start
print(json.dumps({{"samples_per_s": count / elapsed}}))
loader.reset_state()
"""

HERE = Path(__file__).resolve().parents[1]


def _run(tree: Path, samples: int) -> float:
    result = subprocess.run(
        [sys.executable, "-c", _RUN.format(samples=samples)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    return float(json.loads(result.stdout.strip().splitlines()[-1])["samples_per_s"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="tree without counters")
    parser.add_argument("--samples", type=int, default=60_000)
    parser.add_argument("--repetitions", type=int, default=7)
    args = parser.parse_args(argv)
    if args.repetitions < 1 or args.samples < 64:
        parser.error("--repetitions must be >= 1 and --samples >= 64")
    rows: dict[str, list[float]] = {"baseline": [], "with counters": []}
    for round_ in range(args.repetitions):
        order = [("baseline", args.baseline), ("with counters", HERE)]
        if round_ % 2:
            order.reverse()
        for name, tree in order:
            rows[name].append(_run(tree, args.samples))
            print(f"round {round_}: {name}: {rows[name][-1]:,.0f} samples/s", flush=True)
    ratios = [a / b for a, b in zip(rows["with counters"], rows["baseline"])]
    print(
        json.dumps(
            {
                "baseline_median": statistics.median(rows["baseline"]),
                "with_counters_median": statistics.median(rows["with counters"]),
                "ratio_of_medians": statistics.median(rows["with counters"])
                / statistics.median(rows["baseline"]),
                "median_paired_ratio": statistics.median(ratios),
                "paired_ratios": ratios,
                "repetitions": args.repetitions,
                "samples": args.samples,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
