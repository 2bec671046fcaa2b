"""The peers' own formats read by their own loaders and by ours, on the same files: MosaicML
Streaming (``StreamingDataset`` + ``StreamingDataLoader``) vs ``MDSSource``, litdata
(``StreamingDataset`` + ``StreamingDataLoader``) vs ``LitDataSource``, and a plain
``DataLoader`` over megatron-core's ``IndexedDataset`` vs ``MegatronIndexedSource``.

Same files (written by each peer's own writer: ``MDSWriter``, ``litdata.optimize``,
``IndexedDatasetBuilder``), same workers (2), batches of 64 samples as lists, one epoch in
order. Both sides save their loader's state every 50 batches where they can
(``state_dict()``; the plain DataLoader over Megatron's files has none). Each contender runs
in a fresh subprocess (a peer in its own venv: the peers conflict with this project's pins),
the repetitions are interleaved in a rotating order and the ratios taken within a repetition.
Besides samples/s: the CPU the epoch cost (main process and workers, per 1,000 samples: on a
loaded machine a steadier measure than wall time), the size of a state saved after 100 batches
(as JSON) and the time to restore it (a new loader, ``load_state_dict``, the first batch).

A sample: an LLM-style record, ``{"id": int, "text": str, "tokens": int32[256]}`` for MDS and
litdata, a document of 256 uint16 tokens for Megatron.

    python benchmarks/bench_peer_formats.py [--repetitions 5] [--samples 24000] \\
        [--mds-python V/bin/python] [--litdata-python ...] [--megatron-python ...]

The peers' interpreters default to ``.venv-peers/<mds|litdata|megatron>/bin/python``; each
needs its library (``streaming-community``, ``litdata``, ``megatron-core``) with torch from
``constraints.txt`` and this repository on ``PYTHONPATH``. A peer whose interpreter is missing is
skipped, with why. With ``--baseline-tree DIR`` (repeatable: another checkout of energy_loader,
such as the commit before a change) our readers run from that tree too, in the same loop, and
a last table gives each tree's samples/s and CPU against this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BATCH = 64
WORKERS = 2
SAVE_EVERY = 50
TOKENS = 256
REPOSITORY = Path(__file__).resolve().parent.parent

FORMATS = ("mds", "litdata", "megatron")
LABELS = {
    "mds_peer": "MDS: streaming StreamingDataset + StreamingDataLoader",
    "mds_ours": "MDS: MDSSource",
    "litdata_peer": "litdata: StreamingDataset + StreamingDataLoader",
    "litdata_ours": "litdata: LitDataSource",
    "megatron_peer": "Megatron: IndexedDataset + DataLoader",
    "megatron_ours": "Megatron: MegatronIndexedSource",
}


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


def _import_streaming() -> Any:
    """``import streaming`` imports torchvision, whose PyPI wheels are CUDA builds that do not
    load beside a CPU torch; the MDS reader and writer never use it. With no torchvision
    installed, stand-ins for the names streaming.vision imports let the library load."""
    import importlib.util
    import types

    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        import transformers  # noqa: F401  (imported first, it finds no torchvision)

        for name in (
            "torchvision",
            "torchvision.datasets",
            "torchvision.transforms",
            "torchvision.transforms.functional",
        ):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["torchvision.datasets"].VisionDataset = object  # type: ignore[attr-defined]
        sys.modules["torchvision.datasets"].CIFAR10 = object  # type: ignore[attr-defined]
        functional = sys.modules["torchvision.transforms.functional"]
        functional.to_tensor = None  # type: ignore[attr-defined]
    import streaming

    return streaming


def _records(count: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(count):
        yield {
            "id": i,
            "text": f"document {i}",
            "tokens": rng.integers(0, 50_000, TOKENS).astype(np.int32),
        }


def litdata_record(i: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(i)
    return {
        "id": i,
        "text": f"document {i}",
        "tokens": rng.integers(0, 50_000, TOKENS).astype(np.int32),
    }


def make(kind: str, root: Path, samples: int) -> None:
    """Write the files of one format with its own library (run in the peer's venv)."""
    if kind == "mds":
        streaming = _import_streaming()
        columns = {"id": "int", "text": "str", "tokens": "ndarray:int32"}
        with streaming.MDSWriter(out=str(root / "mds"), columns=columns, size_limit=1 << 22) as w:
            for record in _records(samples):
                w.write(record)
    elif kind == "litdata":
        from litdata import optimize

        optimize(
            fn=litdata_record,
            inputs=list(range(samples)),
            output_dir=str(root / "litdata"),
            chunk_bytes="4MB",
            num_workers=1,
        )
    else:
        import numpy as np
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        prefix = str(root / "megatron" / "corpus")
        (root / "megatron").mkdir()
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for record in _records(samples):
            builder.add_item(torch.from_numpy(record["tokens"].astype(np.uint16)))
            builder.end_document()
        builder.finalize(prefix + ".idx")


def _loader(name: str, root: Path) -> Any:
    import torch.utils.data

    kind, side = name.rsplit("_", 1)
    if side != "peer":
        import energy_loader as el

        source: Any
        if kind == "mds":
            source = el.MDSSource(root / "mds", cache_dir=root / "cache-ours")
        elif kind == "litdata":
            source = el.LitDataSource(root / "litdata")
        else:
            source = el.MegatronIndexedSource(root / "megatron" / "corpus")
        return el.SavableDataLoader(
            source, batch_size=BATCH, collate_fn=_as_list, num_workers=WORKERS
        )
    if kind == "mds":
        streaming = _import_streaming()
        dataset = streaming.StreamingDataset(local=str(root / "mds"), batch_size=BATCH)
        return streaming.StreamingDataLoader(
            dataset, batch_size=BATCH, collate_fn=_as_list, num_workers=WORKERS
        )
    if kind == "litdata":
        import litdata

        dataset = litdata.StreamingDataset(str(root / "litdata"))
        return litdata.StreamingDataLoader(
            dataset, batch_size=BATCH, collate_fn=_as_list, num_workers=WORKERS
        )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(root / "megatron" / "corpus"))
    return torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, collate_fn=_as_list, num_workers=WORKERS
    )


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if callable(close):
        close()


