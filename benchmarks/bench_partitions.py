"""Elastic partitions: what more partitions cost, side by side in one run.

On the reference workload (60k samples of 64 tokens, map -> shuffle buffer 1000 -> batch 32,
2 workers, prefetch 2; docs/benchmarks.md) with a save every 50 batches, each repetition runs
in fresh subprocesses, interleaved:

- ``default``: ``num_partitions`` left at its default (one per worker);
- ``P=4xRxW``: four partitions per worker (``num_partitions=8``);
- ``baseline`` and ``baseline P=4xRxW`` (with ``--baseline-tree DIR``): the same loaders from
  another checkout of energy_loader (for example the commit before a change), to show side by
  side what the change did; with several ``--baseline-tree``, one pair of rows per checkout,
  named by its folder (``baseline r4``).

The source is ``IndexedSource.from_fn(60_000, make_sample)`` by default; ``--pipeline object``
reads the same samples through a torch ``Dataset`` object (:class:`TokenDataset`:
``IndexedSource(TokenDataset(60_000), shuffle=True)``), the way most users build a source,
which reads each sample under its seed (an augmenting ``__getitem__`` is restored exactly).
``--no-partition-variants`` leaves out the ``P=4xRxW`` rows.

Reported per variant: samples/s and its ratio to ``default`` within each repetition (median
over repetitions), the CPU seconds of the pass (main process and workers, from the second
batch to the end of the epoch), the median and p95 of ``state_dict()`` (what trainers and
``torch.distributed.checkpoint`` call) and of ``save_state_rank()``, both taken at every save
point while the workers saturate the cores, restore-to-first-batch at 10/50/90% of the epoch,
and the state size as JSON. A last table gives the state size against
the number of partitions per rank. Example::

    python benchmarks/bench_partitions.py --repetitions 7 --baseline-tree /path/to/old/checkout
    python benchmarks/bench_partitions.py --pipeline object --no-partition-variants \
        --repetitions 7 --baseline-tree /path/to/old/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

HERE = Path(__file__).resolve().parents[1]
PIPELINES = ("fn", "object")


class TokenDataset(Dataset):
    """The reference workload's samples as a map-style torch ``Dataset`` (``__len__`` and
    ``__getitem__``), as a user writes one: ``IndexedSource`` reads it like any dataset
    object (under per-sample seeds, in the releases that seed reads)."""

    def __init__(self, samples: int, make: Any) -> None:
        self.samples, self.make = samples, make

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.make(index)


def _pipeline(kind: str, samples: int, workloads: Any) -> Any:
    """The reference pipeline over ``from_fn``, or over a :class:`TokenDataset` object
    (``workloads`` is the bench's workloads module of the tree under test)."""
    if kind == "fn":
        return workloads.savable_pipeline(samples)
    from energy_loader import BatchDataset, IndexedSource, MapDataset, ShuffleBufferDataset

    spec = workloads.WORKLOADS["reference"]
    source = IndexedSource(TokenDataset(samples, spec.make), shuffle=True, seed=0)
    mapped = MapDataset(source, spec.transform)
    return BatchDataset(ShuffleBufferDataset(mapped, spec.buffer), workloads.BATCH)


def _reference_workload() -> Any:
    """The reference workload's module of the tree under test, wherever its version kept it:
    ``energy_loader.cli.bench`` now, ``workloads`` in the ``cli/bench/`` (or, before that,
    ``bench/``) package of older trees."""
    import importlib

    for name in ("energy_loader.cli.bench", "energy_loader.cli.bench.workloads"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "savable_pipeline"):
            return module
    return importlib.import_module("energy_loader.bench.workloads")


def _child(options: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this process: throughput with saves, then restores and state size."""
    import energy_loader as el

    # The reading of /proc is this checkout's (after the tree under test on the path).
    sys.path.append(str(HERE))
    from benchmarks.harness.processes import cpu_seconds, descendants

    workloads = _reference_workload()

    samples = options["samples"]
    kwargs: dict[str, Any] = {
        "num_workers": workloads.WORKERS,
        "prefetch_factor": workloads.PREFETCH,
    }
    if options["partitions"]:
        kwargs["num_partitions"] = options["partitions"]

    def build() -> Any:
        return el.SavableDataLoader(
            _pipeline(options.get("pipeline", "fn"), samples, workloads), **kwargs
        )

    loader = build()
    iterator = iter(loader)
    next(iterator)  # workers started and warm
    me = os.getpid()
    pids = [me, *descendants(me)]
    cpu_start = cpu_seconds(pids)
    cpu_last = dict(cpu_start)
    start, count, saves, state_dicts = time.perf_counter(), 0, [], []
    states = {}
    batches = samples // 32
    for step, batch in enumerate(iterator, start=1):
        count += len(batch["index"])
        due = [f for f in (0.1, 0.5, 0.9) if f not in states and step >= f * batches]
        if step % workloads.SAVE_EVERY == 0 or due:
            began = time.perf_counter()
            loader.state_dict()
            state_dicts.append(time.perf_counter() - began)
            began = time.perf_counter()
            state = loader.save_state_rank()
            saves.append(time.perf_counter() - began)
            for fraction in (0.1, 0.5, 0.9):
                if fraction not in states and step >= fraction * batches:
                    states[fraction] = state
        if step % 20 == 0:  # workers that end with the epoch take their CPU time with them
            cpu_last.update(cpu_seconds(pids))
    elapsed = time.perf_counter() - start
    cpu_last.update(cpu_seconds(pids))
    cpu = sum(t - cpu_start.get(pid, 0.0) for pid, t in cpu_last.items())
    loader.reset_state()
    restores = {}
    for fraction, state in states.items():
        fresh = build()
        began = time.perf_counter()
        fresh.restore_state_rank(state)
        next(iter(fresh))
        restores[str(fraction)] = time.perf_counter() - began
        fresh.reset_state()
    return {
        "samples_per_s": count / elapsed,
        "cpu_s": cpu,
        "save_ms": [s * 1000 for s in saves],
        "state_dict_ms": [s * 1000 for s in state_dicts],
        "restore_s": restores,
        "state_bytes": len(json.dumps(states.get(0.5, {}))),
    }


def _state_sizes(samples: int) -> dict[int, int]:
    """State size (JSON bytes) a quarter into the epoch against partitions per rank."""
    import energy_loader as el
    from energy_loader.cli.bench import savable_pipeline

    sizes = {}
    for per_rank in (1, 2, 4, 8, 16):
        loader = el.SavableDataLoader(savable_pipeline(samples), num_partitions=per_rank)
        iterator = iter(loader)
        for _ in range(samples // 32 // 4):
            next(iterator)
        sizes[per_rank] = len(json.dumps(loader.save_state_rank()))
    return sizes


def _spawn(tree: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`_child` (this file's) in a fresh process that imports energy_loader from
    ``tree``: only ``tree`` is on the path, this file is loaded by its location."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = (
        "import importlib.util, json, sys; "
        f"spec = importlib.util.spec_from_file_location('bench_partitions', {__file__!r}); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "import energy_loader; assert energy_loader.__file__.startswith(sys.argv[2]), "
        "energy_loader.__file__; "
        "print(json.dumps(module._child(json.loads(sys.argv[1]))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(options), str(tree)],
        env=env,
        cwd=str(tree),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=60_000, help="samples per epoch")
    parser.add_argument("--repetitions", type=int, default=7, help="interleaved repetitions")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        action="append",
        default=[],
        help="another energy_loader checkout (repeat for several: rows 'baseline NAME')",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument(
        "--no-sizes", action="store_true", help="skip the state size by partitions table"
    )
    parser.add_argument(
        "--pipeline",
        choices=PIPELINES,
        default="fn",
        help="the source: IndexedSource.from_fn, or IndexedSource over a torch Dataset object",
    )
    parser.add_argument(
        "--no-partition-variants", action="store_true", help="leave out the P=4xRxW rows"
    )
    args = parser.parse_args(argv)
    from energy_loader.cli.bench import WORKERS

    trees = {"": HERE}
    for tree in args.baseline_tree:
        name = "baseline" if len(args.baseline_tree) == 1 else f"baseline {tree.name}"
        trees[name] = tree.resolve()
    variants: dict[str, tuple[Path, int | None]] = {}
    for prefix, tree in trees.items():
        variants[prefix or "default"] = (tree, None)
        if not args.no_partition_variants:
            variants[f"{prefix} P=4xRxW".strip()] = (tree, 4 * WORKERS)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for repetition in range(args.repetitions):
        order = list(variants)
        if repetition % 2:
            order.reverse()
        for name in order:
            tree, partitions = variants[name]
            options = {"samples": args.samples, "partitions": partitions, "pipeline": args.pipeline}
            runs[name].append(_spawn(tree, options))
        print(f"repetition {repetition + 1}/{args.repetitions} done", file=sys.stderr)
    lines = [
        "| variant | samples/s | x default (paired) | CPU s per pass | state_dict() med / p95 ms "
        "| save_state_rank() med / p95 ms | restore s at 10/50/90% | state (JSON) |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        ratios = [r["samples_per_s"] / d["samples_per_s"] for r, d in zip(results, runs["default"])]
        saves = [s for r in results for s in r["save_ms"]]
        state_dicts = [s for r in results for s in r["state_dict_ms"]]
        restores = {
            f: statistics.median(r["restore_s"][f] for r in results if f in r["restore_s"])
            for f in ("0.1", "0.5", "0.9")
        }
        row = {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in results),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "cpu_s": statistics.median(r["cpu_s"] for r in results),
            "cpu_s_runs": [r["cpu_s"] for r in results],
            "state_dict_median_ms": statistics.median(state_dicts),
            "state_dict_p95_ms": _p95(state_dicts),
            "save_median_ms": statistics.median(saves),
            "save_p95_ms": _p95(saves),
            "restore_s": restores,
            "state_bytes": statistics.median(r["state_bytes"] for r in results),
        }
        summary[name] = row
        lines.append(
            f"| {name} | {row['samples_per_s']:,.0f} | {row['ratio']:.3f} | {row['cpu_s']:.2f} | "
            f"{row['state_dict_median_ms']:.2f} / {row['state_dict_p95_ms']:.2f} | "
            f"{row['save_median_ms']:.2f} / {row['save_p95_ms']:.2f} | "
            + " / ".join(f"{restores[f]:.3f}" for f in ("0.1", "0.5", "0.9"))
            + f" | {row['state_bytes']:,.0f} B |"
        )
    if not args.no_sizes:
        sizes = _state_sizes(args.samples)
        summary["state_bytes_by_partitions_per_rank"] = sizes
        lines += [
            "",
            "| partitions per rank | state (JSON, a quarter into the epoch) |",
            "|---:|---:|",
        ]
        lines += [f"| {p} | {b:,} B |" for p, b in sizes.items()]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
