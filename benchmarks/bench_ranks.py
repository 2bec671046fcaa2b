"""Many ranks on one machine: what saving and restoring the loader costs each rank, measured.

For each N (default 4, 8, 16, 32, 48) the harness starts N real processes in a gloo process
group on 127.0.0.1 (``tests/distributed_helpers.launch``), runs a tiny reference-like pipeline
(IndexedSource -> map -> shuffle buffer 8 -> batch 4, no workers, so the machine holds 72
ranks) with ``num_partitions`` P = 288 (N, 3N/4 and 3N/2 all divide it for every default N),
takes a few steps and saves through every path: per-rank files, the gather to one file, and
DCP. Fresh processes then restore on N, 3N/4 and 3N/2 ranks through per-rank files, the full
list, the scatter and DCP. Recorded per rank: bytes written and read (a counting
``StorageWriter``/``StorageReader`` for DCP, also its ``.metadata`` alone; the sizes of the
files a rank read, and how many, for per-rank files; the file's size for the gathered list),
wall time of each save and restore, peak RSS, and whether the job's stream continues exactly
(the restored ranks' batches, interleaved, against the saving job's next batches).

``--partitions`` takes several counts (a sweep in P at fixed N: DCP's ``.metadata`` grows with
P); ``--merge`` adds the runs of earlier ``--out`` files to the tables, the fit and the plot;
``--fit`` fits each per-rank cost to ``a + b*N + c*P`` (or ``c*P/N``) over every run;
``--reference`` measures, in one process, the state of the documented reference pipeline
(60,000 samples, shuffle buffer 1,000, batch 32, 2 workers) that the model in
docs/distributed.md scales. Example::

    python benchmarks/bench_ranks.py --ranks 4 8 --out /tmp/ranks.json
    python benchmarks/bench_ranks.py --ranks 16 32 --merge /tmp/ranks.json --out /tmp/all.json \
        --fit --plot docs/bench-ranks.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

WAYS = ("files", "full_list", "scatter", "dcp", "dcp_shared")


def _job_stream(streams: list[list[Any]]) -> list[Any]:
    return [stream[step] for step in range(len(streams[0])) for stream in streams]


def measure(n: int, partitions: int, length: int, steps: int) -> dict[str, Any]:
    """Save on ``n`` ranks, restore on n, 3n/4 and 3n/2; every rank's numbers."""
    import torch

    from tests import distributed_helpers as dh

    out: dict[str, Any] = {"n": n, "p": partitions, "length": length}
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
        # What a rank of each resized layout reads from its own file, had the job saved there:
        # the baseline of a resized file restore (the same number of partitions per rank).
        for size in sorted({3 * n // 4, 3 * n // 2} - {n}):
            own = workdir / f"own_{size}"
            own.mkdir()
            shape = {"partitions": partitions, "length": length}
            dh.launch(dh.scale_save, size, own, timeout=600, **shape, steps=5, more=steps)
            dh.launch(
                dh.scale_restore, size, own, timeout=600, **shape, steps=steps, ways=("files",)
            )
            out[f"own_{size}"] = [
                json.loads((own / f"scale_restore_rank{r}.json").read_text())["files"]["read"]
                for r in range(size)
            ]
    return out


def _kb(values: list[float]) -> str:
    return f"{statistics.median(values) / 1e3:.1f}/{max(values) / 1e3:.1f}"


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f}/{max(values) * 1e3:.0f}"


def _restore_sizes(result: dict[str, Any]) -> list[int]:
    return sorted(int(k[8:]) for k in result if k.startswith("restore_"))


def tables(results: list[dict[str, Any]]) -> list[str]:
    """Two markdown tables, median/max over ranks: what each rank wrote and how long its save
    took; what each rank read on restore and how long the restore took."""
    lines = [
        "| N | P | per-rank files | gather (file on rank 0) | DCP (max: with `.metadata`) "
        "| peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        save = result["save"]
        cells = []
        for way in ("files", "gather", "dcp"):
            written = [r[way]["written"] for r in save]
            shown = f"{max(written) / 1e3:.1f}" if way == "gather" else _kb(written)
            cells.append(f"{shown} KB, {_ms([r[way]['seconds'] for r in save])} ms")
        rss = max(r["rss"] for r in save) / 2**20
        lines.append(
            f"| {result['n']} | {result['p']} | " + " | ".join(cells) + f" | {rss:.0f} MiB |"
        )
    lines += [
        "",
        "| N | P | restore on | per-rank files (files read; max x same layout: saved, own) "
        "| full list "
        "| scatter (rank 0 reads) | DCP (`.metadata`) | DCP, shared `.metadata` | peak RSS "
        "| exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        same = statistics.median(
            r["files"]["read"] for r in result[f"restore_{result['n']}"]["ranks"]
        )
        for size in _restore_sizes(result):
            ranks, exact = result[f"restore_{size}"]["ranks"], result[f"restore_{size}"]["exact"]
            cells = []
            for way in WAYS:
                if way not in ranks[0]:  # a run from before this way was measured
                    cells.append("-")
                    continue
                cell = (
                    f"{_kb([r[way]['read'] for r in ranks])} KB, "
                    f"{_ms([r[way]['seconds'] for r in ranks])} ms"
                )
                if way == "files" and "files" in ranks[0][way]:
                    counts = [r[way]["files"] for r in ranks]
                    most = max(r[way]["read"] for r in ranks)
                    own = result.get(f"own_{size}")
                    versus = f", x{most / statistics.median(own):.2f} own" if own else ""
                    cell += f" ({min(counts)}-{max(counts)}; x{most / same:.2f} saved{versus})"
                if way == "dcp" and "metadata" in ranks[0][way]:
                    cell += f" ({ranks[0][way]['metadata'] / 1e3:.1f} KB)"
                cells.append(cell)
            rss = max(r["rss"] for r in ranks) / 2**20
            ok = (
                "yes"
                if all(exact.values())
                else "NO: " + ", ".join(w for w in WAYS if w in exact and not exact[w])
            )
            lines.append(
                f"| {result['n']} | {result['p']} | {size} | "
                + " | ".join(cells)
                + f" | {rss:.0f} MiB | {ok} |"
            )
    return lines


# What each quantity is fitted against: per-rank costs are a + b*N + c*P, or a + b*N + c*P/N
# for what a rank holds (its P/N partitions). A partition's state grows with the digits of the
# sample indices it buffers, so the sizes of states are fitted over the runs of one dataset
# length (the most common); DCP's .metadata (one entry per partition, whatever its value) and
# the times over every run.
FITS: dict[str, tuple[str, ...]] = {
    "file written per rank": ("1", "N", "P/N"),
    "gathered file": ("1", "N", "P"),
    "DCP .metadata": ("1", "N", "P"),
    "DCP data per rank": ("1", "N", "P/N"),
    "files save s": ("1", "N", "P/N"),
    "gather save s (rank 0)": ("1", "N", "P"),
    "DCP save s": ("1", "N", "P"),
}
STATE_SIZES = ("file written per rank", "gathered file", "DCP data per rank")


def _observations(results: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, float]]]:
    """Per quantity, (N, P, value) for every run it is fitted over: medians over ranks."""
    points: dict[str, list[tuple[int, int, float]]] = {name: [] for name in FITS}
    length = statistics.mode(r["length"] for r in results)
    median = statistics.median
    for result in results:
        n, p, save = result["n"], result["p"], result["save"]
        same = result[f"restore_{n}"]["ranks"]
        values = {
            "file written per rank": median(r["files"]["written"] for r in save),
            "gathered file": save[0]["gather"]["written"],
            "files save s": median(r["files"]["seconds"] for r in save),
            "gather save s (rank 0)": save[0]["gather"]["seconds"],
            "DCP save s": median(r["dcp"]["seconds"] for r in save),
        }
        if "metadata" in same[0]["dcp"]:
            values["DCP .metadata"] = same[0]["dcp"]["metadata"]
            values["DCP data per rank"] = median(
                r["dcp"]["read"] - r["dcp"]["metadata"] for r in same
            )
        for name, value in values.items():
            if name not in STATE_SIZES or result["length"] == length:
                points[name].append((n, p, value))
    return points


