"""How fast one item of a given size crosses from a worker to the main process.

For payload sizes from 1 KiB to 16 MiB, a 2-worker ``SavableDataLoader`` whose pipeline does
almost nothing but make one uint8 tensor of that size per item is run three ways, interleaved
over ``--repetitions`` rounds:

- ``inline``: the batch codec with every payload inline (``transport_inline_bytes`` huge);
- ``arena``: the batch codec with every payload through the shared-memory arena
  (``transport_inline_bytes=0``);
- ``torch``: torch's own transport (``transport_codec=False``).

The consumer touches every page of each item (torch's shared memory is mapped lazily, so a
consumer that never reads would hide part of its cost). It prints items/s (median) per size
and mode; the crossover between ``inline`` and ``arena``
is what ``DEFAULT_INLINE_BYTES`` is set from. Example::

    python benchmarks/bench_transport.py --repetitions 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import attrs
import torch

import energy_loader as el

MODES = {
    "inline": {"transport_inline_bytes": 1 << 62},
    "arena": {"transport_inline_bytes": 0},
    "torch": {"transport_codec": False},
}
KIB = 1 << 10
SIZES = [KIB * k for k in (1, 4, 16, 32, 64, 128, 256, 1024, 4096, 16384)]


@attrs.frozen
class Payload:
    """Item ``i``: ``size`` bytes of value ``i % 251``."""

    size: int

    def __call__(self, index: int) -> torch.Tensor:
        return torch.full((self.size,), index % 251, dtype=torch.uint8)


def items_per_second(size: int, mode: str, seconds: float) -> float:
    """Throughput of one fresh loader, after its first item, for about ``seconds``."""
    source = el.IndexedSource.from_fn(10**9, Payload(size))
    loader = el.SavableDataLoader(source, num_workers=2, **MODES[mode])
    iterator = iter(loader)
    next(iterator)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        item = next(iterator)
        item[::4096].sum()  # a consumer reads its batch: touch every page once
        count += 1
    elapsed = time.perf_counter() - start
    assert item.numel() == size
    loader.reset_state()
    return count / elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args(argv)
    results: dict[int, dict[str, list[float]]] = {s: {m: [] for m in MODES} for s in SIZES}
    modes = list(MODES)
    for repetition in range(args.repetitions):
        for size in SIZES:
            shift = repetition % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                results[size][mode].append(items_per_second(size, mode, args.seconds))
    print(
        f"{'payload':>10}"
        + "".join(f"{m + ' items/s':>17}" for m in modes)
        + f"{'arena/inline':>14}"
    )
    for size in SIZES:
        medians = {m: statistics.median(results[size][m]) for m in modes}
        label = f"{size // KIB} KiB" if size < KIB * KIB else f"{size // KIB // KIB} MiB"
        print(
            f"{label:>10}"
            + "".join(f"{medians[m]:>17.0f}" for m in modes)
            + f"{medians['arena'] / medians['inline']:>14.2f}"
        )
    return results


if __name__ == "__main__":
    main()
