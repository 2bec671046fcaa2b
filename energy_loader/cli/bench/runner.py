"""``python -m energy_loader bench``: the benchmark workloads (docs/benchmarks.md), side by side.

Workloads (``--workload``): the synthetic ones of :mod:`.workloads`, ``reference`` (64-token
samples -> map -> shuffle buffer of 1000 -> batch of 32, 2 workers, prefetch 2) and ``large``
(3 x 224 x 224 uint8 images, buffer 64, 4.8 MB per batch); and the real ones of :mod:`.real`,
``llm`` (Parquet documents -> tokenizer -> 2,048-token packs -> batches of 8) and ``vision``
(WebDataset JPEGs -> decode -> random resized crop + flip -> batches of 64), whose data is
made once into ``--cache`` (:mod:`.data`). On the real workloads every stateful contender
runs with a save every 50 batches only (what a training loop does).

What a run compares is its :class:`Bench`: ``python -m energy_loader bench`` compares
energy_loader with the plain DataLoader (:data:`BENCH`); the repository's
``benchmarks/bench_peers.py`` runs this same runner with other libraries' loaders added
(torchdata, megatron-energon, MosaicML Streaming, Grain; the ones whose requirements conflict
with ours run their child processes in venvs of their own). The adapters of those libraries
stay out of the installed package.

Throughput runs, each in a fresh subprocess (clean memory numbers, nothing shared between
runs) and interleaved over ``repetitions`` rounds in rotating order, because this kind of
machine is noisy (+-15%):

- ``plain``: a torch ``DataLoader`` over a plain ``IterableDataset`` doing the same work with
  no state at all, written the way that is fastest with torch's own transport (it batches
  token samples itself, keeping the indices a list, so that one tensor per batch crosses;
  images are batched by the DataLoader, whose collate writes the batch straight into shared
  memory): the reference every ratio is relative to;
- for each stateful contender (energy_loader, and the peers a :class:`Bench` adds that are
  installed), ``NAME`` without saves and ``NAME+save50`` with a save every 50 batches, all at
  the library's defaults;
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from .contender import Contender, energy_loader_contender, plain_contender
from .data import DEFAULT_CACHE, data_dir, ensure_data
from .processes import cpu_seconds, descendants, peak_rss_kib
from .real import REAL_WORKLOADS, real_contenders
from .workloads import BATCH, PREFETCH, SAVE_EVERY, WORKERS, WORKLOADS

__all__ = ["BENCH", "Bench", "baseline_contenders", "main", "p95", "run", "summarize"]

FRACTIONS = (0.1, 0.5, 0.9)
CHECK_BATCHES = 8
SAMPLE_EVERY = 20
CHOICES = sorted([*WORKLOADS, *REAL_WORKLOADS])


@attrs.frozen
class _Variant:
    """One throughput row: a contender, its options, and whether it saves every 50 batches."""

    contender: Contender
    options: dict[str, Any] = attrs.field(factory=dict)
    saves: bool = False


def _no_options(parser: argparse.ArgumentParser) -> None:
    """A bench that adds no options of its own."""


@attrs.frozen
class Bench:
    """One bench program: its name and help, the contenders it compares, and how it starts
    its own measured runs.

    Every measured run is a fresh process of the same program, ``python *command ARGS
    --_run KIND:NAME`` with the arguments the parent was given, so that parent and children
    parse the same options and build the same contenders, whatever options a bench adds.
    ``contenders(workload, folder, options)`` gets the real workload's data folder (``None``
    for the synthetic ones) and the parsed options, ``add_options``' among them (the peers'
    bench adds where their venvs are). Contenders whose ``missing()`` says why they cannot
    run are left out and listed.
    """

    prog: str
    description: str
    command: tuple[str, ...]
    contenders: Callable[[str, Path | None, argparse.Namespace], list[Contender]]
    add_options: Callable[[argparse.ArgumentParser], None] = _no_options


def baseline_contenders(
    workload: str, folder: Path | None, options: argparse.Namespace | None = None
) -> list[Contender]:
    """The plain torch ``DataLoader`` and energy_loader on ``workload`` (over ``folder``'s
    data for a real workload): what every bench compares, the first rows of its tables. They
    take no options; ``options`` is there so that this is a :class:`Bench`'s ``contenders``."""
    if folder is not None:
        return real_contenders(workload, folder)
    return [plain_contender(), energy_loader_contender()]


