"""``python -m energy_loader bench``: the SPEC reference workload, side by side.

Workloads (``--workload``):

- ``reference`` (the default, SPEC section 9): ``samples`` samples of 64 int64 tokens -> map
  (a tokenizer-like transform) -> shuffle buffer of 1000 -> batch of 32, 2 workers, prefetch 2;
- ``large``: image-like samples, a 3 x 224 x 224 uint8 tensor each -> map (a horizontal
  flip) -> shuffle buffer of 64 -> batch of 32 (4.8 MB per batch), 2 workers, prefetch 2.

Contenders, each run in a fresh subprocess (clean memory numbers, no state shared between
runs) and interleaved over ``repetitions`` rounds in rotating order, because this kind of
machine is noisy (+-15%):

- ``plain``: a torch ``DataLoader`` over a plain ``IterableDataset`` doing the same work with
  no state at all, written the way that is fastest with torch's own transport (it batches
  token samples itself, keeping the indices a list, so that one tensor per batch crosses;
  images are batched by the DataLoader, whose collate writes the batch straight into shared
  memory): the reference every ratio is relative to;
- ``energy_loader``: ``SavableDataLoader`` without saves, and ``energy_loader+save50`` with a
  ``save_state_rank()`` every 50 batches; ``energy_loader+save50/torch-transport`` is the
  latter with the batch codec off (``transport_codec=False``), to show what the codec brings,
  and ``energy_loader+save50/no-seeding`` the latter with ``seed_per_sample=False`` on the
  map, whose function draws nothing (the plain pipeline seeds nothing either): the default
  re-seeds the global RNGs before every sample, which is most of the per-sample difference;

Then restore-to-first-batch at 10/50/90% of the epoch (each restore in a fresh loader), the
state size as JSON, and an exact-resume check. Results go to ``out/bench.json`` and, with
matplotlib, ``out/bench.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

__all__ = ["WORKLOADS", "Workload", "main"]

TOKENS = 64
VOCAB = 50257
BUFFER = 1000
BATCH = 32
WORKERS = 2
PREFETCH = 2
SAVE_EVERY = 50
IMAGE_SHAPE = (3, 224, 224)


def make_sample(index: int) -> dict[str, Any]:
    return {"index": index, "tokens": torch.arange(TOKENS, dtype=torch.int64) + index}


def tokenize(sample: dict[str, Any]) -> dict[str, Any]:
    return {"index": sample["index"], "tokens": (sample["tokens"] * 7) % VOCAB}


def make_image(index: int) -> dict[str, Any]:
    row = torch.arange(IMAGE_SHAPE[-1], dtype=torch.int32).add_(index).to(torch.uint8)
    return {"index": index, "image": row.expand(IMAGE_SHAPE).contiguous()}


def flip(sample: dict[str, Any]) -> dict[str, Any]:
    return {"index": sample["index"], "image": sample["image"].flip(-1)}


@attrs.frozen
class Workload:
    """One benchmark pipeline: source -> map -> shuffle buffer -> batch, in two spellings."""

    name: str
    samples: int
    make: Callable[[int], dict[str, Any]]
    transform: Callable[[dict[str, Any]], dict[str, Any]]
    buffer: int
    # Whether the plain pipeline batches itself (indices stay a list: one tensor crosses per
    # batch) or leaves it to the DataLoader (whose collate writes into shared memory).
    plain_batches_itself: bool


WORKLOADS = {
    "reference": Workload("reference", 60_000, make_sample, tokenize, BUFFER, True),
    "large": Workload("large", 6_400, make_image, flip, 64, False),
}


class PlainPipeline(IterableDataset):
    """The same work as the savable pipeline, written as a user would without any state."""

    def __init__(self, samples: int, seed: int = 0, workload: str = "reference") -> None:
        self.samples, self.seed, self.epoch = samples, seed, 0
        self.workload = WORKLOADS[workload]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        order = list(range(self.samples))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        self.epoch += 1
        samples = self._shuffled(order[worker::workers], random.Random(worker))
        if not self.workload.plain_batches_itself:
            yield from samples
            return
        batch = []
        for sample in samples:
            batch.append(sample)
            if len(batch) == BATCH:
                yield _collate(batch)
                batch = []
        if batch:
            yield _collate(batch)

    def _shuffled(self, indices: list[int], rng: random.Random) -> Iterator[dict[str, Any]]:
        """Made, transformed and passed through a shuffle buffer."""
        make, transform, size = self.workload.make, self.workload.transform, self.workload.buffer
        buffer: list[dict[str, Any]] = []
        for index in indices:
            sample = transform(make(index))
            if len(buffer) < size:
                buffer.append(sample)
                continue
            slot = rng.randrange(size)
            buffer[slot], sample = sample, buffer[slot]
            yield sample
        rng.shuffle(buffer)
        yield from buffer


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "index": [s["index"] for s in samples],
        "tokens": torch.stack([s["tokens"] for s in samples]),
    }


def savable_pipeline(
    samples: int, seed: int = 0, workload: str = "reference", *, seed_per_sample: bool = True
) -> Any:
    from .sources import IndexedSource
    from .wrappers import BatchDataset, MapDataset, ShuffleBufferDataset

    spec = WORKLOADS[workload]
    source = IndexedSource.from_fn(samples, spec.make, shuffle=True, seed=seed)
    mapped = MapDataset(source, spec.transform, seed_per_sample=seed_per_sample)
    return BatchDataset(ShuffleBufferDataset(mapped, spec.buffer), BATCH)


def savable_loader(
    samples: int, workload: str = "reference", *, seed_per_sample: bool = True, **options: Any
) -> Any:
    from .loader import SavableDataLoader

    return SavableDataLoader(
        savable_pipeline(samples, workload=workload, seed_per_sample=seed_per_sample),
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        **options,
    )


def _plain_loader(samples: int, workload: str = "reference") -> DataLoader:
    batches_itself = WORKLOADS[workload].plain_batches_itself
    return DataLoader(
        PlainPipeline(samples, workload=workload),
        batch_size=None if batches_itself else BATCH,
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
    )


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


def _worker_pids(loader: Any) -> list[int]:
    iterator = getattr(loader, "_iterator", None)
    return [w.pid for w in getattr(iterator, "_workers", [])]


def _throughput_run(loader: Any, save: Callable[[], Any] | None) -> dict[str, Any]:
    iterator = iter(loader)
    first = next(iterator)
    count, saves = len(first["index"]), []
    start = time.perf_counter()
    for step, batch in enumerate(iterator, start=1):
        count += len(batch["index"])
        if save is not None and step % SAVE_EVERY == 0:
            began = time.perf_counter()
            save()
            saves.append((time.perf_counter() - began) * 1000)
    elapsed = time.perf_counter() - start
    rss = _peak_rss_kib([os.getpid(), *_worker_pids(loader)])
    return {
        "samples_per_s": (count - len(first["index"])) / elapsed,
        "save_ms": saves,
        "rss_kib": rss,
    }


def _contenders(workload: str) -> dict[str, Callable[[int], dict[str, Any]]]:
    def plain(samples: int) -> dict[str, Any]:
        return _throughput_run(_plain_loader(samples, workload), None)

    def energy(samples: int) -> dict[str, Any]:
        return _throughput_run(savable_loader(samples, workload), None)

    def energy_save(samples: int, **options: Any) -> dict[str, Any]:
        loader = savable_loader(samples, workload, **options)
        return _throughput_run(loader, loader.save_state_rank)

    out = {
        "plain": plain,
        "energy_loader": energy,
        "energy_loader+save50": energy_save,
        "energy_loader+save50/torch-transport": functools.partial(
            energy_save, transport_codec=False
        ),
        "energy_loader+save50/no-seeding": functools.partial(energy_save, seed_per_sample=False),
    }
    return out


def _restore_run(samples: int, repetitions: int, workload: str) -> dict[str, Any]:
    """States at 10/50/90%, restore timings, state size, and one exact-resume check."""
    from .testing.compare import first_difference

    loader = savable_loader(samples, workload)
    reference = [b["index"] for b in loader]
    steps = len(reference)
    marks = {fraction: int(steps * fraction) for fraction in (0.1, 0.5, 0.9)}
    loader = savable_loader(samples, workload)
    iterator, states = iter(loader), {}
    for step in range(1, steps + 1):
        next(iterator)
        for fraction, mark in marks.items():
            if step == mark:
                states[fraction] = loader.save_state_rank()
    del iterator, loader
    result: dict[str, Any] = {"state_bytes": len(json.dumps(states[0.5])), "restore_ms": {}}
    for fraction, state in states.items():
        timings = []
        for _ in range(repetitions):
            restored = savable_loader(samples, workload)
            began = time.perf_counter()
            restored.restore_state_rank(state)
            next(iter(restored))
            timings.append((time.perf_counter() - began) * 1000)
            del restored
        result["restore_ms"][str(fraction)] = timings
    restored = savable_loader(samples, workload)
    restored.restore_state_rank(states[0.5])
    tail = [b["index"] for b in restored]
    difference = first_difference(reference[marks[0.5] :], tail)
    result["exact_resume"] = difference is None
    result["exact_resume_detail"] = difference or "identical"
    return result


def _child(args: argparse.Namespace) -> int:
    if args._run == "restore":
        result = _restore_run(args.samples, args.repetitions, args.workload)
    else:
        result = _contenders(args.workload)[args._run](args.samples)
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


def summarize(runs: dict[str, list[dict[str, Any]]], restore: dict[str, Any]) -> dict[str, Any]:
    """Medians and ratios to the plain DataLoader, per contender.

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
    return {
        "table": table,
        "restore_ms_median": {k: _median(v) for k, v in restore["restore_ms"].items()},
        "state_bytes": restore["state_bytes"],
        "exact_resume": restore["exact_resume"],
        "exact_resume_detail": restore["exact_resume_detail"],
    }


