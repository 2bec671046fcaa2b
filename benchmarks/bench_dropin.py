"""Throughput of the drop-in loader against torch's DataLoader on the same map-style dataset.

The reference workload (60k samples of 64 tokens, a tokenizer-like map inside
``__getitem__``, batch 32, shuffle, 2 persistent workers, prefetch 2) written as a plain
``torch.utils.data.Dataset``, given to both loaders with the same arguments; the drop-in
saves its state every 50 batches. Interleaved repetitions, ratio within each. Run::

    python benchmarks/bench_dropin.py [--repetitions 7] [--no-seed-per-sample]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import energy_loader as el
from energy_loader.cli.bench.workloads import (
    BATCH,
    PREFETCH,
    SAVE_EVERY,
    WORKERS,
    make_sample,
    tokenize,
)

SAMPLES = 60_000


class Tokens(Dataset[Any]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        return tokenize(make_sample(index))


def run(loader_class: Any, **options: Any) -> tuple[float, list[float]]:
    torch.manual_seed(0)
    loader = loader_class(
        Tokens(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
        **options,
    )
    saving = loader_class is not DataLoader
    began, samples, saves = time.perf_counter(), 0, []
    for step, batch in enumerate(loader):
        samples += len(batch["index"])
        if saving and step % SAVE_EVERY == 0:
            save_began = time.perf_counter()
            loader.state_dict()
            saves.append(time.perf_counter() - save_began)
    elapsed = time.perf_counter() - began
    if saving:
        loader.close()
    return samples / elapsed, saves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--no-seed-per-sample", action="store_true")
    args = parser.parse_args()
    options = {"seed_per_sample": not args.no_seed_per_sample}
    ratios = []
    for repetition in range(args.repetitions):
        plain, _ = run(DataLoader)
        dropin, saves = run(el.SavableDataLoader, **options)
        ratios.append(dropin / plain)
        print(
            f"repetition {repetition}: torch {plain:,.0f} samples/s, drop-in {dropin:,.0f} "
            f"samples/s ({dropin / plain:.2f}x), state_dict() median "
            f"{statistics.median(saves) * 1e3:.3f} ms",
            flush=True,
        )
    print(f"median ratio {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
