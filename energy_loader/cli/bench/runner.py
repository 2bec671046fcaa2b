"""``python -m energy_loader bench``: the reference workload (docs/benchmarks.md), side by side.

Workloads (``--workload``, see :mod:`energy_loader.bench.workloads`): ``reference``
(64-token samples -> map -> shuffle buffer of 1000 -> batch of 32, 2 workers, prefetch 2)
and ``large`` (3 x 224 x 224 uint8 images, buffer 64, 4.8 MB per batch).

Throughput runs, each in a fresh subprocess (clean memory numbers, nothing shared between
runs) and interleaved over ``repetitions`` rounds in rotating order, because this kind of
machine is noisy (+-15%):

- ``plain``: a torch ``DataLoader`` over a plain ``IterableDataset`` doing the same work with
  no state at all, written the way that is fastest with torch's own transport (it batches
  token samples itself, keeping the indices a list, so that one tensor per batch crosses;
  images are batched by the DataLoader, whose collate writes the batch straight into shared
  memory): the reference every ratio is relative to;
- for each stateful contender (energy_loader, and the peers that are installed: torchdata's
  ``StatefulDataLoader``, megatron-energon's ``SavableDataLoader``), ``NAME`` without saves
  and ``NAME+save50`` with a save every 50 batches, all at the library's defaults;
- ``energy_loader+save50/torch-transport``: with the batch codec off
  (``transport_codec=False``), to show what the codec brings; and
  ``energy_loader+save50/no-seeding``: with ``seed_per_sample=False`` on the map, whose
  function draws nothing (the plain pipeline seeds nothing either): the default re-seeds the
  global RNGs before every sample, which is most of the per-sample difference.

Then, per stateful contender, one restore run (a fresh subprocess): states saved at 10/50/90%
of the epoch, restore-to-first-batch from each (a fresh loader each time), the state's size as
the library stores it (JSON for energy_loader, pickle for the peers), and an exact-resume check
(the batches after restoring the 50% state equal the uninterrupted run's). Results go to
``out/bench.json`` and, with matplotlib, ``out/bench.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from .contender import Contender, energy_loader_contender, plain_contender, worker_pids
from .peer_energon import energon_contender
from .peer_torchdata import torchdata_contender
from .workloads import BATCH, PREFETCH, SAVE_EVERY, WORKERS, WORKLOADS

__all__ = ["main", "summarize"]

FRACTIONS = (0.1, 0.5, 0.9)


@attrs.frozen
class _Variant:
    """One throughput row: a contender, its options, and whether it saves every 50 batches."""

    contender: Contender
    options: dict[str, Any] = attrs.field(factory=dict)
    saves: bool = False


def _contenders() -> list[Contender]:
    peers = [torchdata_contender(), energon_contender()]
    return [plain_contender(), energy_loader_contender(), *peers]


def _variants(contenders: list[Contender]) -> dict[str, _Variant]:
    """The throughput rows, in table order."""
    rows: dict[str, _Variant] = {}
    for contender in contenders:
        rows[contender.name] = _Variant(contender)
        if contender.stateful:
            rows[f"{contender.name}+save{SAVE_EVERY}"] = _Variant(contender, saves=True)
        if contender.name == "energy_loader":
            rows[f"energy_loader+save{SAVE_EVERY}/torch-transport"] = _Variant(
                contender, {"transport_codec": False}, saves=True
            )
            rows[f"energy_loader+save{SAVE_EVERY}/no-seeding"] = _Variant(
                contender, {"seed_per_sample": False}, saves=True
            )
    return rows


def _peak_rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1])
    return total


def _throughput_run(variant: _Variant, samples: int, workload: str) -> dict[str, Any]:
    contender = variant.contender
    loader = contender.build(samples, workload, **variant.options)
    iterator = iter(loader)
    first = next(iterator)
    count, saves = len(first["index"]), []
    start = time.perf_counter()
    for step, batch in enumerate(iterator, start=1):
        count += len(batch["index"])
        if variant.saves and step % SAVE_EVERY == 0:
            began = time.perf_counter()
            contender.save(loader)
            saves.append((time.perf_counter() - began) * 1000)
    elapsed = time.perf_counter() - start
    rss = _peak_rss_kib([os.getpid(), *worker_pids(loader, iterator)])
    contender.close(loader)
    return {
        "samples_per_s": (count - len(first["index"])) / elapsed,
        "save_ms": saves,
        "rss_kib": rss,
    }


def _indices(batch: dict[str, Any]) -> list[int]:
    return [int(i) for i in batch["index"]]


def _restore_run(
    contender: Contender, samples: int, repetitions: int, workload: str
) -> dict[str, Any]:
    """States at 10/50/90%, restore timings, state size, and one exact-resume check."""
    from ...testing.compare import first_difference

    loader = contender.build(samples, workload)
    reference = [_indices(b) for b in loader]
    contender.close(loader)
    steps = len(reference)
    marks = {fraction: max(1, int(steps * fraction)) for fraction in FRACTIONS}
    loader = contender.build(samples, workload)
    iterator, states = iter(loader), {}
    for step in range(1, steps + 1):
        next(iterator)
        for fraction, mark in marks.items():
            if step == mark:
                states[fraction] = contender.save(loader)
    contender.close(loader)
    del iterator, loader
    result: dict[str, Any] = {
        "state_bytes": contender.state_bytes(states[0.5]),
        "restore_ms": {},
    }
    for fraction, state in states.items():
        timings = []
        for _ in range(repetitions):
            began = time.perf_counter()
            restored = contender.restored(samples, workload, state)
            next(iter(restored))
            timings.append((time.perf_counter() - began) * 1000)
            contender.close(restored)
        result["restore_ms"][str(fraction)] = timings
    restored = contender.restored(samples, workload, states[0.5])
    tail = [_indices(b) for b in restored]
    contender.close(restored)
    difference = first_difference(reference[marks[0.5] :], tail)
    result["exact_resume"] = difference is None
    result["exact_resume_detail"] = difference or "identical"
    return result


def _child(args: argparse.Namespace) -> int:
    contenders = {c.name: c for c in _contenders()}
    kind, _, name = args._run.partition(":")
    if kind == "restore":
        result = _restore_run(contenders[name], args.samples, args.repetitions, args.workload)
    else:
        variant = _variants(list(contenders.values()))[name]
        result = _throughput_run(variant, args.samples, args.workload)
    print(json.dumps(result))
    return 0


def _spawn(args: argparse.Namespace, run: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "energy_loader", "bench", "--_run", run,
        "--samples", str(args.samples), "--repetitions", str(args.repetitions),
        "--workload", args.workload,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark run {run!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _p95(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def summarize(
    runs: dict[str, list[dict[str, Any]]], restores: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Medians and ratios to the plain DataLoader, per throughput row; restore figures per
    stateful contender.

    ``ratio`` divides the medians; ``paired_ratio`` is the median of the ratios within each
    repetition round (the contenders of a round run back to back, so they share the
    machine's load of the moment): the steadier figure when the machine is noisy.
    """
    plain_rates = [r["samples_per_s"] for r in runs["plain"]]
    reference = _median(plain_rates)
    reference_rss = _median([r["rss_kib"] for r in runs["plain"]])
    table = {}
    for name, results in runs.items():
        rate = _median([r["samples_per_s"] for r in results])
        saves = [s for r in results for s in r["save_ms"]]
        rss = _median([r["rss_kib"] for r in results])
        table[name] = {
            "samples_per_s": rate,
            "ratio": rate / reference,
            "paired_ratio": _median([r["samples_per_s"] / p for r, p in zip(results, plain_rates)]),
            "save_ms_median": _median(saves),
            "save_ms_p95": _p95(saves),
            "rss_mib": rss / 1024,
            "rss_ratio": rss / reference_rss if reference_rss else float("nan"),
            "repetitions": len(results),
        }
    restore = {
        name: {
            "restore_ms_median": {k: _median(v) for k, v in run["restore_ms"].items()},
            "state_bytes": run["state_bytes"],
            "exact_resume": run["exact_resume"],
            "exact_resume_detail": run["exact_resume_detail"],
        }
        for name, run in restores.items()
    }
    return {"table": table, "restore": restore}


