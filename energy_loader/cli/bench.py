"""``python -m energy_loader bench``: energy_loader against a plain torch ``DataLoader`` on the
reference workload (60,000 samples of 64 tokens -> a tokenizer-like map -> shuffle buffer of
1000 -> batches of 32, 2 workers, prefetch 2), on this machine.

The plain loader does the same work over an ``IterableDataset`` with no state, written the way
that is fastest on torch's own transport (it batches its samples itself: one tensor crosses per
batch). Each measured run is a fresh process of the same command (clean memory, nothing
shared), the runs interleaved over rounds in a rotating order, because a loaded machine is noisy
(+-15%). The repository's ``benchmarks/harness`` builds on this module (:class:`Bench`,
:class:`Contender`, the pipelines) for its other workloads and libraries' loaders.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

__all__ = ["Bench", "Contender", "Meter", "Workload", "main", "p95", "savable_pipeline"]

BATCH, WORKERS, PREFETCH, SAVE_EVERY = 32, 2, 2, 50
FRACTIONS = (0.1, 0.5, 0.9)  # where in the epoch the restore run's states are saved
CHECK_BATCHES = 8  # batches after a restore that the exact-resume check compares


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
    """Where one worker's pass over its shard stands (what a stateful version saves);
    ``drained``: None while the shard streams through the buffer, then how many of the
    shuffled remainder were yielded."""

    epoch: int
    consumed: int
    buffer: list[dict[str, Any]]
    rng: random.Random
    drained: int | None = None


def shuffle_stream(
    workload: Workload, progress: ShuffleProgress, indices: list[int]
) -> Iterator[dict[str, Any]]:
    """Samples made, transformed and passed through a shuffle buffer, from ``progress`` on;
    ``progress`` is kept current at every yield, so that it can be read between samples."""
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
        """Where ``worker``'s pass over this epoch begins: always at its start here (the plain
        pipeline never resumes); a stateful version overrides it to resume from its state."""
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


def _no_state(*_: Any) -> Any:
    raise TypeError("this contender keeps no state")


def shutdown_workers(loader: Any) -> None:
    """Stop the workers of a torch-style loader's live iterator, if it has one."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


@attrs.frozen
class Contender:
    """One loader library driven through its own API; the bench measures every one alike.

    ``build(samples, workload, **options)`` makes a fresh loader over the workload named (one
    pass is one epoch; ``options`` select a variant); ``save(loader)`` is its state right after
    the batch last taken; ``load(loader, state)`` makes a fresh loader continue from there;
    ``state_bytes`` sizes a state as the library stores it; ``close`` stops its workers;
    ``stateful`` says whether save and load exist. For other libraries' loaders (the
    repository's benchmarks): ``missing()`` says why it cannot run here (``None``: it can),
    ``python`` is the interpreter of the venv it runs in (``None``: this one), ``prepare()`` is
    one-time work before its runs, never timed.
    """

    name: str
    build: Callable[..., Any]
    save: Callable[[Any], Any] = _no_state
    load: Callable[[Any, Any], None] = _no_state
    state_bytes: Callable[[Any], int] = lambda state: len(pickle.dumps(state))
    close: Callable[[Any], None] = lambda loader: None
    missing: Callable[[], str | None] = lambda: None
    stateful: bool = True
    python: str | None = None
    prepare: Callable[[], None] | None = None

    def restored(self, samples: int, workload: str, state: Any) -> Any:
        """A fresh loader with ``state`` loaded: its first batch follows the saved one."""
        loader = self.build(samples, workload)
        self.load(loader, state)
        return loader


def _plain_loader(workloads: Mapping[str, Workload], samples: int, workload: str) -> DataLoader:
    spec = workloads[workload]
    return DataLoader(
        PlainPipeline(samples, workload=spec),
        batch_size=None if spec.plain_batches_itself else BATCH,
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
    )


def plain_contender(workloads: Mapping[str, Workload] = WORKLOADS) -> Contender:
    """A torch ``DataLoader`` over :class:`PlainPipeline`, with no state: the reference."""
    build = functools.partial(_plain_loader, workloads)
    return Contender("plain", build, close=shutdown_workers, stateful=False)


