"""What the proof of values costs per item: ``content_digest`` on typical items.

A pipeline loader that checks its restores digests every item's values where it is made (in
the worker process, or without workers before it hands the item out), so that a save records
the digest of each partition's last item (``partitions[j].made``). This times the digest of:

- ``image batch``: ``{"image": uint8[256, 3, 224, 224], "label": int64[256]}`` (38.5 MB);
- ``image batch, channels last``: the same images as a non-contiguous view (``permute``);
- ``reference batch``: the reference workload's batch, ``{"index": int64[32], "tokens":
  int64[32, 64]}``;
- ``reference sample``: one of its samples before batching (an int and ``int64[64]``);
- ``token list``: a sample of 2,048 python ints (a tokenizer's output before collation);
- ``text``: a 100,000-character document;
- ``light batch``: 64 small records as a list (an int, a short str, an int label, a float:
  the light samples of ``benchmarks/bench_light.py``);
- ``documents batch``: 64 ``{"tokens": uint16[256], "index": int}`` as a list (what
  ``MegatronIndexedSource`` batched as lists hands out);
- ``token arrays``: 64 ``int32[256]`` arrays as a list.

Each round times every item once, in a shuffled order, ``--repetitions`` rounds; prints the
median and p95 in microseconds. Then, with ``--passes N`` (default 6), what the digests cost
a pipeline: the reference workload (``energy_loader.cli.bench``, 20,000 samples ->
map -> shuffle buffer 1000 -> batch 32) run in this process (``num_workers=0``, where the
digest is taken on the loop's thread; with workers it is taken in the worker processes) with
``verify_restore=True`` (a digest per batch) and ``False`` (none), interleaved in alternating
order, as the process's CPU time per batch. Example::

    python benchmarks/bench_content_digest.py --repetitions 200 --passes 6
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from energy_loader.state.digests import content_digest


def items() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (256, 3, 224, 224), dtype=torch.uint8, generator=generator)
    return {
        "image batch": {"image": images, "label": torch.arange(256)},
        "image batch, channels last": {
            "image": images.permute(0, 2, 3, 1),
            "label": torch.arange(256),
        },
        "reference batch": {
            "index": torch.arange(32),
            "tokens": torch.randint(0, 50_000, (32, 64), generator=generator),
        },
        "reference sample": {"index": 7, "tokens": torch.arange(64)},
        "token list": {"input_ids": list(range(2048))},
        "text": {"text": "lorem ipsum " * 8_334},
        "light batch": [
            {"id": i, "text": f"sample {i}", "label": i % 10, "score": i * 0.5} for i in range(64)
        ],
        "documents batch": [
            {
                "tokens": torch.randint(0, 50_000, (256,), generator=generator)
                .numpy()
                .astype("uint16"),
                "index": i,
            }
            for i in range(64)
        ],
        "token arrays": [
            torch.randint(0, 50_000, (256,), generator=generator, dtype=torch.int32).numpy()
            for _ in range(64)
        ],
    }


def _pass(verify: bool, samples: int = 20_000) -> float:
    """CPU seconds per batch of one pass over the reference workload in this process."""
    from energy_loader import SavableDataLoader
    from energy_loader.cli.bench import savable_pipeline

    loader = SavableDataLoader(savable_pipeline(samples), verify_restore=verify)
    iterator = iter(loader)
    next(iterator)
    began, batches = time.process_time(), 0
    for _ in iterator:
        batches += 1
    return (time.process_time() - began) / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=200, help="rounds over every item")
    parser.add_argument("--passes", type=int, default=6, help="pipeline passes per setting")
    args = parser.parse_args()
    cases = items()
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for name in names:  # warm up (first calls import and allocate)
        content_digest(cases[name])
    rng = random.Random(0)
    for _ in range(args.repetitions):
        rng.shuffle(names)
        for name in names:
            began = time.perf_counter()
            content_digest(cases[name])
            times[name].append(time.perf_counter() - began)
    print(f"{'item':<28} {'median us':>10} {'p95 us':>10}")
    for name, spent in times.items():
        spent.sort()
        p95 = spent[min(len(spent) - 1, int(0.95 * len(spent)))]
        print(f"{name:<28} {statistics.median(spent) * 1e6:>10.1f} {p95 * 1e6:>10.1f}")
    if not args.passes:
        return
    per_batch: dict[bool, list[float]] = {True: [], False: []}
    for number in range(args.passes):
        for verify in (True, False) if number % 2 else (False, True):
            per_batch[verify].append(_pass(verify))
    print(f"\n{'reference workload, 0 workers':<32} {'CPU us per batch (median)':>26}")
    for verify, spent in per_batch.items():
        runs = ", ".join(f"{t * 1e6:.0f}" for t in spent)
        label = f"verify_restore={verify}"
        print(f"{label:<32} {statistics.median(spent) * 1e6:>26.0f}  ({runs})")


if __name__ == "__main__":
    main()