def format_table(summary: dict[str, Any]) -> str:
    """The two tables the bench prints: throughput rows, then restore per contender."""
    lines = [
        f"{'contender':<38}{'samples/s':>11}{'x plain':>9}{'paired':>8}{'save med ms':>13}"
        f"{'save p95 ms':>13}{'RSS MiB':>9}{'x plain':>9}"
    ]
    for name, row in summary["table"].items():
        lines.append(
            f"{name:<38}{row['samples_per_s']:>11.0f}{row['ratio']:>9.3f}"
            f"{row['paired_ratio']:>8.2f}{row['save_ms_median']:>13.3f}{row['save_ms_p95']:>13.3f}"
            f"{row['rss_mib']:>9.0f}{row['rss_ratio']:>9.3f}"
        )
    lines.append("")
    lines.append(
        f"{'contender':<16}{'restore to first batch, median ms at 10% / 50% / 90%':<56}"
        f"{'state bytes':>12}  exact resume"
    )
    for name, row in summary["restore"].items():
        timings = " / ".join(f"{v:.0f}" for v in row["restore_ms_median"].values())
        lines.append(
            f"{name:<16}{timings:<56}{row['state_bytes']:>12}  {row['exact_resume']}"
            f" ({row['exact_resume_detail']})"
        )
    for name, reason in summary.get("missing", {}).items():
        lines.append(f"{name}: not run: {reason}")
    return "\n".join(lines)


