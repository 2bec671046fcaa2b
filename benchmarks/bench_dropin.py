"""The drop-in loader against torch's DataLoader and torchdata's StatefulDataLoader, on a plain
map-style ``Dataset`` given to all three with torch's own arguments.

The reference workload (60k samples of 64 tokens, a tokenizer-like map inside
``__getitem__``, batch 32, shuffle, 2 persistent workers, prefetch 2; docs/benchmarks.md)
written as a ``torch.utils.data.Dataset``. The savable loaders save with ``state_dict()``
every 50 batches. Per repetition, in alternating order: samples/s (and the ratio to torch's
within the repetition), ``state_dict()`` median and p95, the state's size, and the time from
restoring a fresh loader to its first batch at 10/50/90% of the epoch (with a check that the
batch is the one the uninterrupted run yielded there). Run::

    python benchmarks/bench_dropin.py [--repetitions 7] [--no-seed-per-sample] [--samples N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import energy_loader as el
from energy_loader.cli.bench import (
    BATCH,
    PREFETCH,
    SAVE_EVERY,
    WORKERS,
    make_sample,
    p95,
    tokenize,
)

# The module docstring's first paragraph: a whole sentence (its first line is not).
_DESCRIPTION = (__doc__ or "").split("\n\n")[0].replace("\n", " ")


class Tokens(Dataset[Any]):
    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        return tokenize(make_sample(index))


def _stateful_loader_class() -> Any:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # the bench extra is not installed
        return None
    return StatefulDataLoader


def _build(loader_class: Any, samples: int, options: dict[str, Any]) -> Any:
    return loader_class(
        Tokens(samples),
        batch_size=BATCH,
        shuffle=True,
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
        **options,
    )


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def run(loader_class: Any, samples: int, options: dict[str, Any], restores: bool) -> dict[str, Any]:
    """One epoch with saves every 50 batches, then restores at 10/50/90% of it."""
    loader = _build(loader_class, samples, options)
    saving = loader_class is not DataLoader
    batches = len(loader)
    points = {round(f * batches): f for f in (0.1, 0.5, 0.9)}
    began, count, saves, states, firsts = time.perf_counter(), 0, [], {}, {}
    for step, batch in enumerate(loader):
        count += len(batch["index"])
        if step - 1 in points and points[step - 1] in states:
            firsts[points[step - 1]] = batch["index"].tolist()
        if saving and (step % SAVE_EVERY == 0 or step in points):
            save_began = time.perf_counter()
            state = loader.state_dict()
            saves.append(time.perf_counter() - save_began)
            if step in points:
                states[points[step]] = state
    elapsed = time.perf_counter() - began
    _close(loader)
    result: dict[str, Any] = {"samples_per_s": count / elapsed, "save_ms": [s * 1e3 for s in saves]}
    if not (saving and restores):
        return result
    result["state_bytes"] = (
        len(json.dumps(states[0.5])) if loader_class is el.SavableDataLoader else None
    )
    result["restore_s"], result["exact"] = {}, True
    for fraction, state in states.items():
        fresh = _build(loader_class, samples, options)
        restore_began = time.perf_counter()
        fresh.load_state_dict(state)
        first = next(iter(fresh))
        result["restore_s"][fraction] = time.perf_counter() - restore_began
        result["exact"] &= first["index"].tolist() == firsts.get(fraction)
        _close(fresh)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=_DESCRIPTION)
    parser.add_argument(
        "--repetitions", type=int, default=7, help="repetitions, in alternating order (default 7)"
    )
    parser.add_argument(
        "--samples", type=int, default=60_000, help="samples in the dataset (default 60,000)"
    )
    parser.add_argument(
        "--no-seed-per-sample",
        action="store_true",
        help="build the SavableDataLoader with seed_per_sample=False (no per-sample seeding)",
    )
    args = parser.parse_args(argv)
    contenders: dict[str, tuple[Any, dict[str, Any]]] = {
        "torch DataLoader": (DataLoader, {}),
        "SavableDataLoader": (
            el.SavableDataLoader,
            {"seed_per_sample": not args.no_seed_per_sample},
        ),
    }
    stateful = _stateful_loader_class()
    if stateful is not None:
        contenders["torchdata StatefulDataLoader"] = (stateful, {})
    else:
        print(
            "torchdata is not installed: no StatefulDataLoader row (pip install "
            "'energy_loader[bench]', or torchdata, to compare it)",
            flush=True,
        )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    for repetition in range(args.repetitions):
        order = list(contenders) if repetition % 2 == 0 else list(reversed(contenders))
        for name in order:
            loader_class, options = contenders[name]
            restores = repetition < 3  # restores are flat in the position: three reps suffice
            runs[name].append(run(loader_class, args.samples, options, restores))
        plain = runs["torch DataLoader"][-1]["samples_per_s"]
        print(
            f"repetition {repetition + 1}: "
            + ", ".join(f"{n} {runs[n][-1]['samples_per_s'] / plain:.2f}x" for n in contenders),
            flush=True,
        )
    print(
        "\n| loader | samples/s | x torch (paired median, range) | state_dict() med / p95 ms "
        "| restore s at 10/50/90% | state | resumes exactly |"
    )
    print("|---|---:|---:|---:|---|---:|---|")
    plain_runs = runs["torch DataLoader"]
    for name, results in runs.items():
        ratios = [r["samples_per_s"] / p["samples_per_s"] for r, p in zip(results, plain_runs)]
        saves = [s for r in results for s in r["save_ms"]]
        restored = [r for r in results if "restore_s" in r]
        restore = (
            " / ".join(
                f"{statistics.median(r['restore_s'][f] for r in restored):.3f}"
                for f in (0.1, 0.5, 0.9)
            )
            if restored
            else "-"
        )
        size = restored[0].get("state_bytes") if restored else None
        print(
            f"| {name} | {statistics.median(r['samples_per_s'] for r in results):,.0f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
            + (f"{statistics.median(saves):.3f} / {p95(saves):.3f}" if saves else "-")
            + f" | {restore} | {f'{size:,} B' if size else '-'} | "
            + (str(all(r["exact"] for r in restored)) if restored else "-")
            + " |"
        )
    if stateful is None:
        print("| torchdata StatefulDataLoader | not run: torchdata is not installed | | | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
