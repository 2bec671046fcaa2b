"""``python -m energy_loader bench``: energy_loader against a plain torch ``DataLoader`` (the same
work, stateless, batching itself) on the reference workload, each run a fresh process, the runs
interleaved. docs/benchmarks.md has the method; ``benchmarks/harness`` builds on these functions.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..torch_internals import shut_down_workers_of

PROG = "python -m energy_loader bench"
DESCRIPTION = (
    "energy_loader against a plain torch DataLoader on this machine, on the reference "
    "workload (60k samples of 64 tokens, map -> shuffle buffer 1000 -> batch 32, 2 workers, "
    "prefetch 2): throughput with and without a save_state_rank() every 50 batches, save "
    "median and p95, restore to first batch at 10/50/90% of the epoch, state size (JSON) "
    "and an exact-resume check; each run a fresh process, repetitions interleaved. Other "
    "workloads and libraries run from a checkout of the repository: python "
    "benchmarks/bench_loader.py, python benchmarks/bench_peers.py."
)
BATCH, WORKERS, PREFETCH, SAVE_EVERY = 32, 2, 2, 50
FRACTIONS = (0.1, 0.5, 0.9)  # where in the epoch the restore run's states are saved
CHECK_BATCHES = 8  # batches after a restore that the exact-resume check compares
ROWS = ("plain", "energy_loader", f"energy_loader+save{SAVE_EVERY}")  # the throughput rows


def make_sample(index: int) -> dict[str, Any]:
    """Sample ``index`` of the reference workload's source: its index and 64 tokens."""
    return {"index": index, "tokens": torch.arange(64, dtype=torch.int64) + index}


def tokenize(sample: dict[str, Any]) -> dict[str, Any]:
    """The reference workload's map: a tokenizer's shape and a little of its cost."""
    return {"index": sample["index"], "tokens": (sample["tokens"] * 7) % 50257}


@attrs.frozen
class Workload:
    """A synthetic pipeline, source -> map -> shuffle buffer -> batch of :data:`BATCH`, that each
    contender builds in its library's terms; a batch's ``"index"`` holds its source indices."""

    name: str
    samples: int
    make: Callable[[int], dict[str, Any]]
    transform: Callable[[dict[str, Any]], dict[str, Any]]
    buffer: int
    # False: the plain DataLoader batches (its collate writes into shared memory: large samples)
    plain_batches_itself: bool = True

    def sample(self, index: int) -> dict[str, Any]:
        """Sample ``index``, made and transformed: what a shuffle buffer holds."""
        return self.transform(self.make(index))


REFERENCE = Workload("reference", 60_000, make_sample, tokenize, 1000)
WORKLOADS = {"reference": REFERENCE}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch: the indices as a list, every other field stacked into one tensor."""
    batch: dict[str, Any] = {"index": [s["index"] for s in samples]}
    batch.update({k: torch.stack([s[k] for s in samples]) for k in samples[0] if k != "index"})
    return batch


def epoch_order(samples: int, seed: int, epoch: int) -> list[int]:
    """The source order of one epoch, shuffled by (seed, epoch), before sharding."""
    order = list(range(samples))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


@attrs.define
class ShuffleProgress:
    """Where one worker's pass over its shard stands (``drained``: None until the buffer drains)."""

    epoch: int
    consumed: int
    buffer: list[dict[str, Any]]
    rng: random.Random
    drained: int | None = None


def shuffle_stream(
    workload: Workload, progress: ShuffleProgress, indices: list[int]
) -> Iterator[dict[str, Any]]:
    """Samples made, transformed and shuffled from ``progress`` on, kept current at each yield."""
    size, buffer, rng = workload.buffer, progress.buffer, progress.rng
    if progress.drained is None:
        while progress.consumed < len(indices):
            sample = workload.sample(indices[progress.consumed])
            progress.consumed += 1
            if len(buffer) < size:
                buffer.append(sample)
                continue
            slot = rng.randrange(size)
            buffer[slot], sample = sample, buffer[slot]
            yield sample
        rng.shuffle(buffer)
        progress.drained = 0
    while progress.drained < len(buffer):
        progress.drained += 1
        yield buffer[progress.drained - 1]