def _savable_loader(
    workloads: Mapping[str, Workload],
    samples: int,
    workload: str,
    *,
    seed_per_sample: bool = True,
    **options: Any,
) -> Any:
    from ..loader import SavableDataLoader

    spec = workloads[workload]
    pipeline = savable_pipeline(samples, workload=spec, seed_per_sample=seed_per_sample)
    return SavableDataLoader(pipeline, num_workers=WORKERS, prefetch_factor=PREFETCH, **options)


def energy_loader_contender(workloads: Mapping[str, Workload] = WORKLOADS) -> Contender:
    """``SavableDataLoader`` at its defaults (``options``: its keyword arguments, and the map's
    ``seed_per_sample``); its state is measured as JSON."""
    return Contender(
        "energy_loader",
        functools.partial(_savable_loader, workloads),
        save=lambda loader: loader.save_state_rank(),
        load=lambda loader, state: loader.restore_state_rank(state),
        state_bytes=lambda state: len(json.dumps(state)),
        close=lambda loader: loader.reset_state(),
    )


@attrs.frozen
class Variant:
    """A throughput row: a contender, its build options, whether it saves every 50 batches."""

    contender: Contender
    options: dict[str, Any] = attrs.field(factory=dict)
    saves: bool = False


class Meter:
    """What a throughput run measures besides samples and saves; nothing here (the
    repository's benchmarks read each process's CPU and peak memory)."""

    def start(self) -> None:
        """The timed part of the run begins (after the first batch)."""

    def tick(self, step: int) -> None:
        """Batch ``step`` of the timed part was taken."""

    def stop(self) -> dict[str, Any]:
        """The fields it adds to the run's result."""
        return {}


def median(values: list[float]) -> float:
    """The median of ``values``; NaN when there are none."""
    return statistics.median(values) if values else float("nan")