BENCH = Bench(
    prog="python -m energy_loader bench",
    description="The benchmark workloads (docs/benchmarks.md): a plain torch DataLoader and "
    "energy_loader running the same pipeline, interleaved repetitions, medians and ratios. "
    "The other libraries' loaders (torchdata, megatron-energon, MosaicML Streaming, Grain) "
    "run from a checkout of the repository: python benchmarks/bench_peers.py.",
    command=("-m", "energy_loader", "bench"),
    contenders=baseline_contenders,
)


def _contenders(bench: Bench, args: argparse.Namespace) -> list[Contender]:
    real = args.workload in REAL_WORKLOADS
    folder = data_dir(args.cache, args.workload, args.samples) if real else None
    return bench.contenders(args.workload, folder, args)


def _count(workload: str) -> Any:
    """What one batch counts: its samples (images, or 2,048-token sequences of real tokens)."""
    if workload in REAL_WORKLOADS:
        return REAL_WORKLOADS[workload].count
    return lambda batch: len(batch["index"])


def _fingerprint(workload: str) -> Any:
    """A batch's fingerprint for the exact-resume check."""
    if workload in REAL_WORKLOADS:
        return REAL_WORKLOADS[workload].fingerprint
    return lambda batch: ",".join(str(i) for i in _indices(batch))


def _variants(contenders: list[Contender], workload: str = "reference") -> dict[str, _Variant]:
    """The throughput rows, in table order (real workloads: stateful ones saving only)."""
    rows: dict[str, _Variant] = {}
    real = workload in REAL_WORKLOADS
    for contender in contenders:
        if real and contender.stateful:
            rows[f"{contender.name}+save{SAVE_EVERY}"] = _Variant(contender, saves=True)
            continue
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


def _throughput_run(
    variant: _Variant, samples: int, workload: str, batches: int | None = None
) -> dict[str, Any]:
    """Samples per second from the second batch on (at most ``batches`` batches), with the
    CPU of the main process and of the processes under it, and their peak RSS."""
    contender, count_of = variant.contender, _count(workload)
    loader = contender.build(samples, workload, **variant.options)
    iterator = iter(loader)
    next(iterator)
    count, saves = 0.0, []
    me = os.getpid()
    pids = [me, *descendants(me)]
    cpu_start = cpu_seconds(pids)
    # Processes that end with the epoch (some loaders stop their workers then) would take
    # their CPU and peak RSS with them: both are read every SAMPLE_EVERY batches too.
    cpu_last, rss = dict(cpu_start), peak_rss_kib(pids)
    start = time.perf_counter()
    for step, batch in enumerate(iterator, start=1):
        count += count_of(batch)
        if variant.saves and step % SAVE_EVERY == 0:
            began = time.perf_counter()
            contender.save(loader)
            saves.append((time.perf_counter() - began) * 1000)
        if step % SAMPLE_EVERY == 0:
            cpu_last.update(cpu_seconds(pids))
            rss.update(peak_rss_kib(pids))
        if batches is not None and step + 1 >= batches:
            break
    elapsed = time.perf_counter() - start
    pids = sorted({*pids, *descendants(me)})
    cpu_last.update(cpu_seconds(pids))
    rss.update(peak_rss_kib(pids))
    main_cpu = cpu_last.get(me, 0.0) - cpu_start.get(me, 0.0)
    other_cpu = sum(t - cpu_start.get(pid, 0.0) for pid, t in cpu_last.items() if pid != me)
    contender.close(loader)
    return {
        "samples_per_s": count / elapsed,
        "samples": count,
        "seconds": elapsed,
        "cpu_main_s": main_cpu,
        "cpu_workers_s": other_cpu,
        "save_ms": saves,
        "rss_kib": sum(rss.values()),
        "processes": len(rss),
    }