class PlainPipeline(IterableDataset):
    """The same work as :func:`savable_pipeline`, written as a user would without any state."""

    def __init__(self, samples: int, seed: int = 0, workload: Workload = REFERENCE) -> None:
        self.samples, self.seed, self.epoch, self.workload = samples, seed, 0, workload

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        progress = self.start(worker)
        self.epoch = progress.epoch + 1
        indices = epoch_order(self.samples, self.seed, progress.epoch)[worker::workers]
        samples = shuffle_stream(self.workload, progress, indices)
        if not self.workload.plain_batches_itself:
            yield from samples
            return
        # Batches of BATCH samples (the last one shorter), each collated into one tensor.
        yield from map(collate, iter(lambda: list(itertools.islice(samples, BATCH)), []))

    def start(self, worker: int) -> ShuffleProgress:
        """Where ``worker``'s pass begins: at the start (a stateful version overrides this)."""
        return ShuffleProgress(self.epoch, 0, [], random.Random(worker))


def savable_pipeline(
    samples: int, seed: int = 0, workload: Workload = REFERENCE, *, seed_per_sample: bool = True
) -> Any:
    """The workload as an energy_loader pipeline."""
    from ..sources import IndexedSource
    from ..wrappers import BatchDataset, MapDataset, ShuffleBufferDataset

    source = IndexedSource.from_fn(samples, workload.make, shuffle=True, seed=seed)
    mapped = MapDataset(source, workload.transform, seed_per_sample=seed_per_sample)
    return BatchDataset(ShuffleBufferDataset(mapped, workload.buffer), BATCH)


def plain_loader(samples: int, workload: Workload = REFERENCE) -> DataLoader:
    """A torch ``DataLoader`` over :class:`PlainPipeline`, with no state: the reference."""
    return DataLoader(
        PlainPipeline(samples, workload=workload),
        batch_size=None if workload.plain_batches_itself else BATCH,
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
    )


def savable_loader(
    samples: int, workload: Workload = REFERENCE, *, seed_per_sample: bool = True, **options: Any
) -> Any:
    """``SavableDataLoader`` over :func:`savable_pipeline` (``options``: its keyword arguments)."""
    from ..loader import SavableDataLoader

    pipeline = savable_pipeline(samples, workload=workload, seed_per_sample=seed_per_sample)
    return SavableDataLoader(pipeline, num_workers=WORKERS, prefetch_factor=PREFETCH, **options)


def shutdown_workers(loader: Any) -> None:
    """Stop the workers of a torch-style loader's live iterator, if it has one."""
    shut_down_workers_of(getattr(loader, "_iterator", None))


def batch_samples(batch: Any) -> float:
    """What a batch counts in the throughput: its samples."""
    return len(batch["index"])


def batch_indices(batch: Any) -> str:
    """What the exact-resume check compares of a batch: its source indices."""
    return ",".join(str(int(i)) for i in batch["index"])


def throughput(
    loader: Any,
    batches: int | None,
    save: Callable[[Any], Any] | None = None,
    count: Callable[[Any], float] = batch_samples,
    on_step: Callable[[int], None] = lambda step: None,
) -> dict[str, Any]:
    """Samples (``count`` of each batch) per second from the second batch on, over the epoch or
    its first ``batches``; the ms of each ``save(loader)`` every :data:`SAVE_EVERY` batches."""
    iterator = iter(loader)
    next(iterator)
    on_step(0)
    samples, saves = 0.0, []
    start = time.perf_counter()
    for step, batch in enumerate(iterator, start=1):
        samples += count(batch)
        if save is not None and step % SAVE_EVERY == 0:
            began = time.perf_counter()
            save(loader)
            saves.append((time.perf_counter() - began) * 1000)
        on_step(step)
        if batches is not None and step + 1 >= batches:
            break
    seconds = time.perf_counter() - start
    return dict(samples_per_s=samples / seconds, samples=samples, seconds=seconds, save_ms=saves)


