"""The benchmark workloads (docs/benchmarks.md), side by side: ``python
benchmarks/bench_loader.py`` (energy_loader and the plain torch DataLoader) and ``python
benchmarks/bench_peers.py`` (the same, with other libraries' loaders added).

:class:`WorkloadBench` is the package's ``python -m energy_loader bench``
(:class:`.bench.Bench`, on the functions of :mod:`energy_loader.cli.bench`: each measured run
a fresh process, interleaved over rounds in rotating order, medians and paired ratios,
restores at 10/50/90% of the epoch with an exact-resume check) with more to measure:

- more workloads (``--workload``, :mod:`.workloads`): ``reference``, ``large`` (3 x 224 x 224
  uint8 images, buffer 64, 4.8 MB per batch), and the real ``llm`` (Parquet documents ->
  tokenizer -> 2,048-token packs -> batches of 8) and ``vision`` (WebDataset JPEGs -> decode ->
  random resized crop + flip -> batches of 64), whose data is made once into ``--cache``
  (:mod:`.data`). On the real workloads every stateful contender runs with a save every 50
  batches only (what a training loop does);
- the CPU seconds of the main process and of the processes under it per 1,000 samples, and
  their peak RSS (:mod:`.processes`), next to samples/s;
- on the synthetic workloads, two more rows of energy_loader saving every 50 batches:
  ``/torch-transport``, with the batch codec off (``transport_codec=False``), to show what the
  codec brings, and ``/no-seeding``, with ``seed_per_sample=False`` on the map, whose function
  draws nothing (the plain pipeline seeds nothing either): the default re-seeds the global RNGs
  before every sample, which is most of the per-sample difference;
- contenders that run in venvs of their own, or need one-time preparation (the peers);
- ``bench.png`` beside ``bench.json``, with matplotlib.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from energy_loader.cli.bench import FRACTIONS, SAVE_EVERY, median

from .bench import Bench, Contender, Meter, Variant
from .data import DEFAULT_CACHE, data_dir, ensure_data
from .processes import cpu_seconds, descendants, peak_rss_kib
from .workloads import REAL_WORKLOADS, WORKLOADS, real_contenders

__all__ = ["ProcessMeter", "WorkloadBench"]

SAMPLE_EVERY = 20  # batches between two readings of the processes' CPU and peak RSS


class ProcessMeter(Meter):
    """The CPU seconds of the main process and of the processes under it (workers, their
    helpers), and their peak RSS, from ``/proc``. Processes that end with the epoch (some
    loaders stop their workers then) would take their CPU and peak RSS with them: both are read
    every :data:`SAMPLE_EVERY` batches too."""

    def start(self) -> None:
        self.me = os.getpid()
        self.pids = [self.me, *descendants(self.me)]
        self.cpu_start = cpu_seconds(self.pids)
        self.cpu, self.rss = dict(self.cpu_start), peak_rss_kib(self.pids)

    def tick(self, step: int) -> None:
        if step % SAMPLE_EVERY == 0:
            self._read(self.pids)

    def stop(self) -> dict[str, Any]:
        self._read(sorted({*self.pids, *descendants(self.me)}))
        spent = {pid: t - self.cpu_start.get(pid, 0.0) for pid, t in self.cpu.items()}
        return {
            "cpu_main_s": spent.get(self.me, 0.0),
            "cpu_workers_s": sum(t for pid, t in spent.items() if pid != self.me),
            "rss_kib": sum(self.rss.values()),
            "processes": len(self.rss),
        }

    def _read(self, pids: list[int]) -> None:
        self.cpu.update(cpu_seconds(pids))
        self.rss.update(peak_rss_kib(pids))


class WorkloadBench(Bench):
    """The package's bench over every workload, with the processes' CPU and memory and a
    figure; ``benchmarks/bench_peers.py`` adds the peers' contenders to it."""

    prog = "python benchmarks/bench_loader.py"
    description = (
        "The benchmark workloads (docs/benchmarks.md): a plain torch DataLoader and "
        "energy_loader running the same pipeline, interleaved repetitions, medians and ratios, "
        "CPU and peak RSS per process. python benchmarks/bench_peers.py adds the other "
        "libraries' loaders (torchdata, megatron-energon, MosaicML Streaming, Grain)."
    )
    # Each measured run is this script run again.
    command: tuple[str, ...] = (str(Path(__file__).resolve().parents[1] / "bench_loader.py"),)
    workloads = WORKLOADS
    samples_help = (
        "samples of the data set (llm: documents, default 200000; vision: JPEGs, default "
        "20000; reference: 60000; large: 6400)"
    )
    repetitions_help = "interleaved repetitions (default: 7; 5 for llm and vision)"
    columns = (
        *Bench.columns,
        ("CPU s/1k", 10, "cpu_s_per_1000", ".2f"),
        ("main", 6, "cpu_main_share", ".0%"),
        ("RSS MiB", 9, "rss_mib", ".0f"),
        ("x plain", 9, "rss_ratio", ".3f"),
    )

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        super().add_options(parser)
        parser.add_argument(
            "--workload",
            choices=sorted([*WORKLOADS, *REAL_WORKLOADS]),
            default="reference",
            help="reference: 60k samples of 64 tokens, map -> shuffle buffer 1000 -> batch 32; "
            "large: 3x224x224 uint8 images (5 MB batches); llm: Parquet documents -> "
            "byte-level BPE -> 2,048-token packs -> batches of 8; vision: WebDataset JPEGs -> "
            "decode -> random resized crop 224 + flip -> batches of 64",
        )
        parser.add_argument(
            "--cache",
            type=Path,
            default=DEFAULT_CACHE,
            help=f"where the llm and vision data are made once and kept (default: {DEFAULT_CACHE})",
        )

    def settle(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        real = REAL_WORKLOADS.get(args.workload)
        if real is None:
            return super().settle(parser, args)
        args.samples = real.size if args.samples is None else args.samples
        args.repetitions = 5 if args.repetitions is None else args.repetitions
        if args.samples < 64:
            parser.error("need --samples >= 64 for the llm and vision workloads")

    def folder(self, args: argparse.Namespace) -> Path | None:
        """The data folder of a real workload; ``None`` for the synthetic ones."""
        if args.workload not in REAL_WORKLOADS:
            return None
        return data_dir(args.cache, args.workload, args.samples)

    def contenders(self, args: argparse.Namespace) -> list[Contender]:
        folder = self.folder(args)
        if folder is None:
            return super().contenders(args)
        return real_contenders(args.workload, folder)

    def variants(self, contenders: list[Contender], args: argparse.Namespace) -> dict[str, Variant]:
        rows = super().variants(contenders, args)
        if args.workload in REAL_WORKLOADS:  # a training loop saves: stateful ones saving only
            return {
                name: row for name, row in rows.items() if row.saves or not row.contender.stateful
            }
        ours = f"energy_loader+save{SAVE_EVERY}"
        table = {}
        for name, row in rows.items():
            table[name] = row
            if name == ours:
                table[f"{ours}/torch-transport"] = Variant(
                    row.contender, {"transport_codec": False}, saves=True
                )
                table[f"{ours}/no-seeding"] = Variant(
                    row.contender, {"seed_per_sample": False}, saves=True
                )
        return table

    def count(self, args: argparse.Namespace) -> Any:
        real = REAL_WORKLOADS.get(args.workload)
        return super().count(args) if real is None else real.count

    def fingerprint(self, args: argparse.Namespace) -> Any:
        real = REAL_WORKLOADS.get(args.workload)
        return super().fingerprint(args) if real is None else real.fingerprint

    def meter(self) -> Meter:
        return ProcessMeter()

    def child(self, args: argparse.Namespace) -> dict[str, Any]:
        kind, _, name = args._run.partition(":")
        if kind != "prepare":
            return super().child(args)
        (contender,) = [c for c in self.contenders(args) if c.name == name]
        if contender.prepare is not None:
            contender.prepare()
        return {}

    def before_runs(
        self, args: argparse.Namespace, argv: list[str], contenders: list[Contender]
    ) -> None:
        """The real workload's data, made once; each contender's preparation, in its own
        interpreter (a peer's copy of the data in its own format)."""
        if args.workload in REAL_WORKLOADS:
            ensure_data(args.cache, args.workload, args.samples)
        for contender in contenders:
            if contender.prepare is not None:
                self.spawn(argv, f"prepare:{contender.name}", contender.python)

    def summarize(
        self, runs: dict[str, list[dict[str, Any]]], restores: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        """The package's summary, plus per row: ``cpu_s_per_1000``, the CPU of the main
        process and the processes under it per 1,000 samples (median over the runs), and
        ``cpu_main_share``, the main process's part of it; the peak RSS, in MiB and as a ratio
        to the plain DataLoader's."""
        summary = super().summarize(runs, restores)
        plain_rss = median([run["rss_kib"] for run in runs["plain"]])
        for name, results in runs.items():
            cpu = [(run["cpu_main_s"] + run["cpu_workers_s"], run) for run in results]
            rss = median([run["rss_kib"] for run in results])
            summary["table"][name].update(
                cpu_s_per_1000=median(
                    [1000 * s / run["samples"] for s, run in cpu if run["samples"]]
                ),
                cpu_main_share=median([run["cpu_main_s"] / s for s, run in cpu if s > 0]),
                rss_mib=rss / 1024,
                rss_ratio=rss / plain_rss if plain_rss else float("nan"),
            )
        return summary

    def workload_fields(self, args: argparse.Namespace) -> dict[str, Any]:
        real = REAL_WORKLOADS.get(args.workload)
        if real is None:
            return super().workload_fields(args)
        return {
            "description": real.description, "unit": real.unit, "size_name": real.size_name,
            "data": str(self.folder(args)),
        }  # fmt: skip

    def report(self, summary: dict[str, Any], out: Path) -> str:
        text = super().report(summary, out)
        return text + f" and {out / 'bench.png'}" if _plot(summary, out / "bench.png") else text

    def main(self, argv: list[str]) -> int:
        # The tokenizers' own threads would compete with the loaders' workers.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return super().main(argv)


def _plot(summary: dict[str, Any], path: Path) -> bool:
    """Throughput and CPU per row, and restore times per contender, as one figure; ``False``
    without matplotlib."""
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
    figure.suptitle(f"{workload.get('workload', '')}: {workload.get('description', '')}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