def fit(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Least-squares coefficients per quantity over its runs; a term the runs do not vary
    independently of the others (P when every run had the same P) is left out."""
    import numpy as np

    columns = {
        "1": lambda n, p: 1.0,
        "N": lambda n, p: float(n),
        "P": lambda n, p: float(p),
        "P/N": lambda n, p: p / n,
    }
    coefficients = {}
    for name, points in _observations(results).items():
        terms: list[str] = []
        for term in FITS[name]:
            trial = np.array([[columns[t](n, p) for t in [*terms, term]] for n, p, _ in points])
            if len(points) > len(terms) + 1 and np.linalg.matrix_rank(trial) == len(terms) + 1:
                terms.append(term)
        if not terms:
            continue
        matrix = np.array([[columns[t](n, p) for t in terms] for n, p, _ in points], float)
        values = np.array([v for _, _, v in points], float)
        solution, *_ = np.linalg.lstsq(matrix, values, rcond=None)
        residual = float(np.max(np.abs(matrix @ solution - values)))
        coefficients[name] = {**dict(zip(terms, map(float, solution))), "max_residual": residual}
    return coefficients


def _members(path: Path) -> dict[str, int]:
    """The sizes of a rank file's members (its header, the config, the partitions)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return {info.filename: info.file_size for info in archive.infolist()}


def _resized_file_reads(samples: int, folder: Path) -> dict[str, Any]:
    """Bytes a rank reads from per-rank files of the reference pipeline (2 partitions a rank,
    every shuffle buffer full) saved on 4 ranks: restored on 4 (its own file), 2 and 8.
    The ranks are simulated in this process, without workers (a partition's state is the
    same whoever runs it)."""
    import energy_loader as el
    from energy_loader import distributed as eld
    from energy_loader.cli.bench import savable_pipeline
    from energy_loader.state.rank_file import ReadTally

    saved, partitions = 4, 8

    def loader(rank: int, world_size: int) -> Any:
        config = el.WorkerConfig(rank=rank, world_size=world_size, num_workers=0)
        return el.SavableDataLoader(
            savable_pipeline(samples), worker_config=config, num_partitions=partitions
        )

    for rank in range(saved):
        running = loader(rank, saved)
        iterator = iter(running)
        for _ in range(samples // 32 // 4 // saved):  # a quarter epoch: every buffer full
            next(iterator)
        eld.save_state_rank_file(running, folder)
    out: dict[str, Any] = {"saved_on": saved, "partitions": partitions}
    for world_size in (saved, 2, 8):
        reads = []
        for rank in range(world_size):
            tally = ReadTally()
            eld.read_rank_state_files(loader(rank, world_size), folder, tally=tally)
            reads.append({"bytes": tally.bytes, "files": tally.files})
        out[f"on_{world_size}"] = reads
    return out


def reference_state(samples: int) -> dict[str, Any]:
    """The reference pipeline's state at one rank, in this process: per-rank file, DCP entries,
    pickled size, and the gathering rank's CPU per state (decode and re-encode)."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    import energy_loader as el
    from energy_loader import distributed as eld
    from energy_loader.cli.bench import PREFETCH, WORKERS, savable_pipeline
    from energy_loader.testing.storage import CountingWriter

    out: dict[str, Any] = {"samples": samples, "workers": WORKERS}
    loader = el.SavableDataLoader(
        savable_pipeline(samples), num_workers=WORKERS, prefetch_factor=PREFETCH
    )
    iterator = iter(loader)
    for _ in range(samples // 32 // 4):  # a quarter epoch: every shuffle buffer full
        next(iterator)
    state = loader.save_state_rank()
    leaves = loader.state_dict()
    out["partitions"] = len(leaves)
    out["leaf_chars"] = [len(v) for v in leaves.values()]
    pickled = pickle.dumps(state)
    out["pickled"] = len(pickled)
    out["json"] = len(json.dumps(state))
    with tempfile.TemporaryDirectory() as folder:
        times = []
        for attempt in range(20):
            began = time.perf_counter()
            path = eld.save_state_rank_file(loader, Path(folder) / f"files{attempt}")
            times.append(time.perf_counter() - began)
        out["file"] = path.stat().st_size
        out["file_save_s"] = statistics.median(times)
        times = []
        for attempt in range(20):
            fresh = el.SavableDataLoader(
                savable_pipeline(samples), num_workers=WORKERS, prefetch_factor=PREFETCH
            )
            began = time.perf_counter()
            eld.restore_state_rank_file(fresh, Path(folder) / f"files{attempt}")
            times.append(time.perf_counter() - began)
        out["file_restore_s"] = statistics.median(times)
        out["file_members"] = _members(path)
        out["files_resized"] = _resized_file_reads(samples, Path(folder) / "resized")
        times, writer = [], None
        for attempt in range(5):
            writer = CountingWriter(Path(folder) / f"dcp{attempt}")
            began = time.perf_counter()
            dcp.save({"loader": loader}, storage_writer=writer, no_dist=True)
            times.append(time.perf_counter() - began)
        assert writer is not None
        out["dcp_data"] = writer.data_bytes
        out["dcp_metadata"] = writer.metadata_bytes
        out["dcp_save_s"] = statistics.median(times)
        # DCP at P entries in one process: plan, dedup, the .metadata and the data, with one
        # partition's leaf per entry ("leaf") or a 2-byte one ("tiny": the per-entry work
        # without the bytes, what the coordinator of a P-partition job does serially).
        leaf = next(iter(leaves.values()))
        for kind, value in (("leaf", leaf), ("tiny", "{}")):
            for count in (1024, 4096, 16384):
                entries = {f"slot_{i:05d}": value for i in range(count)}
                writer = CountingWriter(Path(folder) / f"entries{count}")
                began = time.perf_counter()
                dcp.save({"loader": entries}, storage_writer=writer, no_dist=True)
                out[f"dcp_{kind}_{count}"] = {
                    "seconds": time.perf_counter() - began,
                    "metadata": writer.metadata_bytes,
                    "data": writer.data_bytes,
                }
                shutil.rmtree(Path(folder) / f"entries{count}")
        # The gathering rank, per state: unpickle what gather_object delivers, write the list;
        # a full-list restore reads it back. Median of three.
        for count in (256, 1024, 4096):
            runs = []
            for _ in range(3):
                began = time.perf_counter()
                states = [pickle.loads(pickled) for _ in range(count)]
                unpickled = time.perf_counter() - began
                began = time.perf_counter()
                torch.save(states, Path(folder) / "gathered.pt")
                written = time.perf_counter() - began
                del states
                began = time.perf_counter()
                torch.load(Path(folder) / "gathered.pt", weights_only=True)
                runs.append((unpickled, written, time.perf_counter() - began))
            out[f"gather_{count}"] = {
                "unpickle_s": statistics.median(r[0] for r in runs),
                "torch_save_s": statistics.median(r[1] for r in runs),
                "torch_load_s": statistics.median(r[2] for r in runs),
                "bytes": (Path(folder) / "gathered.pt").stat().st_size,
            }
    loader.close()
    return out


def _one_two_five(value: float, _: Any) -> str:
    """A log axis' label at 1, 2 and 5 times a power of ten only."""
    digits = f"{value:.0e}"[0]
    return f"{value:g}" if digits in "125" else ""


def _local_plans(n: int, workers: int) -> list[Any]:
    """N ranks' local save plans of ``workers`` loader leaves each, as DCP makes them."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    plans = []
    for rank in range(n):
        planner = DefaultSavePlanner()
        leaves = {f"slot_{rank * workers + i:05d}": "{}" for i in range(workers)}
        planner.set_up_planner({"loader": leaves}, storage_meta=None, is_coordinator=False)
        plans.append(planner.create_local_plan())
    return plans


def _global_plan(planner_class: type, plans: list[Any], *, caching: bool) -> tuple[Any, float]:
    """One coordinator's ``create_global_plan`` over ``plans``: (plan and metadata, seconds)."""
    coordinator = planner_class(enable_plan_caching=caching)
    coordinator.set_up_planner({"loader": {}}, storage_meta=None, is_coordinator=True)
    began = time.perf_counter()
    result = coordinator.create_global_plan(plans)
    return result, time.perf_counter() - began


def _forget_cached_plans() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in (
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
        SavePlanner._cached_save_plan,
        SavePlanner._cached_final_save_plan,
    ):
        cache.clear()


def dcp_coordinator(
    ranks: list[int], workers: int = 2, changed_up_to: int = 4096
) -> dict[str, Any]:
    """DCP's serial step on the coordinator of a save, in this process: ``create_global_plan``
    over N ranks' local plans of ``workers`` loader leaves each (P = N x workers), with torch's
    ``DefaultSavePlanner`` and ``energy_loader.dcp.SavePlanner`` (the two plans and metadata
    must be equal, key order included), and every rank's ``pickle.loads`` of the ``.metadata``.

    With ``enable_plan_caching=True``, a second save whose local plans did not change sends
    torch's "unchanged" plans (``SavePlan([], usable=False)``) and the coordinator reuses the
    cached global plan; a save where one rank's plan changed plans over every rank again
    (timed for torch up to ``changed_up_to`` ranks only: it costs what a first save costs).
    Our planner's time is also split into torch's steps it keeps (dedup, metadata, validation)
    and the merge of the key mappings it replaces.
    """
    import pickle

    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import (
        DefaultSavePlanner,
        _validate_global_plan,
        create_default_global_save_plan,
    )
    from torch.distributed.checkpoint.planner import SavePlan

    from energy_loader.dcp import SavePlanner, first_map_wins

    out: dict[str, Any] = {}
    for n in ranks:
        plans = _local_plans(n, workers)
        row: dict[str, Any] = {"partitions": n * workers}
        results = {}
        for name, planner_class in (("torch", DefaultSavePlanner), ("ours", SavePlanner)):
            # Torch's once (116 s at 16,384 ranks); ours the median of three (a garbage
            # collection in one run is as long as the whole plan).
            runs = [
                _global_plan(planner_class, plans, caching=False)
                for _ in range(3 if name == "ours" else 1)
            ]
            results[name] = runs[0][0]
            row[f"{name}_s"] = statistics.median(seconds for _, seconds in runs)
            # Caching: a first save fills the cache (the same work as above, not repeated
            # here), a second with unchanged plans reuses it, one changed plan replans.
            _forget_cached_plans()
            key = planner_class.__name__
            global_plan, metadata = results[name]
            SavePlanner._cached_all_plans[key] = plans
            SavePlanner._cached_global_plan[key] = global_plan
            SavePlanner._cached_metadata[key] = metadata
            unchanged = [SavePlan([], usable=False)] * n
            (_, cached_metadata), row[f"{name}_cached_unchanged_s"] = _global_plan(
                planner_class, unchanged, caching=True
            )
            if cached_metadata is not metadata:
                raise AssertionError(f"{name}: an unchanged second save did not reuse the plan")
            if name == "ours" or n <= changed_up_to:
                one_changed = [plans[0], *unchanged[1:]]
                (_, replanned), row[f"{name}_cached_one_changed_s"] = _global_plan(
                    planner_class, one_changed, caching=True
                )
                if replanned != metadata:
                    raise AssertionError(f"{name}: the replanned metadata differs")
            _forget_cached_plans()
        (torch_plan, torch_md), (our_plan, our_md) = results["torch"], results["ours"]
        if torch_plan != our_plan or torch_md != our_md:
            raise AssertionError(f"N = {n}: the two planners' global plans or metadata differ")
        if list(torch_md.planner_data) != list(our_md.planner_data):
            raise AssertionError(f"N = {n}: the metadata's planner_data keys come in another order")
        row["equal"] = True
        # Our planner's time by step: torch's dedup, metadata and validation, and our merge.
        began = time.perf_counter()
        deduped = dedup_save_plans(plans)
        row["dedup_s"] = time.perf_counter() - began
        began = time.perf_counter()
        global_plan, metadata = create_default_global_save_plan(deduped)
        row["metadata_s"] = time.perf_counter() - began
        began = time.perf_counter()
        _validate_global_plan(global_plan, metadata)
        row["validate_s"] = time.perf_counter() - began
        began = time.perf_counter()
        first_map_wins([plan.planner_data for plan in plans])
        row["merge_s"] = time.perf_counter() - began
        pickled = pickle.dumps(our_md)
        began = time.perf_counter()
        pickle.loads(pickled)
        row["metadata_loads_s"] = time.perf_counter() - began
        row["metadata_pickled_bytes"] = len(pickled)
        out[str(n)] = row
        print(n, row, flush=True)
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Left: median per-rank bytes read against N, same layout (solid) and resized (dashed,
    dotted). Right: save time (median over ranks; the gather's on rank 0) and same-layout
    restore time against N. The runs of the most common P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter, ScalarFormatter

    partitions = statistics.mode(r["p"] for r in results)
    results = sorted((r for r in results if r["p"] == partitions), key=lambda r: r["n"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5.6))
    ns = [r["n"] for r in results]
    colours = {
        "files": "C0",
        "full_list": "C1",
        "scatter": "C2",
        "dcp": "C3",
        "gather": "C4",
        "dcp_shared": "C5",
    }
    # The scatter's rank 0 reads what every full-list rank reads, the others nothing; with the
    # shared .metadata, DCP's rank 0 reads what a DCP rank reads, the others their leaves.
    labels = {
        "files": "files",
        "full_list": "full list (= scatter's rank 0)",
        "dcp": "DCP",
        "dcp_shared": "DCP, shared .metadata (not rank 0)",
    }
    for way, label in labels.items():
        for layout, size_of, style in (
            ("same layout", lambda n: n, "-"),
            ("on 3N/4", lambda n: 3 * n // 4, "--"),
            ("on 3N/2", lambda n: 3 * n // 2, ":"),
        ):
            values = [
                statistics.median(x[way]["read"] for x in r[f"restore_{size_of(r['n'])}"]["ranks"])
                / 1e3
                for r in results
            ]
            left.plot(ns, values, style, color=colours[way], marker="o", label=f"{label}, {layout}")
    left.set_ylabel("bytes read per rank on restore, median (KB)")
    left.set_title(f"Loader state read per rank on restore (P = {partitions})")
    for way in ("files", "gather", "dcp"):
        if way == "gather":
            values = [r["save"][0][way]["seconds"] * 1e3 for r in results]
        else:
            values = [
                statistics.median(x[way]["seconds"] for x in r["save"]) * 1e3 for r in results
            ]
        right.plot(ns, values, "-", color=colours[way], marker="o", label=f"save: {way}")
    for way in WAYS:
        values = [
            statistics.median(x[way]["seconds"] for x in r[f"restore_{r['n']}"]["ranks"]) * 1e3
            for r in results
        ]
        right.plot(ns, values, "--", color=colours[way], marker="s", label=f"restore: {way}")
    right.set_ylabel("wall time, median over ranks (ms; gather: rank 0)")
    right.set_title("Save and same-layout restore time (2 cores for all ranks)")
    for axis in (left, right):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(ns)
        axis.set_xlabel("ranks N (saved on N)")
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(NullFormatter())
        for formatter in (axis.yaxis.set_major_formatter, axis.yaxis.set_minor_formatter):
            formatter(FuncFormatter(_one_two_five))
        axis.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
        axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[4, 8, 16, 32, 48])
    parser.add_argument("--partitions", type=int, nargs="+", default=[288])
    parser.add_argument(
        "--per-rank", type=int, help="P = this x N instead of --partitions (a multiple of 3)"
    )
    parser.add_argument("--length", type=int, help="samples (default 40 per partition)")
    parser.add_argument("--steps", type=int, default=3, help="batches compared after restore")
    parser.add_argument("--merge", type=Path, nargs="*", default=[], help="earlier --out files")
    parser.add_argument("--out", type=Path, help="write every rank's numbers as JSON")
    parser.add_argument("--plot", type=Path, help="write the plot (needs matplotlib)")
    parser.add_argument("--fit", action="store_true", help="fit the per-rank costs to N and P")
    parser.add_argument("--reference", type=Path, help="measure the reference state to this JSON")
    parser.add_argument(
        "--coordinator",
        type=int,
        nargs="*",
        help="with --reference: time only DCP's global save plan, over these numbers of ranks "
        "(torch's planner and energy_loader.dcp.SavePlanner, caching off and on)",
    )
    args = parser.parse_args()
    if args.reference:
        reference = reference_state(60_000) if args.coordinator is None else {}
        if args.coordinator:
            reference["dcp_coordinator"] = dcp_coordinator(args.coordinator)
        args.reference.write_text(json.dumps(reference, indent=1))
        print(args.reference.read_text())
    results = []
    for merged in args.merge:
        for result in json.loads(merged.read_text()):
            result.setdefault("p", 144)  # runs from before the P sweep
            result.setdefault("length", 40 * 144)
            results.append(result)
    for n in args.ranks:
        for partitions in [args.per_rank * n] if args.per_rank else args.partitions:
            if any(size == 0 or partitions % size for size in (n, 3 * n // 4, 3 * n // 2)):
                parser.error(f"N = {n}, 3N/4 and 3N/2 must all divide P = {partitions}")
            length = args.length or 40 * partitions
            result = measure(n, partitions, length, args.steps)
            results.append(result)
            print("\n".join(tables([result])), flush=True)
            if args.out:
                args.out.write_text(json.dumps(results))
    results.sort(key=lambda r: (r["p"], r["n"]))
    if results:
        print("\n".join(tables(results)))
    if args.fit:
        for name, terms in fit(results).items():
            print(name, {t: round(v, 6) for t, v in terms.items()})
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