def restore_check(
    build: Callable[[], Any],
    save: Callable[[Any], Any],
    load: Callable[[Any, Any], None],
    close: Callable[[Any], None],
    state_bytes: Callable[[Any], int],
    *,
    batches: int | None,
    repetitions: int,
    fingerprint: Callable[[Any], str] = batch_indices,
) -> dict[str, Any]:
    """From states saved at :data:`FRACTIONS` of one run: the time to a restored loader's first
    batch, an exact-resume check of :data:`CHECK_BATCHES` batches, and the mid-run state's size."""
    loader, reference, states = build(), [], []
    for batch in loader:
        reference.append(fingerprint(batch))
        states.append(save(loader))
        if batches is not None and len(reference) >= batches + CHECK_BATCHES:
            break
    close(loader)
    steps = min(batches or len(reference), len(reference))
    marks = {fraction: max(1, int(steps * fraction)) for fraction in FRACTIONS}
    saved = {fraction: states[mark - 1] for fraction, mark in marks.items()}
    del states, loader

    def restored(state: Any) -> Any:
        loader = build()
        load(loader, state)
        return loader

    result: dict[str, Any] = {"batches": steps, "restore_ms": {}, "exact": {}}
    result["state_bytes"] = state_bytes(saved[0.5])
    details = []
    for fraction, state in saved.items():
        timings = []
        for _ in range(repetitions):
            began = time.perf_counter()
            loader = restored(state)
            next(iter(loader))
            timings.append((time.perf_counter() - began) * 1000)
            close(loader)
        result["restore_ms"][str(fraction)] = timings
        loader = restored(state)
        tail = [fingerprint(batch) for batch in itertools.islice(loader, CHECK_BATCHES)]
        close(loader)
        expected = reference[marks[fraction] : marks[fraction] + CHECK_BATCHES]
        result["exact"][str(fraction)] = tail == expected
        if tail != expected:
            same = sum(a == b for a, b in zip(tail, expected))
            details.append(f"at {fraction:.0%}: {same} of {len(expected)} batches as expected")
    result["exact_resume"] = all(result["exact"].values())
    result["exact_resume_detail"] = "; ".join(details) or "identical"
    return result


