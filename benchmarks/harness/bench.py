"""A bench program for any workload and any library's loader, built on the package's
``python -m energy_loader bench`` (:mod:`energy_loader.cli.bench`): its workload, throughput
run, restore check, child processes, summary and table.

- :class:`Contender`: one loader library driven through its own API (:func:`plain_contender`
  and :func:`energy_loader_contender` here; the peers in ``benchmarks/peers/``);
- :class:`Variant`: a throughput row, a contender with its options;
- :class:`Meter`: what a throughput run measures besides samples and saves;
- :class:`Bench`: the program; each method is a seam that :class:`.runner.WorkloadBench`
  overrides (workloads, CPU and memory, one-time preparation, a figure).

Not here: the workloads (:mod:`.workloads`) and the arithmetic of a run, which stays the
package's so that both benches measure alike.
"""

from __future__ import annotations

import argparse
import functools
import json
import pickle
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from energy_loader.cli import bench as cli
from energy_loader.cli.bench import SAVE_EVERY, WORKLOADS, Workload

__all__ = ["Bench", "Contender", "Meter", "Variant", "energy_loader_contender", "plain_contender"]


def _no_state(*_: Any) -> Any:
    raise TypeError("this contender keeps no state")


@attrs.frozen
class Contender:
    """One loader library driven through its own API; the bench measures every one alike.

    ``build(samples, workload, **options)`` makes a fresh loader over the workload named (one
    pass is one epoch; ``options`` select a variant); ``save(loader)`` is its state right after
    the batch last taken; ``load(loader, state)`` makes a fresh loader continue from there;
    ``state_bytes`` sizes a state as the library stores it; ``close`` stops its workers;
    ``stateful`` says whether save and load exist. ``missing()`` says why it cannot run here
    (``None``: it can), ``python`` is the interpreter of the venv it runs in (``None``: this
    one), ``prepare()`` is one-time work before its runs, never timed.
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


def _plain_loader(workloads: Mapping[str, Workload], samples: int, workload: str) -> Any:
    return cli.plain_loader(samples, workloads[workload])


def plain_contender(workloads: Mapping[str, Workload] = WORKLOADS) -> Contender:
    """The package's plain torch ``DataLoader``, with no state: the reference."""
    build = functools.partial(_plain_loader, workloads)
    return Contender("plain", build, close=cli.shutdown_workers, stateful=False)


def _savable_loader(
    workloads: Mapping[str, Workload], samples: int, workload: str, **options: Any
) -> Any:
    return cli.savable_loader(samples, workloads[workload], **options)


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
    """What a throughput run measures besides samples and saves; nothing here
    (:class:`.runner.ProcessMeter` reads each process's CPU and peak memory)."""

    def start(self) -> None:
        """The timed part of the run begins (after the first batch)."""

    def tick(self, step: int) -> None:
        """Batch ``step`` of the timed part was taken."""

    def stop(self) -> dict[str, Any]:
        """The fields it adds to the run's result."""
        return {}

    def step(self, step: int) -> None:
        """The throughput run took batch ``step`` (0: the first, before the timed part)."""
        if step == 0:
            self.start()
        else:
            self.tick(step)


class Bench:
    """A bench program: the contenders it compares on a workload, and how it measures them.

    Every measured run is a fresh process of the same program (:attr:`command`, the parent's
    arguments, ``--_run KIND:NAME``), so that parent and children parse the same options and
    build the same contenders. A subclass names the program; each method is a seam.
    """

    prog: str
    description: str
    command: tuple[str, ...]  # the program each measured run runs, after the interpreter
    workloads: Mapping[str, Workload] = WORKLOADS
    samples_help = "samples of the data set (default: 60000)"
    repetitions_help = "interleaved repetitions (default: 7)"
    columns: tuple[tuple[str, int, str, str], ...] = cli.COLUMNS

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        cli.add_options(parser, self.samples_help, self.repetitions_help)

    def settle(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        """Defaults that depend on other options, and checks of the values together."""
        cli.settle(parser, args, self.workloads[args.workload].samples)

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
        return cli.batch_samples

    def fingerprint(self, args: argparse.Namespace) -> Callable[[Any], str]:
        """What the exact-resume check compares of a batch: its source indices."""
        return cli.batch_indices

    def meter(self) -> Meter:
        return Meter()

    def throughput(self, variant: Variant, args: argparse.Namespace) -> dict[str, Any]:
        """The package's throughput run of ``variant``, with what :meth:`meter` adds."""
        contender, meter = variant.contender, self.meter()
        loader = contender.build(args.samples, args.workload, **variant.options)
        save = contender.save if variant.saves else None
        result = cli.throughput(loader, args.batches, save, self.count(args), meter.step)
        result.update(meter.stop())
        contender.close(loader)
        return result

    def restore(self, contender: Contender, args: argparse.Namespace) -> dict[str, Any]:
        """The package's restore check of ``contender``."""
        return cli.restore_check(
            functools.partial(contender.build, args.samples, args.workload),
            contender.save,
            contender.load,
            contender.close,
            contender.state_bytes,
            batches=args.batches,
            repetitions=args.repetitions,
            fingerprint=self.fingerprint(args),
        )

    def child(self, args: argparse.Namespace) -> dict[str, Any]:
        """The measured run ``--_run KIND:NAME`` asks for, in this fresh process."""
        contenders = {contender.name: contender for contender in self.contenders(args)}
        kind, _, name = args._run.partition(":")
        if kind == "restore":
            return self.restore(contenders[name], args)
        return self.throughput(self.variants(list(contenders.values()), args)[name], args)

    def spawn(self, argv: list[str], run: str, python: str | None = None) -> dict[str, Any]:
        """One measured run in a fresh process of this program, in ``python``'s venv (or
        this one), given the parent's arguments."""
        return cli.spawn([python or sys.executable, *self.command, *argv], run, self.prog)

    def before_runs(self, args: argparse.Namespace, argv: list[str], runs: list[Contender]) -> None:
        """Work done once before the measured runs: none here."""

    def summarize(
        self, runs: dict[str, list[dict[str, Any]]], restores: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        """The package's medians and ratios to the plain DataLoader, and restore figures."""
        return cli.summarize(runs, restores)

    def workload_fields(self, args: argparse.Namespace) -> dict[str, Any]:
        """What bench.json says of the workload itself."""
        return cli.buffer_fields(self.workloads[args.workload])

    def report(self, summary: dict[str, Any], out: Path) -> str:
        """What the bench prints at the end, bench.json written."""
        return cli.report(summary, out, self.columns)

    def main(self, argv: list[str]) -> int:
        """Run the bench with the command line ``argv``; 0 when energy_loader resumed exactly."""
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        self.add_options(parser)
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
        python = {name: variant.contender.python for name, variant in variants.items()}
        runs = cli.interleave(
            list(variants),
            args.repetitions,
            lambda name: self.spawn(argv, f"throughput:{name}", python[name]),
        )
        restores = {
            contender.name: self.spawn(argv, f"restore:{contender.name}", contender.python)
            for contender in contenders
            if contender.stateful
        }
        summary = self.summarize(runs, restores)
        fields = self.workload_fields(args)
        return cli.finish(summary, args, fields, missing, runs, restores, self.report)