def p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _positive(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return int(text)


class Bench:
    """A bench program: the contenders it compares on a workload, and how it measures them.

    Every measured run is a fresh process of the same program (:attr:`command`, the parent's
    arguments, ``--_run KIND:NAME``), so that parent and children parse the same options and
    build the same contenders. The repository's benchmarks subclass it; each method is a seam.
    """

    prog = "python -m energy_loader bench"
    description = (
        "energy_loader against a plain torch DataLoader on this machine, on the reference "
        "workload (60k samples of 64 tokens, map -> shuffle buffer 1000 -> batch 32, 2 workers, "
        "prefetch 2): throughput with and without a save_state_rank() every 50 batches, save "
        "median and p95, restore to first batch at 10/50/90% of the epoch, state size (JSON) "
        "and an exact-resume check; each run a fresh process, repetitions interleaved. Other "
        "workloads and libraries run from a checkout of the repository: python "
        "benchmarks/bench_loader.py, python benchmarks/bench_peers.py."
    )
    command: tuple[str, ...] = ("-m", "energy_loader", "bench")
    workloads: Mapping[str, Workload] = WORKLOADS
    samples_help = "samples of the data set (default: 60000)"
    repetitions_help = "interleaved repetitions (default: 7)"
    # The throughput table's columns after the row's name: header, width, field, format.
    columns: tuple[tuple[str, int, str, str], ...] = (
        ("samples/s", 11, "samples_per_s", ".1f"),
        ("x plain", 9, "ratio", ".3f"),
        ("paired", 8, "paired_ratio", ".2f"),
        ("save med ms", 13, "save_ms_median", ".3f"),
        ("save p95 ms", 13, "save_ms_p95", ".3f"),
    )

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        parser.set_defaults(workload="reference")
        parser.add_argument("--samples", type=_positive, help=self.samples_help)
        parser.add_argument("--repetitions", type=_positive, help=self.repetitions_help)
        batches = "measure throughput over at most this many batches, restore at 10/50/90%% of them"
        parser.add_argument("--batches", type=_positive, help=batches)
        parser.add_argument(
            "--out", type=Path, help="where the results go (default: a new directory)"
        )

    def settle(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        """Defaults that depend on other options, and checks of the values together."""
        args.samples = args.samples or self.workloads[args.workload].samples
        args.repetitions = args.repetitions or 7
        if args.samples < BATCH * WORKERS * 4:
            parser.error(f"need --samples >= {BATCH * WORKERS * 4}")

    def contenders(self, args: argparse.Namespace) -> list[Contender]:
        """What the bench compares, in table order: the plain DataLoader first."""
        return [plain_contender(self.workloads), energy_loader_contender(self.workloads)]

    def variants(self, contenders: list[Contender], args: argparse.Namespace) -> dict[str, Variant]:
        """The throughput rows: each contender, and each stateful one saving too."""
        rows = {}
        for contender in contenders:
            rows[contender.name] = Variant(contender)
            if contender.stateful:
                rows[f"{contender.name}+save{SAVE_EVERY}"] = Variant(contender, saves=True)
        return rows

    def count(self, args: argparse.Namespace) -> Callable[[Any], float]:
        """What a batch counts in the throughput: its samples."""
        return lambda batch: len(batch["index"])

    def fingerprint(self, args: argparse.Namespace) -> Callable[[Any], str]:
        """What the exact-resume check compares of a batch: its source indices."""
        return lambda batch: ",".join(str(int(i)) for i in batch["index"])

    def meter(self) -> Meter:
        return Meter()

    def throughput(self, variant: Variant, args: argparse.Namespace) -> dict[str, Any]:
        """Samples per second from the second batch on (the first waits for the workers to
        start), over the epoch or its first ``--batches``, and the time of each save."""
        contender, count, meter = variant.contender, self.count(args), self.meter()
        loader = contender.build(args.samples, args.workload, **variant.options)
        iterator = iter(loader)
        next(iterator)
        samples, saves = 0.0, []
        meter.start()
        start = time.perf_counter()
        for step, batch in enumerate(iterator, start=1):
            samples += count(batch)
            if variant.saves and step % SAVE_EVERY == 0:
                began = time.perf_counter()
                contender.save(loader)
                saves.append((time.perf_counter() - began) * 1000)
            meter.tick(step)
            if args.batches is not None and step + 1 >= args.batches:
                break
        seconds = time.perf_counter() - start
        result: dict[str, Any] = {"samples_per_s": samples / seconds, "samples": samples}
        result.update(seconds=seconds, save_ms=saves, **meter.stop())
        contender.close(loader)
        return result

    def restore(self, contender: Contender, args: argparse.Namespace) -> dict[str, Any]:
        """One uninterrupted run saving after every batch (of the epoch, or of its first
        ``--batches``); from the states at 10/50/90% of it, restore-to-first-batch timings and
        an exact-resume check over the next :data:`CHECK_BATCHES` batches; the state's size."""
        fingerprint, samples, workload = self.fingerprint(args), args.samples, args.workload
        loader, reference, states = contender.build(samples, workload), [], []
        for batch in loader:
            reference.append(fingerprint(batch))
            states.append(contender.save(loader))
            if args.batches is not None and len(reference) >= args.batches + CHECK_BATCHES:
                break
        contender.close(loader)
        steps = min(args.batches or len(reference), len(reference))
        marks = {fraction: max(1, int(steps * fraction)) for fraction in FRACTIONS}
        saved = {fraction: states[mark - 1] for fraction, mark in marks.items()}
        del states, loader
        result: dict[str, Any] = {"batches": steps, "restore_ms": {}, "exact": {}}
        result["state_bytes"] = contender.state_bytes(saved[0.5])
        details = []
        for fraction, state in saved.items():
            timings = []
            for _ in range(args.repetitions):
                began = time.perf_counter()
                restored = contender.restored(samples, workload, state)
                next(iter(restored))
                timings.append((time.perf_counter() - began) * 1000)
                contender.close(restored)
            result["restore_ms"][str(fraction)] = timings
            restored = contender.restored(samples, workload, state)
            tail = [fingerprint(batch) for batch in itertools.islice(restored, CHECK_BATCHES)]
            contender.close(restored)
            expected = reference[marks[fraction] : marks[fraction] + CHECK_BATCHES]
            result["exact"][str(fraction)] = tail == expected
            if tail != expected:
                same = sum(a == b for a, b in zip(tail, expected))
                details.append(f"at {fraction:.0%}: {same} of {len(expected)} batches as expected")
        result["exact_resume"] = all(result["exact"].values())
        result["exact_resume_detail"] = "; ".join(details) or "identical"
        return result

    def child(self, args: argparse.Namespace) -> dict[str, Any]:
        """The measured run ``--_run KIND:NAME`` asks for, in this fresh process."""
        contenders = {contender.name: contender for contender in self.contenders(args)}
        kind, _, name = args._run.partition(":")
        if kind == "restore":
            return self.restore(contenders[name], args)
        return self.throughput(self.variants(list(contenders.values()), args)[name], args)

    def spawn(self, argv: list[str], run: str, python: str | None = None) -> dict[str, Any]:
        """One measured run in a fresh process of this program (in ``python``'s venv, or this
        one), given the parent's arguments; its result is the last line it prints, as JSON."""
        print(f"{self.prog}: {run}", file=sys.stderr, flush=True)
        command = [python or sys.executable, *self.command, *argv, "--_run", run]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"benchmark run {run!r} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def before_runs(self, args: argparse.Namespace, argv: list[str], runs: list[Contender]) -> None:
        """Work done once before the measured runs: none here."""

    def summarize(
        self, runs: dict[str, list[dict[str, Any]]], restores: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        """Medians per throughput row and ratios to the plain DataLoader (``ratio`` divides the
        medians; ``paired_ratio`` is the median of the ratios within each round, whose runs
        share the machine's load of the moment: the steadier figure on a noisy machine), and
        the restore figures of each stateful contender."""
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

    def describe(self, args: argparse.Namespace) -> dict[str, Any]:
        """The run's options and parameters, as bench.json records them."""
        options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        del options["_run"]
        fixed = dict(save_every=SAVE_EVERY, check_batches=CHECK_BATCHES, workers=WORKERS)
        return {**options, **fixed, "prefetch": PREFETCH, "torch": torch.__version__,
                **self.workload_fields(args)}  # fmt: skip

    def workload_fields(self, args: argparse.Namespace) -> dict[str, Any]:
        """What bench.json says of the workload itself."""
        buffer = self.workloads[args.workload].buffer
        return dict(description=f"buffer {buffer}", unit="samples", buffer=buffer, batch=BATCH)

    def table(self, summary: dict[str, Any]) -> str:
        """The two tables the bench prints: throughput rows, then restore per contender."""
        lines = [f"{'contender':<38}" + "".join(f"{h:>{w}}" for h, w, _, _ in self.columns)]
        for name, row in summary["table"].items():
            cells = [
                format(row.get(key, float("nan")), f">{w}{f}") for _, w, key, f in self.columns
            ]
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
        return "\n".join(lines)

    def report(self, summary: dict[str, Any], out: Path) -> str:
        """What the bench prints at the end, bench.json written."""
        workload = summary["workload"]
        return (
            f"workload: {workload['workload']}, {workload['samples']} samples, "
            f"{workload['repetitions']} repetitions, throughput in {workload['unit']}\n"
            f"{self.table(summary)}\nwrote {out / 'bench.json'}"
        )

    def main(self, argv: list[str]) -> int:
        """Run the bench with the command line ``argv``; 0 when energy_loader resumed exactly."""
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        self.add_options(parser)
        parser.add_argument("--_run", help=argparse.SUPPRESS)
        args = parser.parse_args(argv)
        self.settle(parser, args)
        if args._run is not None:
            print(json.dumps(self.child(args)))
            return 0
        contenders, missing = [], {}
        for contender in self.contenders(args):
            reason = contender.missing()
            if reason is None:
                contenders.append(contender)
            else:
                missing[contender.name] = reason
        self.before_runs(args, argv, contenders)
        variants = self.variants(contenders, args)
        names = list(variants)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for repetition in range(args.repetitions):
            shift = repetition % len(names)
            for name in names[shift:] + names[:shift]:
                python = variants[name].contender.python
                runs[name].append(self.spawn(argv, f"throughput:{name}", python))
        restores = {
            contender.name: self.spawn(argv, f"restore:{contender.name}", contender.python)
            for contender in contenders
            if contender.stateful
        }
        summary = self.summarize(runs, restores)
        summary.update(missing=missing, workload=self.describe(args))
        summary.update(runs=runs, restore_runs=restores)
        out = args.out or Path(tempfile.mkdtemp(prefix="energy_loader-bench-"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(summary, indent=2))
        print(self.report(summary, out))
        return 0 if summary["restore"]["energy_loader"]["exact_resume"] else 1


def main(argv: list[str]) -> int:
    """``python -m energy_loader bench``."""
    return Bench().main(argv)