def _indices(batch: dict[str, Any]) -> list[int]:
    return [int(i) for i in batch["index"]]


def _restore_run(
    contender: Contender,
    samples: int,
    repetitions: int,
    workload: str,
    span: int | None = None,
) -> dict[str, Any]:
    """One uninterrupted run saving at 10/50/90% of the epoch (or of its first ``span``
    batches); from each state, restore timings and an exact-resume check over the next
    :data:`CHECK_BATCHES` batches; the state's size."""
    fingerprint = _fingerprint(workload)
    loader = contender.build(samples, workload)
    iterator, reference, states = iter(loader), [], []
    for batch in iterator:
        reference.append(fingerprint(batch))
        states.append(contender.save(loader) if contender.stateful else None)
        if span is not None and len(reference) >= span + CHECK_BATCHES:
            break
    contender.close(loader)
    del iterator, loader
    steps = len(reference) if span is None else min(span, len(reference))
    marks = {fraction: max(1, int(steps * fraction)) for fraction in FRACTIONS}
    saved = {fraction: states[mark - 1] for fraction, mark in marks.items()}
    del states
    result: dict[str, Any] = {
        "batches": steps,
        "state_bytes": contender.state_bytes(saved[0.5]),
        "restore_ms": {},
        "exact": {},
    }
    details = []
    for fraction, state in saved.items():
        timings = []
        for _ in range(repetitions):
            began = time.perf_counter()
            restored = contender.restored(samples, workload, state)
            next(iter(restored))
            timings.append((time.perf_counter() - began) * 1000)
            contender.close(restored)
        result["restore_ms"][str(fraction)] = timings
        restored = contender.restored(samples, workload, state)
        tail = []
        for batch in restored:
            tail.append(fingerprint(batch))
            if len(tail) == CHECK_BATCHES:
                break
        contender.close(restored)
        expected = reference[marks[fraction] : marks[fraction] + CHECK_BATCHES]
        same = tail == expected
        result["exact"][str(fraction)] = same
        if not same:
            where = next(
                (i for i, (a, b) in enumerate(zip(expected, tail)) if a != b),
                min(len(expected), len(tail)),
            )
            details.append(
                f"at {fraction:.0%}: batch {where + 1} after the restore differs"
                f" ({len(tail)} batches came, {len(expected)} expected)"
            )
    result["exact_resume"] = all(result["exact"].values())
    result["exact_resume_detail"] = "; ".join(details) or "identical"
    return result


def _prepare(contender: Contender) -> dict[str, Any]:
    began = time.perf_counter()
    if contender.prepare is not None:
        contender.prepare()
    return {"seconds": time.perf_counter() - began}


def _child(bench: Bench, args: argparse.Namespace) -> int:
    contenders = {c.name: c for c in _contenders(bench, args)}
    kind, _, name = args._run.partition(":")
    if kind == "restore":
        result = _restore_run(
            contenders[name], args.samples, args.repetitions, args.workload, args.batches
        )
    elif kind == "prepare":
        result = _prepare(contenders[name])
    else:
        variant = _variants(list(contenders.values()), args.workload)[name]
        result = _throughput_run(variant, args.samples, args.workload, args.batches)
    print(json.dumps(result))
    return 0


