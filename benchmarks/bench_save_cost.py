"""What a save costs the training loop: ``state_dict()`` on the reference workloads, this tree
against other checkouts, side by side in one run.

Two loaders, each built from the public API only (so that any checkout of energy_loader runs
the same code): the reference pipeline (60k samples of 64 tokens, map -> shuffle buffer 1000
-> batch 32, 2 workers, prefetch 2; docs/benchmarks.md) and the same workload as a plain
map-style ``Dataset`` given to the drop-in loader (batch 32, shuffle, 2 persistent workers,
``generator=``). Each takes ``--batches`` batches with a ``state_dict()`` after every one past
a warm-up, while the workers keep the cores busy: the median and p95 of ``state_dict()``, the
samples per second of the pass (saves included), and the state's size as JSON. Every
(tree, loader) pair runs in a fresh subprocess, interleaved over ``--repetitions`` rounds in
rotating order (this kind of machine is noisy, +-15%). Example::

    python benchmarks/bench_save_cost.py --baseline-tree /path/to/round-6 --repetitions 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, statistics, sys, time
import torch
from torch.utils.data import Dataset
import energy_loader as el

KIND, BATCHES, WARMUP = sys.argv[1], int(sys.argv[2]), 20

def make_sample(index):
    return {"index": index, "tokens": torch.arange(64, dtype=torch.int64) + index}

def tokenize(sample):
    return {"index": sample["index"], "tokens": (sample["tokens"] * 7) % 50257}

class Tokens(Dataset):
    def __len__(self):
        return 60_000
    def __getitem__(self, index):
        return tokenize(make_sample(index))

if KIND == "pipeline":
    source = el.IndexedSource.from_fn(60_000, make_sample, shuffle=True, seed=0)
    pipeline = el.BatchDataset(el.ShuffleBufferDataset(el.MapDataset(source, tokenize), 1000), 32)
    loader = el.SavableDataLoader(
        pipeline, worker_config=el.WorkerConfig(num_workers=2), prefetch_factor=2
    )
else:
    loader = el.SavableDataLoader(
        Tokens(), batch_size=32, shuffle=True, num_workers=2, prefetch_factor=2,
        persistent_workers=True, generator=torch.Generator().manual_seed(0),
    )
iterator = iter(loader)
times = []
for step in range(BATCHES):
    if step == WARMUP:
        began = time.perf_counter()
    next(iterator)
    if step >= WARMUP:
        start = time.perf_counter()
        state = loader.state_dict()
        times.append(time.perf_counter() - start)
elapsed = time.perf_counter() - began
times.sort()
print(json.dumps({
    "median_ms": 1000 * statistics.median(times),
    "p95_ms": 1000 * times[int(0.95 * (len(times) - 1))],
    "samples_per_s": 32 * (BATCHES - WARMUP) / elapsed,
    "bytes": len(json.dumps(state)),
}))
"""


def _run(tree: Path, kind: str, batches: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, str(batches)],
        env=env,
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"{tree} {kind} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", action="append", default=[], type=Path)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--batches", type=int, default=600, help="batches per run (<= 1875)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    trees = {"this tree": ROOT, **{f"baseline {t.name}": t.resolve() for t in args.baseline_tree}}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    names = list(trees)
    for repetition in range(args.repetitions):
        order = names[repetition % len(names) :] + names[: repetition % len(names)]
        for kind in ("pipeline", "dropin"):
            for name in order:
                result = _run(trees[name], kind, args.batches)
                runs.setdefault((kind, name), []).append(result)
                print(f"rep {repetition + 1} {kind:8} {name}: {result}", file=sys.stderr)
    print(f"\n{'loader':9} {'tree':22} {'state_dict median':>18} {'p95':>9} "
          f"{'samples/s':>10} {'ratio':>6} {'state':>9}")  # fmt: skip
    for kind in ("pipeline", "dropin"):
        ours = runs[(kind, "this tree")]
        for name in names:
            got = runs[(kind, name)]
            ratio = statistics.median(
                a["samples_per_s"] / b["samples_per_s"] for a, b in zip(got, ours)
            )
            print(
                f"{kind:9} {name:22} "
                f"{statistics.median(r['median_ms'] for r in got):15.4f} ms "
                f"{statistics.median(r['p95_ms'] for r in got):6.3f} ms "
                f"{statistics.median(r['samples_per_s'] for r in got):10.0f} "
                f"{ratio:6.2f} {got[0]['bytes']:7d} B"
            )
    if args.out:
        args.out.write_text(
            json.dumps({f"{k} / {n}": v for (k, n), v in runs.items()}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