def spawn(command: list[str], run: str, prog: str) -> dict[str, Any]:
    """One measured run, ``command --_run RUN`` in a fresh process: its last line, as JSON."""
    print(f"{prog}: {run}", file=sys.stderr, flush=True)
    done = subprocess.run([*command, "--_run", run], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark run {run!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def interleave(
    names: Sequence[str], rounds: int, run: Callable[[str], Any]
) -> dict[str, list[Any]]:
    """``run(name)`` for every name, ``rounds`` times, each round's order rotated by one."""
    runs: dict[str, list[Any]] = {name: [] for name in names}
    for repetition in range(rounds):
        shift = repetition % len(names)
        for name in [*names[shift:], *names[:shift]]:
            runs[name].append(run(name))
    return runs


def median(values: list[float]) -> float:
    """The median of ``values``; NaN when there are none."""
    return statistics.median(values) if values else float("nan")


def p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def summarize(runs: dict[str, list[Any]], restores: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians per row and ratios to ``plain`` (``paired_ratio``: the median of each round's ratio,
    steadier on a noisy machine), and each loader's restore figures with their medians."""
    plain, table = [run["samples_per_s"] for run in runs["plain"]], {}
    for name, results in runs.items():
        rates = [run["samples_per_s"] for run in results]
        saves = [save for run in results for save in run["save_ms"]]
        table[name] = {
            "samples_per_s": median(rates),
            "ratio": median(rates) / median(plain),
            "paired_ratio": median([rate / base for rate, base in zip(rates, plain)]),
            "save_ms_median": median(saves),
            "save_ms_p95": p95(saves),
            "repetitions": len(results),
        }
    restore = {name: dict(run) for name, run in restores.items()}
    for run in restore.values():
        run["restore_ms_median"] = {k: median(v) for k, v in run.pop("restore_ms").items()}
    return {"table": table, "restore": restore}


# The throughput table's columns after the row's name: header, width, field, format.
COLUMNS: tuple[tuple[str, int, str, str], ...] = (
    ("samples/s", 11, "samples_per_s", ".1f"),
    ("x plain", 9, "ratio", ".3f"),
    ("paired", 8, "paired_ratio", ".2f"),
    ("save med ms", 13, "save_ms_median", ".3f"),
    ("save p95 ms", 13, "save_ms_p95", ".3f"),
)


def report(summary: dict[str, Any], out: Path, columns: tuple[Any, ...] = COLUMNS) -> str:
    """What a bench prints at the end: the throughput table, then restores per loader."""
    workload = summary["workload"]
    lines = [
        f"workload: {workload['workload']}, {workload['samples']} samples, "
        f"{workload['repetitions']} repetitions, throughput in {workload['unit']}",
        f"{'contender':<38}" + "".join(f"{h:>{w}}" for h, w, _, _ in columns),
    ]
    for name, row in summary["table"].items():
        cells = [format(row.get(key, float("nan")), f">{w}{f}") for _, w, key, f in columns]
        lines.append(f"{name:<38}" + "".join(cells))
    heading = "restore to first batch, median ms at 10% / 50% / 90%"
    lines += ["", f"{'contender':<16}{heading:<56}{'state bytes':>12}  exact resume"]
    for name, row in summary["restore"].items():
        timings = " / ".join(f"{v:.0f}" for v in row["restore_ms_median"].values())
        lines.append(
            f"{name:<16}{timings:<56}{row['state_bytes']:>12}  "
            f"{row['exact_resume']} ({row['exact_resume_detail']})"
        )
    lines += [f"{name}: not run: {why}" for name, why in summary.get("missing", {}).items()]
    return "\n".join([*lines, f"wrote {out / 'bench.json'}"])


def _positive(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return int(text)


def add_options(
    parser: argparse.ArgumentParser,
    samples_help: str = "samples of the data set (default: 60000)",
    repetitions_help: str = "interleaved repetitions (default: 7)",
) -> None:
    """The options of every bench, and ``--_run KIND:ROW``: the one measured run a child makes."""
    parser.set_defaults(workload="reference")
    parser.add_argument("--samples", type=_positive, help=samples_help)
    parser.add_argument("--repetitions", type=_positive, help=repetitions_help)
    batches = "measure throughput over at most this many batches, restore at 10/50/90%% of them"
    parser.add_argument("--batches", type=_positive, help=batches)
    parser.add_argument("--out", type=Path, help="where the results go (default: a new directory)")
    parser.add_argument("--_run", help=argparse.SUPPRESS)


def settle(parser: argparse.ArgumentParser, args: argparse.Namespace, samples: int) -> None:
    """``samples`` and 7 repetitions where the command line gives none; enough samples."""
    args.samples = args.samples or samples
    args.repetitions = args.repetitions or 7
    if args.samples < BATCH * WORKERS * 4:
        parser.error(f"need --samples >= {BATCH * WORKERS * 4}")


def buffer_fields(workload: Workload) -> dict[str, Any]:
    """What bench.json says of a synthetic workload."""
    buffer = workload.buffer
    return dict(description=f"buffer {buffer}", unit="samples", buffer=buffer, batch=BATCH)


def finish(
    summary: dict[str, Any],
    args: argparse.Namespace,
    workload: dict[str, Any],
    missing: dict[str, str],
    runs: dict[str, list[Any]],
    restores: dict[str, Any],
    report: Callable[[dict[str, Any], Path], str] = report,
) -> int:
    """Complete the summary, write ``--out``/bench.json, print ``report``; 0 if resumed exactly."""
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    del options["_run"]
    fixed = dict(save_every=SAVE_EVERY, check_batches=CHECK_BATCHES, workers=WORKERS,
                 prefetch=PREFETCH, torch=torch.__version__)  # fmt: skip
    summary.update(missing=missing, workload={**options, **fixed, **workload})
    summary.update(runs=runs, restore_runs=restores)
    out = args.out or Path(tempfile.mkdtemp(prefix="energy_loader-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(summary, indent=2))
    print(report(summary, out))
    return 0 if summary["restore"]["energy_loader"]["exact_resume"] else 1


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """The measured run ``--_run KIND:ROW`` asks for, in this fresh process."""
    kind, _, row = args._run.partition(":")
    if kind == "restore":
        return restore_check(
            functools.partial(savable_loader, args.samples),
            lambda loader: loader.save_state_rank(),
            lambda loader, state: loader.restore_state_rank(state),
            lambda loader: loader.reset_state(),
            lambda state: len(json.dumps(state)),
            batches=args.batches,
            repetitions=args.repetitions,
        )
    if row == "plain":
        loader = plain_loader(args.samples)
        result = throughput(loader, args.batches)
        shutdown_workers(loader)
        return result
    loader = savable_loader(args.samples)
    save = (lambda loader: loader.save_state_rank()) if row == ROWS[2] else None
    result = throughput(loader, args.batches, save)
    loader.reset_state()
    return result


def main(argv: list[str]) -> int:
    """``python -m energy_loader bench``; 0 when energy_loader resumed exactly."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_options(parser)
    args = parser.parse_args(argv)
    settle(parser, args, REFERENCE.samples)
    if args._run is not None:
        print(json.dumps(_child(args)))
        return 0
    command = [sys.executable, "-m", "energy_loader", "bench", *argv]
    runs = interleave(ROWS, args.repetitions, lambda row: spawn(command, f"throughput:{row}", PROG))
    restores = {"energy_loader": spawn(command, "restore:energy_loader", PROG)}
    summary = summarize(runs, restores)
    return finish(summary, args, buffer_fields(REFERENCE), {}, runs, restores)
