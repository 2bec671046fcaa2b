"""What per-index seeding costs a Hugging Face ``datasets.Dataset`` with a ``set_transform``.

A ``datasets.Dataset`` has ``__getitems__``, and its ``set_transform`` runs on a whole batch.
With ``seed_per_sample=True`` (the default) the drop-in loader calls ``__getitems__([i])``
once per index, under that index's seed, so a row's augmentation does not depend on its
batch (a restore onto another batch size or world size draws the same numbers);
``seed_per_sample=False`` makes one call per batch, as torch's loader does, and a restored
augmentation is not reproduced. This script measures samples/s of both beside torch's own
``DataLoader``: ``--rows`` rows of text, a tokenizer-like transform that masks 15% of the
tokens at random (python ``random``), batch 32, shuffled, ``--workers`` workers, the
repetitions alternating the order. Run::

    python benchmarks/bench_hf_getitems.py [--rows 20000] [--workers 0] [--repetitions 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import zlib
from typing import Any

import datasets
import torch
from torch.utils.data import DataLoader

import energy_loader as el

TOKENS = 64
BATCH = 32


def tokenize_and_mask(batch: dict[str, list[Any]]) -> dict[str, Any]:
    """Words to ids (crc32), padded to 64, then 15% of the tokens masked at random."""
    ids = []
    for text in batch["text"]:
        row = [zlib.crc32(word.encode()) % 30000 for word in text.split()][:TOKENS]
        row += [0] * (TOKENS - len(row))
        ids.append([0 if random.random() < 0.15 else token for token in row])
    return {"input_ids": torch.tensor(ids), "label": batch["label"]}


def make_table(rows: int) -> datasets.Dataset:
    words = [f"w{i}" for i in range(500)]
    rng = random.Random(0)
    table = datasets.Dataset.from_dict(
        {
            "text": [" ".join(rng.choices(words, k=rng.randint(20, 80))) for _ in range(rows)],
            "label": [i % 2 for i in range(rows)],
        }
    )
    table.set_transform(tokenize_and_mask)
    return table


def samples_per_second(kind: str, table: datasets.Dataset, workers: int) -> float:
    options: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "num_workers": workers}
    if kind == "torch DataLoader":
        loader: Any = DataLoader(table, **options)
    else:
        loader = el.SavableDataLoader(
            table, seed_per_sample=kind == "drop-in, per index (default)", **options
        )
    began = time.perf_counter()
    count = sum(len(batch["label"]) for batch in loader)
    seconds = time.perf_counter() - began
    if hasattr(loader, "close"):
        loader.close()
    return count / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--repetitions", type=int, default=5)
    options = parser.parse_args()
    table = make_table(options.rows)
    kinds = ["torch DataLoader", "drop-in, per batch", "drop-in, per index (default)"]
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    for repetition in range(options.repetitions):
        order = kinds if repetition % 2 == 0 else kinds[::-1]
        for kind in order:
            results[kind].append(samples_per_second(kind, table, options.workers))
    reference = statistics.median(results["torch DataLoader"])
    report = {
        kind: {
            "samples_per_s": round(statistics.median(values)),
            "vs_torch": round(statistics.median(values) / reference, 3),
        }
        for kind, values in results.items()
    }
    print(json.dumps({"rows": options.rows, "workers": options.workers, **report}, indent=1))


if __name__ == "__main__":
    main()
