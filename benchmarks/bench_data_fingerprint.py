"""What the data fingerprint costs: an MDS dataset of 10,000 shard files.

Writes ``--files`` shards (copies of one small MDS shard, ~0.5 KiB, listed in one index.json),
then times, in this process:

- ``build``: ``MDSSource(...)`` plus its first ``config()`` (where the fingerprint is taken:
  every file stat-ed and read in part), cold (the process's digest cache empty) and warm (a
  second source over the same files: stat only);
- ``restore check``: what a restore adds, :func:`report_data_changes` over the loader's
  planner, unchanged data (two strings compared) and one shard rewritten in place (the file
  named);
- ``state_dict``: a loader's ``state_dict()`` after 3 steps (median of ``--repetitions``), and
  the size of its JSON leaves.

Run it on a tree before the fingerprint too (``PYTHONPATH=<that tree>``): the fingerprint's
lines are skipped there, the state_dict figures compare. Example::

    python benchmarks/bench_data_fingerprint.py --files 10000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import energy_loader as el

SHARD = Path(__file__).resolve().parent.parent / "tests/sources/fixtures/mds/plain"


def write_dataset(folder: Path, files: int) -> None:
    """``files`` copies of one fixture shard, listed in one index.json, dated a minute ago
    (settled files, as a dataset's are: the digest cache keeps those)."""
    index = json.loads((SHARD / "index.json").read_text())
    entry = index["shards"][0]
    data = (SHARD / entry["raw_data"]["basename"]).read_bytes()
    folder.mkdir(parents=True)
    shards = []
    past = time.time_ns() - 60 * 10**9
    for number in range(files):
        name = f"shard.{number:05d}.mds"
        (folder / name).write_bytes(data)
        os.utime(folder / name, ns=(past, past))
        shards.append({**entry, "raw_data": {**entry["raw_data"], "basename": name}})
    (folder / "index.json").write_text(json.dumps({**index, "shards": shards}))


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--repetitions", type=int, default=200)
    parser.add_argument("--groups", type=int, help="groups a fingerprint names at most")
    args = parser.parse_args()
    try:
        from energy_loader.loader import checks
        from energy_loader.state import data_fingerprint

        data_fingerprint.GROUPS = args.groups or data_fingerprint.GROUPS
    except ImportError:
        data_fingerprint = None
    root = Path(tempfile.mkdtemp(prefix="bench-data-fp-"))
    try:
        folder = root / "data"
        write_dataset(folder, args.files)

        def build() -> el.MDSSource:
            source = el.MDSSource(folder, cache_dir=root / "cache")
            source.config()
            return source

        for attempt in ("cold", "warm"):
            built, source = timed(lambda: el.MDSSource(folder, cache_dir=root / "cache"))
            config, _ = timed(source.config)
            print(
                f"{args.files} files, {attempt}: MDSSource() {built:.0f} ms, then its first "
                f"config() {config:.1f} ms (the data fingerprint, where there is one)"
            )
        loader = el.SavableDataLoader(el.BatchDataset(build(), 2, collate_fn=list))
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        times = []
        for _ in range(args.repetitions):
            start = time.perf_counter()
            leaves = loader.state_dict()
            times.append((time.perf_counter() - start) * 1e6)
        size = sum(len(leaf) for leaf in leaves.values())
        median = statistics.median(times)
        print(f"state_dict: median {median:.0f} us, {size} bytes in {len(leaves)} leaves")
        if data_fingerprint is None:
            print("(no data fingerprint in this tree)")
            return
        plain = loader.config()["pipeline"]["inner"]["data_files"]
        print(f"data_files field: {len(plain)} characters")
        state = loader.save_state_rank()
        planner = loader._engine.planner  # the restore's own planner
        same = [timed(lambda: checks.report_data_changes(planner, state["config"], "warn"))[0]]
        same += [timed(lambda: checks.report_data_changes(planner, state["config"], "warn"))[0]]
        print(f"restore check, data unchanged: {min(same) * 1e3:.0f} us")
        shard = folder / "shard.04321.mds"
        shard.write_bytes(shard.read_bytes()[::-1])
        changed = build()
        fresh = el.SavableDataLoader(el.BatchDataset(changed, 2, collate_fn=list))
        fresh_planner = fresh._engine.planner
        elapsed, found = timed(
            lambda: data_fingerprint.data_changes(
                state["config"], fresh_planner.pipeline_config, fresh_planner.pipeline.walk()
            )
        )
        print(f"restore check, one shard rewritten: {elapsed * 1e3:.0f} us: {found}")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