def format_table(summary: dict[str, Any]) -> str:
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
    restore = ", ".join(
        f"{float(k):.0%}: {v:.0f} ms" for k, v in summary["restore_ms_median"].items()
    )
    lines.append(f"energy_loader restore to first batch (median): {restore}")
    lines.append(f"energy_loader state: {summary['state_bytes']} bytes as JSON")
    lines.append(f"exact resume: {summary['exact_resume']} ({summary['exact_resume_detail']})")
    return "\n".join(lines)


def _plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(summary["table"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.barh(names, [summary["table"][n]["ratio"] for n in names], color="#4c72b0")
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_xlabel("throughput, x plain torch DataLoader (median)")
    fractions = list(summary["restore_ms_median"])
    right.bar(
        [f"{float(f):.0%}" for f in fractions], [summary["restore_ms_median"][f] for f in fractions]
    )
    right.set_ylabel("restore to first batch, ms (median)")
    right.set_xlabel("position in the epoch")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m energy_loader bench",
        description="The SPEC reference workload against a plain torch DataLoader running the "
        "same pipeline, interleaved repetitions, medians and ratios.",
    )
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="reference",
        help="reference: 64-token samples (SPEC section 9); large: 3x224x224 uint8 images",
    )
    parser.add_argument("--samples", type=int, default=None, help="default: per workload")
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="directory for bench.json/png")
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
    names = list(_contenders(args.workload))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    total = args.repetitions * len(names) + 1
    bar = _progress_bar(total)
    for repetition in range(args.repetitions):
        shift = repetition % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(_spawn(args, name))
            bar.update(1) if bar else None
    restore = _spawn(args, "restore")
    bar.update(1) if bar else None
    if bar:
        bar.close()
    summary = summarize(runs, restore)
    workload = WORKLOADS[args.workload]
    summary["workload"] = {
        "name": workload.name, "samples": args.samples, "buffer": workload.buffer,
        "batch": BATCH, "workers": WORKERS, "prefetch": PREFETCH, "save_every": SAVE_EVERY,
        "repetitions": args.repetitions, "torch": torch.__version__,
    }  # fmt: skip
    summary["runs"] = runs
    summary["restore_runs"] = restore
    (out / "bench.json").write_text(json.dumps(summary, indent=2))
    plotted = _plot(summary, out / "bench.png")
    print(f"workload: {workload.name}, {args.samples} samples, {args.repetitions} repetitions")
    print(format_table(summary))
    print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if plotted else ""))
    return 0 if summary["exact_resume"] else 1


def _progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench", unit="run")