def _plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(summary["table"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.barh(names, [summary["table"][n]["ratio"] for n in names], color="#4c72b0")
    left.axvline(1.0, color="black", linewidth=0.8)
    left.invert_yaxis()
    left.set_xlabel("throughput, x plain torch DataLoader (median)")
    families = list(summary["restore"])
    width = 0.8 / max(1, len(families))
    for offset, family in enumerate(families):
        medians = summary["restore"][family]["restore_ms_median"]
        positions = [i + offset * width for i in range(len(medians))]
        right.bar(positions, list(medians.values()), width=width, label=family)
    right.set_xticks([i + width * (len(families) - 1) / 2 for i in range(len(FRACTIONS))])
    right.set_xticklabels([f"{f:.0%}" for f in FRACTIONS])
    right.set_ylabel("restore to first batch, ms (median)")
    right.set_xlabel("position in the epoch")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str]) -> int:
    """Run the bench; exit 0 when energy_loader resumed exactly."""
    parser = argparse.ArgumentParser(
        prog="python -m energy_loader bench",
        description="The reference workload (docs/benchmarks.md): a plain torch DataLoader, "
        "energy_loader and the installed peers (torchdata, megatron-energon; pip install -e "
        "'.[bench]') running the same pipeline, interleaved repetitions, medians and ratios.",
    )
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="reference",
        help="reference: 60k samples of 64 tokens, map -> shuffle buffer 1000 -> batch 32; "
        "large: 3x224x224 uint8 images (5 MB batches)",
    )
    parser.add_argument("--samples", type=int, default=None, help="default: per workload")
    parser.add_argument(
        "--repetitions", type=int, default=7, help="interleaved repetitions (default: 7)"
    )
    parser.add_argument("--out", type=Path, default=None, help="directory for bench.json/png")
    parser.add_argument(
        "--no-peers", action="store_true", help="skip torchdata and megatron-energon"
    )
    parser.add_argument("--_run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.samples is None:
        args.samples = WORKLOADS[args.workload].samples
    if args.samples < BATCH * WORKERS * 4 or args.repetitions < 1:
        parser.error(f"need --samples >= {BATCH * WORKERS * 4} and --repetitions >= 1")
    if args._run is not None:
        return _child(args)
    out = args.out or Path(tempfile.mkdtemp(prefix="energy_loader-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    contenders, missing = [], {}
    for contender in _contenders():
        reason = "skipped (--no-peers)" if args.no_peers else contender.missing()
        if contender.name in ("plain", "energy_loader") or reason is None:
            contenders.append(contender)
        else:
            missing[contender.name] = reason
    names = list(_variants(contenders))
    stateful = [c.name for c in contenders if c.stateful]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    bar = _progress_bar(args.repetitions * len(names) + len(stateful))
    for repetition in range(args.repetitions):
        shift = repetition % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(_spawn(args, f"throughput:{name}"))
            bar.update(1) if bar else None
    restores = {}
    for name in stateful:
        restores[name] = _spawn(args, f"restore:{name}")
        bar.update(1) if bar else None
    if bar:
        bar.close()
    summary = summarize(runs, restores)
    summary["missing"] = missing
    workload = WORKLOADS[args.workload]
    summary["workload"] = {
        "name": workload.name, "samples": args.samples, "buffer": workload.buffer,
        "batch": BATCH, "workers": WORKERS, "prefetch": PREFETCH, "save_every": SAVE_EVERY,
        "repetitions": args.repetitions, "torch": torch.__version__,
    }  # fmt: skip
    summary["runs"] = runs
    summary["restore_runs"] = restores
    (out / "bench.json").write_text(json.dumps(summary, indent=2))
    plotted = _plot(summary, out / "bench.png")
    print(f"workload: {workload.name}, {args.samples} samples, {args.repetitions} repetitions")
    print(format_table(summary))
    print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if plotted else ""))
    return 0 if summary["restore"]["energy_loader"]["exact_resume"] else 1


def _progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench", unit="run")