def _spawn(bench: Bench, argv: list[str], run: str, python: str | None = None) -> dict[str, Any]:
    """One measured run in a fresh process of ``bench`` (in ``python``'s venv, or this one),
    given the parent's arguments; its result is the last line it prints, as JSON."""
    command = [python or sys.executable, *bench.command, *argv, "--_run", run]
    environment = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=3600, check=False, env=environment
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark run {run!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank) of ``values``; NaN when there are none."""
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
    ``cpu_s_per_1000`` is the CPU of the main process and the processes under it per 1,000
    samples (median over the runs), ``cpu_main_share`` the main process's part of it.
    """
    plain_rates = [r["samples_per_s"] for r in runs["plain"]]
    reference = _median(plain_rates)
    reference_rss = _median([r["rss_kib"] for r in runs["plain"]])
    table = {}
    for name, results in runs.items():
        rate = _median([r["samples_per_s"] for r in results])
        saves = [s for r in results for s in r["save_ms"]]
        rss = _median([r["rss_kib"] for r in results])
        cpu = [
            1000 * (r["cpu_main_s"] + r["cpu_workers_s"]) / r["samples"]
            for r in results
            if r.get("samples")
        ]
        main_share = [
            r["cpu_main_s"] / (r["cpu_main_s"] + r["cpu_workers_s"])
            for r in results
            if r.get("samples") and r["cpu_main_s"] + r["cpu_workers_s"] > 0
        ]
        table[name] = {
            "samples_per_s": rate,
            "ratio": rate / reference,
            "paired_ratio": _median([r["samples_per_s"] / p for r, p in zip(results, plain_rates)]),
            "save_ms_median": _median(saves),
            "save_ms_p95": p95(saves),
            "cpu_s_per_1000": _median(cpu),
            "cpu_main_share": _median(main_share),
            "rss_mib": rss / 1024,
            "rss_ratio": rss / reference_rss if reference_rss else float("nan"),
            "repetitions": len(results),
        }
    restore = {
        name: {
            "restore_ms_median": {k: _median(v) for k, v in run["restore_ms"].items()},
            "state_bytes": run["state_bytes"],
            "exact": run.get("exact", {}),
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
        f"{'save p95 ms':>13}{'CPU s/1k':>10}{'main':>6}{'RSS MiB':>9}{'x plain':>9}"
    ]
    for name, row in summary["table"].items():
        lines.append(
            f"{name:<38}{row['samples_per_s']:>11.1f}{row['ratio']:>9.3f}"
            f"{row['paired_ratio']:>8.2f}{row['save_ms_median']:>13.3f}{row['save_ms_p95']:>13.3f}"
            f"{row.get('cpu_s_per_1000', float('nan')):>10.2f}"
            f"{row.get('cpu_main_share', float('nan')):>6.0%}"
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
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    left.barh(names, [summary["table"][n]["ratio"] for n in names], color="#4c72b0")
    left.axvline(1.0, color="black", linewidth=0.8)
    left.invert_yaxis()
    left.set_xlabel("throughput, x plain torch DataLoader (median)")
    middle.barh(names, [summary["table"][n]["cpu_s_per_1000"] for n in names], color="#55a868")
    middle.invert_yaxis()
    middle.set_yticklabels([])
    middle.set_xlabel("CPU s per 1,000 samples (main + workers)")
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
    workload = summary.get("workload", {})
    figure.suptitle(f"{workload.get('name', '')}: {workload.get('description', '')}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def main(argv: list[str]) -> int:
    """``python -m energy_loader bench``: energy_loader against the plain DataLoader."""
    return run(BENCH, argv)


def run(bench: Bench, argv: list[str]) -> int:
    """Run ``bench`` with the command-line arguments ``argv``; exit 0 when energy_loader
    resumed exactly."""
    parser = argparse.ArgumentParser(prog=bench.prog, description=bench.description)
    parser.add_argument(
        "--workload",
        choices=CHOICES,
        default="reference",
        help="reference: 60k samples of 64 tokens, map -> shuffle buffer 1000 -> batch 32; "
        "large: 3x224x224 uint8 images (5 MB batches); llm: Parquet documents -> byte-level "
        "BPE -> 2,048-token packs -> batches of 8; vision: WebDataset JPEGs -> decode -> "
        "random resized crop 224 + flip -> batches of 64",
    )
    parser.add_argument(
        "--samples",
        type=_positive,
        default=None,
        help="samples of the data set (llm: documents, default 200000; vision: JPEGs, default "
        "20000; reference: 60000; large: 6400)",
    )
    parser.add_argument(
        "--repetitions", type=_positive, default=None, help="interleaved repetitions "
        "(default: 7; 5 for llm and vision)",
    )  # fmt: skip
    parser.add_argument(
        "--batches",
        type=_positive,
        default=None,
        help="measure throughput over at most this many batches, and restore at 10/50/90%% of "
        "them (default: the whole epoch)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=DEFAULT_CACHE,
        help=f"where the llm and vision data are made once and kept (default: {DEFAULT_CACHE})",
    )
    parser.add_argument("--out", type=Path, default=None, help="directory for bench.json/png")
    bench.add_options(parser)
    parser.add_argument("--_run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    real = REAL_WORKLOADS.get(args.workload)
    if args.samples is None:
        args.samples = real.size if real else WORKLOADS[args.workload].samples
    if args.repetitions is None:
        args.repetitions = 5 if real else 7
    if real is None and args.samples < BATCH * WORKERS * 4:
        parser.error(f"need --samples >= {BATCH * WORKERS * 4}")
    if real is not None and args.samples < 64:
        parser.error("need --samples >= 64 for the llm and vision workloads")
    if args._run is not None:
        return _child(bench, args)
    if real is not None:
        ensure_data(args.cache, args.workload, args.samples)
    out = args.out or Path(tempfile.mkdtemp(prefix="energy_loader-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    contenders, missing = [], {}
    for contender in _contenders(bench, args):
        reason = contender.missing()
        if reason is None:
            contenders.append(contender)
        else:
            missing[contender.name] = reason
    variants = _variants(contenders, args.workload)
    names = list(variants)
    stateful = [c for c in contenders if c.stateful]
    for contender in contenders:
        if contender.prepare is not None:
            _spawn(bench, argv, f"prepare:{contender.name}", contender.python)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    bar = _progress_bar(args.repetitions * len(names) + len(stateful))
    for repetition in range(args.repetitions):
        shift = repetition % len(names)
        for name in names[shift:] + names[:shift]:
            python = variants[name].contender.python
            runs[name].append(_spawn(bench, argv, f"throughput:{name}", python))
            bar.update(1) if bar else None
    restores = {}
    for contender in stateful:
        restores[contender.name] = _spawn(
            bench, argv, f"restore:{contender.name}", contender.python
        )
        bar.update(1) if bar else None
    if bar:
        bar.close()
    summary = summarize(runs, restores)
    summary["missing"] = missing
    summary["workload"] = _describe(args)
    summary["runs"] = runs
    summary["restore_runs"] = restores
    (out / "bench.json").write_text(json.dumps(summary, indent=2))
    plotted = _plot(summary, out / "bench.png")
    print(
        f"workload: {args.workload}, {args.samples} samples, {args.repetitions} repetitions"
        + (f", {summary['workload']['unit']}" if real else "")
    )
    print(format_table(summary))
    print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if plotted else ""))
    return 0 if summary["restore"]["energy_loader"]["exact_resume"] else 1


def _describe(args: argparse.Namespace) -> dict[str, Any]:
    """The workload's parameters, as bench.json records them."""
    common = {
        "name": args.workload, "samples": args.samples, "repetitions": args.repetitions,
        "save_every": SAVE_EVERY, "batches": args.batches, "torch": torch.__version__,
        "check_batches": CHECK_BATCHES,
    }  # fmt: skip
    real = REAL_WORKLOADS.get(args.workload)
    if real is not None:
        return {
            **common, "description": real.description, "unit": real.unit,
            "size_name": real.size_name, "workers": 2, "prefetch": 2,
            "data": str(data_dir(args.cache, args.workload, args.samples)),
        }  # fmt: skip
    workload = WORKLOADS[args.workload]
    return {
        **common, "description": f"{workload.name}, buffer {workload.buffer}", "unit": "samples",
        "buffer": workload.buffer, "batch": BATCH, "workers": WORKERS, "prefetch": PREFETCH,
    }  # fmt: skip


def _progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench", unit="run")
