"""Where the time of the real workloads goes (docs/benchmarks.md#real-workloads).

For ``llm`` and ``vision`` (the data of ``benchmarks/bench_loader.py``, made once in the
cache), two measurements on one thread in this process, no loader workers:

1. the per-sample work alone, the floor under any loader: tokenizing the documents
   (:class:`~benchmarks.harness.llm.Tokenize`) or decoding and augmenting the JPEGs
   (:func:`~benchmarks.harness.vision.decode_and_augment`), read straight from the files;
2. our pipeline and the plain one (the plain DataLoader's dataset, iterated directly) over the
   same samples under ``cProfile``, their time put in buckets: the per-sample work, reading
   the files, packing / batching / collating, per-sample seeding, and the rest.

With ``--in-loader``, instead, each loader of the bench (the plain torch ``DataLoader``,
energy_loader and torchdata's ``StatefulDataLoader``, 2 workers) runs ``--items`` batches and
each of its processes reports, per 1,000 samples: CPU seconds, context switches (voluntary and
involuntary, all threads) and minor page faults, from ``/proc``
(:mod:`benchmarks.harness.processes`).

The CPU a sample costs in a loader is (1) plus that loader's own overhead, in the workers and in
the main process, which competes with them for the cores. In one thread (2) shows the overhead
of the pipelines; in the loader (``--in-loader``) the transport adds its own: torch passes every
shared-memory tensor of a batch through a thread of the worker (a socket and a file descriptor
per tensor) and maps fresh shared memory for each batch, and the context switches and page
faults this costs show up as CPU per sample of the worker's own work too. Examples::

    python benchmarks/profile_workloads.py --workload llm --samples 200000 --items 2000
    python benchmarks/profile_workloads.py --workload llm --in-loader --items 1000
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.harness, .peers

from benchmarks.harness import llm, processes, vision
from benchmarks.harness.data import DEFAULT_CACHE, ensure_data

BUCKETS = {
    "per-sample work": ("tokenizers", "encode", "torch.tensor", "llm.py:__call__",
                        "decode_and_augment", "ImagingDecoder", "_upsample_bilinear2d", "PIL",
                        "flip", "_crop_box", "uniform_", "randint", "torch.rand"),
    "reading files": ("parquet", "pyarrow", "read_row_group", "to_pylist", "_tar", "tarfile",
                      "webdataset", "seek", "read"),
    "seeding": ("seed_globals", "manual_seed", "mix64", "fold_key", "seed"),
    "pack / batch / collate": ("packing", "collate", "stack", "cat", "batch", "sequences"),
}  # fmt: skip


def _bucket(name: str) -> str:
    for bucket, needles in BUCKETS.items():
        if any(needle in name for needle in needles):
            return bucket
    return "other"


def _profile(iterable: Any, items: int) -> tuple[float, dict[str, float], int]:
    """Seconds for ``items`` batches, seconds per bucket (functions' own time), samples."""
    profile = cProfile.Profile()
    count = 0.0
    began = time.process_time()
    profile.enable()
    for batch in itertools.islice(iterable, items):
        count += _count(batch)
    profile.disable()
    total = time.process_time() - began
    buckets: dict[str, float] = {}
    for (filename, _, function), row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        bucket = _bucket(f"{filename}:{function}")
        buckets[bucket] = buckets.get(bucket, 0.0) + row[2]
    return total, buckets, int(count)


_count: Any = None


def _in_loader(workload: str, folder: Path, items: int) -> int:
    """Each in-process contender of the bench over ``items`` batches: per process, CPU
    seconds, context switches and minor page faults per 1,000 samples."""
    from benchmarks.harness.workloads import REAL_WORKLOADS, real_contenders
    from benchmarks.peers.peer_torchdata import torchdata_real_contender

    count_of = REAL_WORKLOADS[workload].count
    contenders = [*real_contenders(workload, folder), torchdata_real_contender(workload, folder)]
    print(f"{workload}, {items} batches, per 1,000 samples (switches: voluntary + involuntary)")
    for contender in contenders:
        if contender.missing() is not None:
            print(f"{contender.name}: not run ({contender.missing()})")
            continue
        loader = contender.build(0, workload)
        iterator = iter(loader)
        next(iterator)  # workers started, first batch made
        me = os.getpid()
        pids = [me, *processes.descendants(me)]
        before = processes.counters(pids)
        began, samples = time.perf_counter(), 0.0
        for batch in itertools.islice(iterator, items):
            samples += count_of(batch)
        elapsed = time.perf_counter() - began
        spent = {pid: after - before[pid] for pid, after in processes.counters(pids).items()}
        contender.close(loader)
        per = 1000 / samples
        print(f"{contender.name}: {samples / elapsed:.1f} samples/s")
        for pid, cost in spent.items():
            role = "main" if pid == me else f"process {pid}"
            print(
                f"  {role:>16}: CPU {cost.cpu_s * per:6.2f} s, switches "
                f"{cost.voluntary_switches * per:7.0f} + {cost.involuntary_switches * per:6.0f}, "
                f"minor faults {cost.minor_faults * per:7.0f}, threads {cost.threads}"
            )
    return 0


def main() -> int:
    global _count
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["llm", "vision"], required=True)
    parser.add_argument("--samples", type=int, default=None, help="data size (as the bench)")
    parser.add_argument("--items", type=int, default=None, help="batches profiled")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument(
        "--in-loader",
        action="store_true",
        help="run the bench's loaders (2 workers) and count each process's CPU, context "
        "switches and page faults per 1,000 samples",
    )
    args = parser.parse_args()
    size = args.samples or (200_000 if args.workload == "llm" else 20_000)
    folder = ensure_data(args.cache, args.workload, size)
    if args.in_loader:
        return _in_loader(args.workload, folder, args.items or 1000)
    torch.set_num_threads(1)  # as in a loader worker
    from energy_loader import SavableDataLoader

    if args.workload == "llm":
        items = args.items or 100
        _count = llm.count
        tokenize = llm.Tokenize(llm.tokenizer_path(folder))
        plain = llm.PlainDocs(folder)
        docs = [text for group in plain.shard(0)[:2] for text in plain.texts(group)]
        began = time.process_time()
        tokens = sum(len(tokenize({"text": text})) for text in docs)
        work = (time.process_time() - began) / (tokens / llm.SEQ_LEN)
        ours: Any = SavableDataLoader(llm.llm_pipeline(folder), num_workers=0)
        theirs: Any = torch.utils.data.DataLoader(plain, batch_size=llm.BATCH)
        unit = "sequence of 2,048 real tokens"
    else:
        items = args.items or 20
        _count = vision.count
        import webdataset as wds

        raw = wds.WebDataset(vision.tar_shards(folder)[:1], shardshuffle=False)
        samples = list(itertools.islice(raw, 300))
        began = time.process_time()
        for sample in samples:
            vision.decode_and_augment(sample)
        work = (time.process_time() - began) / len(samples)
        ours = SavableDataLoader(vision.vision_pipeline(folder), num_workers=0)
        theirs = torch.utils.data.DataLoader(vision.wds_dataset(folder), batch_size=vision.BATCH)
        unit = "image"
    print(f"{args.workload}: per-sample work alone {work * 1000:.3f} ms CPU per {unit}")
    for name, iterable in (("energy_loader", ours), ("plain", theirs)):
        total, buckets, count = _profile(iterable, items)
        per = total / count
        print(
            f"{name:>14}: {per * 1000:.3f} ms CPU per {unit} in one process "
            f"({per / work:.2f}x the work alone); by the functions' own time:"
        )
        spent = sum(buckets.values())
        for bucket, seconds in sorted(buckets.items(), key=lambda kv: -kv[1]):
            print(f"{'':>16}{bucket:<26}{seconds / spent:>7.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
