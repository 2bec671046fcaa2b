"""Many ranks on one machine: what saving and restoring the loader costs each rank, measured.

For each N (default 4, 8, 16, 32, 48) the harness starts N real processes in a gloo process
group on 127.0.0.1 (``tests/distributed_helpers.launch``), runs a tiny reference-like pipeline
(IndexedSource -> map -> shuffle buffer 8 -> batch 4, no workers, so the machine holds 48
ranks) with ``num_partitions`` P = 144 (N, 3N/4 and 3N/2 all divide it), takes a few steps and
saves through every path: per-rank files, the gather to one file, and DCP. Fresh processes then
restore on N, 3N/4 and 3N/2 ranks through per-rank files, the full list, the scatter and DCP.
Recorded per rank: bytes written and read (a counting ``StorageWriter``/``StorageReader`` for
DCP, the process's read() bytes for files, the file's size for the gathered list), wall time of
each save and restore, peak RSS, and whether the job's stream continues exactly (the restored
ranks' batches, interleaved, against the saving job's next batches). Example::

    python benchmarks/bench_ranks.py --out /tmp/ranks.json --plot docs/bench-ranks.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

WAYS = ("files", "full_list", "scatter", "dcp")


def _job_stream(streams: list[list[Any]]) -> list[Any]:
    return [stream[step] for step in range(len(streams[0])) for stream in streams]


def measure(n: int, partitions: int, length: int, steps: int) -> dict[str, Any]:
    """Save on ``n`` ranks, restore on n, 3n/4 and 3n/2; every rank's numbers."""
    import torch

    from tests import distributed_helpers as dh

    out: dict[str, Any] = {"n": n}
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        began = time.perf_counter()
        dh.launch(
            dh.scale_save,
            n,
            workdir,
            timeout=600,
            partitions=partitions,
            length=length,
            steps=5,
            more=2 * steps,  # covers 3N/2 restored ranks x steps
        )
        out["save_launch_s"] = time.perf_counter() - began
        out["save"] = [
            json.loads((workdir / f"scale_save_rank{r}.json").read_text()) for r in range(n)
        ]
        saved = _job_stream(
            [torch.load(workdir / f"scale_saved{r}.pt", weights_only=True) for r in range(n)]
        )
        for size in sorted({n, 3 * n // 4, 3 * n // 2}):
            dh.launch(
                dh.scale_restore,
                size,
                workdir,
                timeout=600,
                partitions=partitions,
                length=length,
                steps=steps,
                ways=WAYS,
            )
            reports = [
                json.loads((workdir / f"scale_restore_rank{r}.json").read_text())
                for r in range(size)
            ]
            exact = {}
            for way in WAYS:
                resumed = _job_stream(
                    [
                        torch.load(workdir / f"scale_{way}{r}.pt", weights_only=True)
                        for r in range(size)
                    ]
                )
                exact[way] = resumed == saved[: len(resumed)]
            out[f"restore_{size}"] = {"ranks": reports, "exact": exact}
    return out


def summary(result: dict[str, Any]) -> list[str]:
    """Markdown rows: per N and restore size, the median / max per-rank read per path."""
    n = result["n"]
    rows = []
    save = result["save"]
    written = {w: statistics.median(r[w]["written"] for r in save) for w in ("files", "dcp")}
    seconds = {w: statistics.median(r[w]["seconds"] for r in save) for w in ("files", "dcp")}
    rows.append(
        f"| {n} | save | files {written['files'] / 1e3:.1f} KB, {seconds['files'] * 1e3:.0f} ms; "
        f"gather {save[0]['gather']['written'] / 1e3:.1f} KB on rank 0, "
        f"{statistics.median(r['gather']['seconds'] for r in save) * 1e3:.0f} ms; dcp "
        f"{written['dcp'] / 1e3:.1f} KB, {seconds['dcp'] * 1e3:.0f} ms | "
        f"{max(r['rss'] for r in save) / 2**20:.0f} MiB |"
    )
    for key in sorted((k for k in result if k.startswith("restore_")), key=lambda k: int(k[8:])):
        size = int(key[8:])
        ranks, exact = result[key]["ranks"], result[key]["exact"]
        cells = []
        for way in WAYS:
            reads = [r[way]["read"] for r in ranks]
            times = [r[way]["seconds"] for r in ranks]
            cells.append(
                f"{way} {statistics.median(reads) / 1e3:.1f}/{max(reads) / 1e3:.1f} KB "
                f"{statistics.median(times) * 1e3:.0f} ms{'' if exact[way] else ' NOT EXACT'}"
            )
        rss = max(r["rss"] for r in ranks) / 2**20
        rows.append(f"| {n} | restore on {size} | " + "; ".join(cells) + f" | {rss:.0f} MiB |")
    return rows


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Median per-rank bytes read against N, same layout (solid) and resized (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    ns = [r["n"] for r in results]
    for way, colour in zip(WAYS, ("C0", "C1", "C2", "C3")):
        for label, size_of, style in (
            ("same layout", lambda n: n, "-"),
            ("on 3N/4", lambda n: 3 * n // 4, "--"),
            ("on 3N/2", lambda n: 3 * n // 2, ":"),
        ):
            values = [
                statistics.median(x[way]["read"] for x in r[f"restore_{size_of(r['n'])}"]["ranks"])
                / 1e3
                for r in results
            ]
            axis.plot(ns, values, style, color=colour, marker="o", label=f"{way}, {label}")
    axis.set_xlabel("ranks N (saved on N, P = 144)")
    axis.set_ylabel("median bytes read per rank on restore (KB)")
    axis.set_yscale("log")
    axis.set_title("Loader state read per rank on restore")
    axis.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32, 48])
    parser.add_argument("--partitions", type=int, default=144)
    parser.add_argument("--length", type=int, default=144 * 40)
    parser.add_argument("--steps", type=int, default=3, help="batches compared after restore")
    parser.add_argument("--out", type=Path, help="write every rank's numbers as JSON")
    parser.add_argument("--plot", type=Path, help="write the plot (needs matplotlib)")
    args = parser.parse_args()
    results = []
    for n in args.ranks:
        result = measure(n, args.partitions, args.length, args.steps)
        results.append(result)
        print("\n".join(summary(result)), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
