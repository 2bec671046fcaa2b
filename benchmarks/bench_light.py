"""The loader's own cost per sample on light samples, against baseline trees in one loop.

On light samples the loader's own work is most of what a pass costs, so any per-sample work a
change adds (a digest, a generator saved and put back, a bookkeeping call) shows up here
before it lands. The pipeline: ``IndexedSource.from_fn`` of small dict samples (an int, a
short str, an int label and a float score), shuffled, batches of 64 as lists, a
``state_dict()`` every 50 batches, the proofs on (``verify_restore`` at its default), one
epoch of 64,000 samples:

- ``0 workers``: everything in the training process;
- ``2 workers``: two worker processes.

Each variant runs in a fresh subprocess, for this tree and for every ``--baseline-tree DIR``
(another checkout of energy_loader: the commit before a change, a release), interleaved in a
rotating order, ``--repetitions`` times. Reported: the CPU per sample (the main process and,
with workers, the workers, from the first batch to the end of the epoch: on a loaded machine
a steadier measure than wall time; the workers' is their whole life, start-up included, small
beside an epoch), samples/s, and each tree's CPU per sample against this
tree's within a repetition (median). Example::

    python benchmarks/bench_light.py --repetitions 9 --baseline-tree /path/to/old/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
BATCH = 64
SAVE_EVERY = 50
WORKERS = (0, 2)


def light_sample(index: int) -> dict[str, Any]:
    """A light sample: what a reader of a small-record format hands a loader."""
    return {"id": index, "text": f"sample {index}", "label": index % 10, "score": index * 0.5}


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


def _child(workers: int, samples: int) -> dict[str, float]:
    """One pass in this process: CPU per sample and samples/s."""
    import energy_loader as el

    source = el.IndexedSource.from_fn(samples, light_sample, shuffle=True)
    loader = el.SavableDataLoader(source.batch(BATCH, collate_fn=_as_list), num_workers=workers)
    iterator = iter(loader)
    count = len(next(iterator))  # the workers started
    began_cpu, began = time.process_time(), time.perf_counter()
    for step, batch in enumerate(iterator, start=1):
        count += len(batch)
        if step % SAVE_EVERY == 0:
            loader.state_dict()
    elapsed = time.perf_counter() - began
    main_cpu = time.process_time() - began_cpu
    del iterator
    loader.close()
    del loader  # the workers are stopped and waited for: their CPU is the children's
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    worker_cpu = children.ru_utime + children.ru_stime
    counted = count - BATCH
    return {
        "cpu_us": (main_cpu + worker_cpu) * 1e6 / counted,
        "main_cpu_us": main_cpu * 1e6 / counted,
        "samples_per_s": counted / elapsed,
    }


def _spawn(tree: Path, workers: int, samples: int) -> dict[str, float]:
    environment = {**os.environ, "PYTHONPATH": str(tree), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(workers), "--samples", str(samples)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=tree,
    )
    if done.returncode:
        sys.exit(f"{tree} with {workers} workers failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64_000, help="samples per epoch")
    parser.add_argument("--repetitions", type=int, default=9, help="interleaved repetitions")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        action="append",
        default=[],
        help="another checkout of energy_loader to run side by side (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child is not None:
        print(json.dumps(_child(options.child, options.samples)))
        return 0
    trees = {"this tree": HERE} | {f"baseline {t.name}": t for t in options.baseline_tree}
    runs = [(name, workers) for workers in WORKERS for name in trees]
    results: dict[tuple[str, int], list[dict[str, float]]] = {run: [] for run in runs}
    for repetition in range(options.repetitions):
        shift = repetition % len(runs)
        for name, workers in runs[shift:] + runs[:shift]:
            results[name, workers].append(_spawn(trees[name], workers, options.samples))
        print(f"repetition {repetition + 1}/{options.repetitions} done", file=sys.stderr)
    print(
        f"\n{options.samples:,} light samples, batches of {BATCH} as lists, state_dict() every "
        f"{SAVE_EVERY} batches, median of {options.repetitions} interleaved repetitions\n"
    )
    print("| tree | workers | CPU us a sample | main process | samples/s | CPU vs this tree |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, workers in runs:
        mine, own = results[name, workers], results["this tree", workers]
        ratio = statistics.median(r["cpu_us"] / o["cpu_us"] for r, o in zip(mine, own))
        print(
            f"| {name} | {workers} | {statistics.median(r['cpu_us'] for r in mine):.2f} | "
            f"{statistics.median(r['main_cpu_us'] for r in mine):.2f} | "
            f"{statistics.median(r['samples_per_s'] for r in mine):,.0f} | {ratio:.2f}x |"
        )
    if options.out is not None:
        options.out.write_text(
            json.dumps({f"{name} / {workers}": runs for (name, workers), runs in results.items()})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