def run(name: str, root: Path) -> dict[str, Any]:
    """One contender: an epoch (samples/s, first batch), then a state saved after 100
    batches (its size as JSON) restored on a new loader (to its first batch). The libraries
    are imported before the clock starts (megatron-core's import alone takes seconds)."""
    kind, side = name.rsplit("_", 1)
    if side != "peer":
        import energy_loader  # noqa: F401
    elif kind == "mds":
        _import_streaming()
    elif kind == "litdata":
        import litdata  # noqa: F401
    else:
        import megatron.core.datasets.indexed_dataset  # noqa: F401
    start, cpu = time.perf_counter(), time.process_time()
    loader = _loader(name, root)
    saves = hasattr(loader, "state_dict")
    first, count = 0.0, 0
    for step, batch in enumerate(loader):
        first = first or time.perf_counter() - start
        count += len(batch)
        if saves and step % SAVE_EVERY == 0:
            loader.state_dict()
    rate = count / (time.perf_counter() - start)
    main_cpu = time.process_time() - cpu
    _close(loader)
    del loader  # the workers are stopped and waited for: their CPU is the children's
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    worker_cpu = children.ru_utime + children.ru_stime
    out: dict[str, Any] = {
        "rate": rate,
        "first": first,
        "samples": count,
        "cpu_per_1k": 1000 * (main_cpu + worker_cpu) / count,
    }
    if saves:
        loader = _loader(name, root)
        iterator = iter(loader)
        for _ in range(min(100, count // BATCH // 2)):  # 100, or mid-epoch if fewer
            next(iterator)
        state = loader.state_dict()
        size = len(json.dumps(state, default=str))
        _close(loader)
        del iterator, loader
        begin = time.perf_counter()
        restored = _loader(name, root)
        restored.load_state_dict(json.loads(json.dumps(state, default=str)))
        next(iter(restored))
        out.update(state_bytes=size, restore=time.perf_counter() - begin)
        _close(restored)
    return out


def _python(kind: str, side: str, options: argparse.Namespace) -> str | None:
    if side != "peer":  # ours, from this tree or a baseline tree
        return sys.executable
    chosen = getattr(options, f"{kind}_python") or str(
        REPOSITORY / ".venv-peers" / kind / "bin" / "python"
    )
    return chosen if Path(chosen).exists() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--samples", type=int, default=24000)
    for kind in FORMATS:
        parser.add_argument(f"--{kind}-python", default=None, help=f"the {kind} peer's python")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        action="append",
        default=[],
        help="another checkout of energy_loader whose readers run side by side (repeatable)",
    )
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--make", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.make:
        make(options.make, Path(options.root), options.samples)
        return 0
    if options.run:
        print(json.dumps(run(options.run, Path(options.root))))
        return 0
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory(prefix="bench-peer-formats-") as directory:
        root = Path(directory)
        names: list[str] = []
        trees = {"ours": REPOSITORY} | {
            f"base{i}": tree for i, tree in enumerate(options.baseline_tree)
        }
        for i, tree in enumerate(options.baseline_tree):
            for kind in FORMATS:
                LABELS[f"{kind}_base{i}"] = f"{LABELS[kind + '_ours']} (baseline {tree.name})"
        for kind in FORMATS:
            python = _python(kind, "peer", options)
            if python is None:
                print(f"{kind}: no peer interpreter, skipped", file=sys.stderr)
                continue
            subprocess.run(
                [
                    python,
                    __file__,
                    "--make",
                    kind,
                    "--root",
                    str(root),
                    "--samples",
                    str(options.samples),
                ],
                check=True,
                env=environment,
                capture_output=True,
            )
            names += [f"{kind}_peer"] + [f"{kind}_{side}" for side in trees]
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for repetition in range(options.repetitions):
            shift = repetition % max(1, len(names))
            for name in names[shift:] + names[:shift]:
                kind, side = name.rsplit("_", 1)
                python = _python(kind, side, options)
                assert python is not None
                tree = trees.get(side, REPOSITORY)
                done = subprocess.run(
                    [python, __file__, "--run", name, "--root", str(root)],
                    capture_output=True,
                    text=True,
                    env={**environment, "PYTHONPATH": str(tree)},
                )
                if done.returncode:
                    sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
                results[name].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"repetition {repetition + 1}/{options.repetitions} done", file=sys.stderr)
    print(f"\n{options.samples} samples, {WORKERS} workers, batches of {BATCH}, state_dict() every")
    print(f"{SAVE_EVERY} batches, median of {options.repetitions} interleaved repetitions\n")
    print("| contender | samples/s | CPU per 1,000 samples | first batch | state | restore |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        runs = results[name]
        cells = [
            f"{statistics.median(r['rate'] for r in runs):,.0f}",
            f"{statistics.median(r['cpu_per_1k'] for r in runs) * 1000:.0f} ms",
            f"{statistics.median(r['first'] for r in runs) * 1000:.0f} ms",
        ]
        if "state_bytes" in runs[0]:
            cells += [
                f"{statistics.median(r['state_bytes'] for r in runs):,.0f} B",
                f"{statistics.median(r['restore'] for r in runs) * 1000:.0f} ms",
            ]
        else:
            cells += ["(none)", "(none)"]
        print(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    print("\n| ours / the peer's loader (per repetition, then median) | median | min | max |")
    print("|---|---:|---:|---:|")
    for kind in FORMATS:
        if f"{kind}_peer" not in results:
            continue
        ratios = [
            ours["rate"] / peer["rate"]
            for ours, peer in zip(results[f"{kind}_ours"], results[f"{kind}_peer"])
        ]
        cpu = [
            peer["cpu_per_1k"] / ours["cpu_per_1k"]
            for ours, peer in zip(results[f"{kind}_ours"], results[f"{kind}_peer"])
        ]
        print(
            f"| {kind}: samples/s | {statistics.median(ratios):.2f}x | {min(ratios):.2f}x | "
            f"{max(ratios):.2f}x |"
        )
        print(
            f"| {kind}: CPU per sample, the peer's / ours | {statistics.median(cpu):.2f}x | "
            f"{min(cpu):.2f}x | {max(cpu):.2f}x |"
        )
    if len(trees) > 1:
        print("\n| our reader, from | samples/s vs this tree | CPU per sample vs this tree |")
        print("|---|---:|---:|")
        for kind in FORMATS:
            for side in list(trees)[1:]:
                if f"{kind}_{side}" not in results:
                    continue
                pairs = list(zip(results[f"{kind}_{side}"], results[f"{kind}_ours"]))
                rate = statistics.median(theirs["rate"] / ours["rate"] for theirs, ours in pairs)
                cpu = statistics.median(
                    theirs["cpu_per_1k"] / ours["cpu_per_1k"] for theirs, ours in pairs
                )
                print(f"| {LABELS[f'{kind}_{side}']} | {rate:.2f}x | {cpu:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
