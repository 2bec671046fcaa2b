"""Reading the data people already have: WebDatasetSource vs webdataset's own pipeline and
ParquetSource vs pyarrow's ``iter_batches``, on the same files, 2 workers, batches of 64.

The Parquet files hold more rows than the tars hold samples (``--rows``, default 8x): a row is
~15x cheaper to read than a tar sample, and an epoch that is over in a quarter of a second
measures worker start-up more than reading. Time to the first batch is reported on its own.

Each contender runs in a fresh subprocess; the repetitions are interleaved (every contender
once per repetition, in a rotating order) and the ratios are taken within a repetition, so
machine noise that lasts longer than one repetition cancels out. Our side saves its state
every 50 batches (what a training loop that checkpoints does) and keeps exact resume.

Both sides are CPU-bound on a small machine, so a second table gives, for the Parquet
contenders, the epoch's loop alone (from ``iter()``, the source already built): its wall
time and the CPU of the main process and of the workers.

    python benchmarks/bench_sources.py [--repetitions 7] [--samples 24000] [--rows 192000]
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.utils.data

BATCH = 64
WORKERS = 2
SAVE_EVERY = 50

CONTENDERS = {
    "wds: webdataset.WebDataset + DataLoader": "wds_peer",
    "wds: WebDatasetSource": "wds_ours",
    "wds: WebDatasetSource, shuffle": "wds_ours_shuffled",
    "parquet: pyarrow iter_batches + DataLoader": "pq_peer",
    "parquet: ParquetSource": "pq_ours",
    "parquet: ParquetSource, shuffle": "pq_ours_shuffled",
}
PAIRS = [
    ("wds_peer", "wds_ours"),
    ("wds_peer", "wds_ours_shuffled"),
    ("pq_peer", "pq_ours"),
    ("pq_peer", "pq_ours_shuffled"),
]


def make_data(root: Path, samples: int, rows_total: int) -> None:
    """Tar shards (json + 1 KiB bin per sample) and Parquet files (4 columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "wds").mkdir()
    (root / "pq").mkdir()
    shards, files = 8, 4
    per_shard = samples // shards
    for shard in range(shards):
        with tarfile.open(root / "wds" / f"shard-{shard:03d}.tar", "w") as archive:
            for i in range(shard * per_shard, (shard + 1) * per_shard):
                for extension, data in (
                    ("json", json.dumps({"i": i, "text": f"sample {i}"}).encode()),
                    ("bin", bytes([i % 256]) * 1024),
                ):
                    info = tarfile.TarInfo(f"{i:08d}.{extension}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
    per_file = rows_total // files
    for number in range(files):
        rows = range(number * per_file, (number + 1) * per_file)
        table = pa.table(
            {
                "i": list(rows),
                "text": [f"sample {i}" for i in rows],
                "tokens": [list(range(i % 50, i % 50 + 32)) for i in rows],
                "score": [i / 7 for i in rows],
            }
        )
        pq.write_table(table, root / "pq" / f"part-{number}.parquet", row_group_size=1000)
    from energy_loader.cli.index import index_shards

    index_shards(str(root / "wds"), progress=False)


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


class _ParquetPeer(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The plain pipeline: each torch worker streams its files with ``iter_batches``."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __iter__(self) -> Any:
        import pyarrow.parquet as pq

        info = torch.utils.data.get_worker_info()
        mine = self.files if info is None else self.files[info.id :: info.num_workers]
        for path in mine:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1000):
                yield from batch.to_pylist()


def run(name: str, root: Path) -> dict[str, float]:
    """One contender, one epoch: samples per second, seconds to the first batch, and the
    loop's wall time, main-process CPU and worker CPU."""
    import energy_loader as el

    wds_dir, pq_dir = root / "wds", root / "pq"
    start = time.perf_counter()
    first = 0.0
    count = 0
    loop: list[float] = []  # wall clock and process CPU when the loop starts

    def looping() -> None:
        loop.extend((time.perf_counter(), time.process_time()))

    if name == "wds_peer":
        import webdataset as wds

        urls = [str(p) for p in sorted(wds_dir.glob("*.tar"))]
        dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode()
        loader: Any = torch.utils.data.DataLoader(
            dataset, batch_size=BATCH, num_workers=WORKERS, collate_fn=_as_list
        )
        looping()
        for batch in loader:
            first = first or time.perf_counter() - start
            count += len(batch)
    elif name == "pq_peer":
        files = [str(p) for p in sorted(pq_dir.glob("*.parquet"))]
        loader = torch.utils.data.DataLoader(
            _ParquetPeer(files), batch_size=BATCH, num_workers=WORKERS, collate_fn=_as_list
        )
        looping()
        for batch in loader:
            first = first or time.perf_counter() - start
            count += len(batch)
    else:
        shuffle = name.endswith("shuffled")
        if name.startswith("wds"):
            source: el.SavableDataset = el.WebDatasetSource(wds_dir, shuffle=shuffle, seed=1)
        else:
            source = el.ParquetSource(pq_dir, shuffle=shuffle, seed=1)
        loader = el.SavableDataLoader(source.batch(BATCH, collate_fn=_as_list), num_workers=WORKERS)
        looping()
        for step, batch in enumerate(loader):
            first = first or time.perf_counter() - start
            count += len(batch)
            if step % SAVE_EVERY == 0:
                loader.save_state_rank()
    end = time.perf_counter()
    loop_wall, main_cpu = end - loop[0], time.process_time() - loop[1]
    if isinstance(loader, el.SavableDataLoader):
        loader.close()
    del loader  # torch's workers stopped at the epoch's end; ours now: count their CPU
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "rate": count / (end - start),
        "first": first,
        "loop_wall": loop_wall,
        "main_cpu": main_cpu,
        "worker_cpu": children.ru_utime + children.ru_stime,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--samples", type=int, default=24000, help="tar samples")
    parser.add_argument("--rows", type=int, default=192000, help="Parquet rows")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run(args.run, Path(args.root))))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-sources-") as directory:
        root = Path(directory)
        make_data(root, args.samples, args.rows)
        names = list(CONTENDERS.values())
        results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for repetition in range(args.repetitions):
            shift = repetition % len(names)
            for name in names[shift:] + names[:shift]:
                output = subprocess.run(
                    [sys.executable, __file__, "--run", name, "--root", str(root)],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                results[name].append(json.loads(output.splitlines()[-1]))
            print(f"repetition {repetition + 1}/{args.repetitions} done", file=sys.stderr)
    rates = {name: [r["rate"] for r in results[name]] for name in names}
    firsts = {name: [r["first"] for r in results[name]] for name in names}
    print(f"\n{args.samples} tar samples, {args.rows} Parquet rows, {WORKERS} workers, ")
    print(f"batches of {BATCH}, median of {args.repetitions} interleaved repetitions\n")
    print("| contender | samples/s (median) | first batch (median) |")
    print("|---|---:|---:|")
    for label, name in CONTENDERS.items():
        print(
            f"| {label} | {statistics.median(rates[name]):,.0f} | "
            f"{statistics.median(firsts[name]) * 1000:.0f} ms |"
        )
    print("\n| ratio (per repetition, then median) | median | min | max |")
    print("|---|---:|---:|---:|")
    for peer, ours in PAIRS:
        ratios = [a / b for a, b in zip(rates[ours], rates[peer])]
        print(
            f"| {ours} / {peer} | {statistics.median(ratios):.2f}x | {min(ratios):.2f}x | "
            f"{max(ratios):.2f}x |"
        )
    print("\n| one epoch's loop (median) | wall | main process CPU | worker CPU | total CPU |")
    print("|---|---:|---:|---:|---:|")
    for label, name in CONTENDERS.items():
        if name.startswith("pq"):
            runs = results[name]
            cells = [
                statistics.median(r[field] for r in runs)
                for field in ("loop_wall", "main_cpu", "worker_cpu")
            ]
            total = statistics.median(r["main_cpu"] + r["worker_cpu"] for r in runs)
            print(f"| {label} | " + " | ".join(f"{v:.2f} s" for v in (*cells, total)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
