"""ShardWriter and ShardedSource: shard files, downloads, cache, global order, resume, errors."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import multiprocessing
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import energy_loader as el
from energy_loader import DownloadError, ShardedSource, ShardWriter, SourceDataError
from energy_loader.errors import StateFormatError
from energy_loader.testing import check_resume
from energy_loader.testing.compare import first_difference
from energy_loader.worker import WorkerContext
from tests.sources.helpers import assert_readers_interleave, keys_of

LOGGER_NAME = "energy_loader.sources.sharded"


def sample(i: int) -> dict[str, Any]:
    return {
        "i": i,
        "x": torch.arange(5) + 10 * i,
        "a": np.full(3, i, dtype=np.float32),
        "tag": ("s", i % 3),
    }


def write(url: str | Path, n: int, *, max_shard_bytes: int = 1500, compression=None) -> ShardWriter:
    with ShardWriter(url, max_shard_bytes=max_shard_bytes, compression=compression) as writer:
        for i in range(n):
            writer.write(sample(i))
    return writer


def without_key(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != el.RESTORE_KEY}


def usage(local: Path) -> int:
    """Bytes of shards in the cache (the prefetch thread may evict one while we look)."""
    total = 0
    for path in local.glob("shard-*.els"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


@contextlib.contextmanager
def download_log(path: Path) -> Iterator[Path]:
    """Record the sharded source's log (downloads, retries, evictions) in ``path``."""
    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def downloads(log: Path) -> Counter[str]:
    lines = log.read_text().splitlines() if log.exists() else []
    return Counter(line.split()[3] for line in lines if line.startswith("DEBUG downloaded"))


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("energy_loader-shard-prefetch")]


# -- the writer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
def test_writer_bounds_shards_and_indexes_them(tmp_path, compression):
    writer = write(tmp_path, 40, max_shard_bytes=1500, compression=compression)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["format"] == "energy_loader.shards" and index["version"] == 1
    assert index["compression"] == compression
    assert index["total_samples"] == 40 == sum(s["samples"] for s in index["shards"])
    assert len(index["shards"]) == len(writer.shards) > 3
    for entry in index["shards"]:
        assert entry["raw_bytes"] <= 1500
        assert (tmp_path / entry["name"]).stat().st_size == entry["bytes"]
        assert entry["name"].endswith(
            {None: ".els", "gzip": ".els.gz", "zstd": ".els.zst"}[compression]
        )
    source = ShardedSource(tmp_path, tmp_path / "cache")
    got = list(source)
    assert len(got) == len(source) == 40
    for i, item in enumerate(got):
        assert first_difference(sample(i), without_key(item)) is None
        assert first_difference(sample(i), source.restore_sample(el.restore_key_of(item))) is None


def test_a_sample_larger_than_the_bound_gets_its_own_shard(tmp_path):
    with ShardWriter(tmp_path, max_shard_bytes=200) as writer:
        writer.write({"big": torch.zeros(100)})
        writer.write({"small": 1})
        writer.write({"small": 2})
    assert [s.samples for s in writer.shards] == [1, 2]


def test_writer_refuses_bad_input(tmp_path):
    write(tmp_path / "a", 3)
    with pytest.raises(FileExistsError, match="already holds a sharded dataset"):
        ShardWriter(tmp_path / "a")
    with pytest.raises(ValueError, match="`compression` must be one of"):
        ShardWriter(tmp_path / "b", compression="lz4")
    with pytest.raises(ValueError, match="`max_shard_bytes` must be positive"):
        ShardWriter(tmp_path / "b", max_shard_bytes=0)
    with ShardWriter(tmp_path / "b") as writer:
        with pytest.raises(TypeError, match=r"sample\[.f.\] is a builtin_function_or_method"):
            writer.write({"f": print})
        with pytest.raises(TypeError, match="numpy dtype object"):
            writer.write({"o": np.array([None])})
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "c") as writer:
        writer.write({"i": 1})
        raise RuntimeError("the producer failed")
    assert not (tmp_path / "c" / "index.json").exists()  # an incomplete dataset has no index


# -- reading, order ------------------------------------------------------------------------------


def test_epoch_order_is_deterministic_and_changes_per_epoch(tmp_path):
    write(tmp_path / "remote", 60)

    def two_epochs(seed: int) -> list[list[Any]]:
        source = ShardedSource(tmp_path / "remote", tmp_path / "cache", shuffle=True, seed=seed)
        first = keys_of(source)
        return [first, [key for key, _ in source.iter_keyed()]]

    first, again = two_epochs(1), two_epochs(1)
    assert first == again
    assert first[0] != first[1] and sorted(first[0]) == sorted(first[1])
    assert len(set(first[0])) == 60
    assert two_epochs(2)[0] != first[0]
    plain = ShardedSource(tmp_path / "remote", tmp_path / "cache")
    assert [int(s["i"]) for s in plain] == list(range(60))


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_order_is_the_same_for_any_number_of_readers(tmp_path, shuffle):
    write(tmp_path / "remote", 50)
    source = ShardedSource(
        tmp_path / "remote", tmp_path / "cache", shuffle=shuffle, seed=4, num_canonical_partitions=4
    )
    expected = source.global_order(epoch=0)
    assert sorted(expected) == sorted(keys_of(ShardedSource(tmp_path / "remote", tmp_path / "c2")))
    assert_readers_interleave(source, expected, [(1, 1), (2, 1), (1, 4), (4, 2), (3, 1)])


def test_each_reader_reads_its_own_shards_when_partitions_match(tmp_path):
    write(tmp_path / "remote", 64, max_shard_bytes=1000)
    source = ShardedSource(tmp_path / "remote", tmp_path / "cache", shuffle=True, seed=3)
    shards = [
        {shard for shard, _ in keys_of(source, WorkerContext(partition=w, num_partitions=4))}
        for w in range(4)
    ]
    # Spans are contiguous in shard order: readers share at most a boundary shard.
    assert sum(len(s) for s in shards) <= len(source.shards) + 3


# -- resume ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.timeout(120)
def test_resume_is_exact_with_workers(tmp_path, num_workers, no_leftover_processes):
    write(tmp_path / "remote", 30, compression="gzip")

    def build() -> el.SavableDataset:
        source = ShardedSource(
            tmp_path / "remote",
            tmp_path / "cache",
            shuffle=True,
            seed=5,
            predownload=4,
            cache_limit=3000,
        )
        return el.BatchDataset(source, 4)

    report = check_resume(
        build,
        num_workers=num_workers,
        epochs=2,
        stop_points={0: None, 1: [7, 10], 2: [3, 9]}[num_workers],
    )
    assert report.state_bytes < 1500


@pytest.mark.timeout(120)
def test_memory_filesystem_remote_resumes_with_workers(no_leftover_processes):
    remote = f"memory://energy-loader-tests/{uuid.uuid4().hex}"
    write(remote, 25, compression="zstd")
    local = Path(tempfile.mkdtemp())
    assert fsspec.filesystem("memory").exists(remote.removeprefix("memory://") + "/index.json")

    def build() -> el.SavableDataset:
        return ShardedSource(remote, local, shuffle=True, seed=1, num_canonical_partitions=2)

    assert sorted(int(s["i"]) for s in build()) == list(range(25))
    check_resume(build, num_workers=0, epochs=2)
    check_resume(build, num_workers=2, epochs=2, stop_points=[6, 14])


@settings(max_examples=8)
@given(
    n=st.integers(1, 40),
    shard_bytes=st.integers(400, 3000),
    seed=st.integers(0, 2**31),
    shuffle=st.booleans(),
    partitions=st.sampled_from([None, 1, 3, 4]),
    workers=st.integers(0, 2),
    data=st.data(),
)
@pytest.mark.timeout(300)
def test_resume_property(
    tmp_path_factory, n, shard_bytes, seed, shuffle, partitions, workers, data
):
    base = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    write(base / "remote", n, max_shard_bytes=shard_bytes)

    def build() -> el.SavableDataset:
        return ShardedSource(
            base / "remote",
            base / "cache",
            shuffle=shuffle,
            seed=seed,
            num_canonical_partitions=partitions,
            predownload=data_predownload,
        )

    data_predownload = data.draw(st.integers(0, 8), label="predownload")
    events = 2 * n + 2 if workers == 0 else 2 * n + 2 * workers
    stop = data.draw(st.integers(0, events), label="stop")
    loader = el.SavableDataLoader(build(), num_workers=workers)
    stop = min(stop, 2 * len(loader) + 1)
    check_resume(build, num_workers=workers, epochs=2, stop_points=[stop])


def test_state_of_another_reader_is_refused(tmp_path):
    write(tmp_path / "remote", 10)
    source = ShardedSource(tmp_path / "remote", tmp_path / "cache")
    source.bind(WorkerContext(partition=1, num_partitions=2))
    with pytest.raises(StateFormatError, match="position 4 does not belong to reader 1 of 2"):
        source.restore_state({"phase": "running", "epoch": 0, "position": 4})
    source.restore_state({"phase": "running", "epoch": 0, "position": 7})
    order = source.global_order(epoch=0)
    assert [key for key, _ in source.iter_keyed()] == [order[7], order[9]]


# -- downloads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("predownload", [0, 50])  # found by the reader / by the prefetch thread
def test_a_corrupt_shard_is_downloaded_again_then_refused(tmp_path, predownload):
    writer = write(tmp_path / "remote", 20)
    victim = tmp_path / "remote" / writer.shards[1].name
    good = victim.read_bytes()
    victim.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with download_log(tmp_path / "log"):
        source = ShardedSource(
            tmp_path / "remote", tmp_path / "cache", download_retries=2, predownload=predownload
        )
        with pytest.raises(SourceDataError) as raised:
            list(source)
    message = str(raised.value)
    assert writer.shards[1].name in message and "is corrupt" in message
    assert "downloaded 3 times" in message and "sha256" in message
    retries = [ln for ln in (tmp_path / "log").read_text().splitlines() if "again" in ln]
    assert len(retries) == 2
    assert not list((tmp_path / "cache").glob("*.part"))  # no temporary files left behind


class RepairOnRetry(logging.Handler):
    """Puts the good bytes back on the remote when the source reports a bad download."""

    def __init__(self, path: Path, good: bytes) -> None:
        super().__init__()
        self.path, self.good = path, good

    def emit(self, record: logging.LogRecord) -> None:
        if "downloading again" in record.getMessage():
            self.path.write_bytes(self.good)


def test_a_shard_corrupted_in_transit_is_fetched_again(tmp_path):
    writer = write(tmp_path / "remote", 20, compression="gzip")
    victim = tmp_path / "remote" / writer.shards[0].name
    good = victim.read_bytes()
    victim.write_bytes(good[: len(good) // 2])  # truncated
    repair = RepairOnRetry(victim, good)
    logging.getLogger(LOGGER_NAME).addHandler(repair)
    try:
        with download_log(tmp_path / "log"):
            source = ShardedSource(tmp_path / "remote", tmp_path / "cache", predownload=5)
            assert [int(s["i"]) for s in source] == list(range(20))
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(repair)
    assert downloads(tmp_path / "log")[writer.shards[0].name] == 1


def test_missing_index_or_shard_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"index\.json is missing"):
        ShardedSource(tmp_path / "nothing", tmp_path / "cache")
    writer = write(tmp_path / "remote", 12)
    (tmp_path / "remote" / writer.shards[-1].name).unlink()
    source = ShardedSource(tmp_path / "remote", tmp_path / "cache", predownload=0)
    with pytest.raises(FileNotFoundError, match=f"shard {writer.shards[-1].name} listed in"):
        list(source)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda index: index.update(version=9), "version 9"),
        (lambda index: index.update(total_samples=3), "total_samples is 3"),
        (lambda index: index.update(compression="lz4"), "unknown compression"),
        (lambda index: index["shards"][0].pop("sha256"), r"shards\[0\] must have the fields"),
        (lambda index: index["shards"][0].update(raw_name="../x"), r"raw_name is '../x'"),
        (lambda index: index.clear(), "is not a ShardWriter index"),
    ],
)
def test_bad_index_is_named(tmp_path, edit, message):
    write(tmp_path / "remote", 5)
    path = tmp_path / "remote" / "index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))
    with pytest.raises(SourceDataError, match=message) as raised:
        ShardedSource(tmp_path / "remote", tmp_path / "cache")
    assert "index.json" in str(raised.value)


def test_a_cache_of_another_dataset_is_refused(tmp_path):
    write(tmp_path / "one", 5)
    write(tmp_path / "two", 6)
    ShardedSource(tmp_path / "one", tmp_path / "cache")
    with pytest.raises(SourceDataError, match=r"holds the shards of a different index\.json"):
        ShardedSource(tmp_path / "two", tmp_path / "cache")


def test_a_held_download_lock_times_out(tmp_path):
    writer = write(tmp_path / "remote", 5)
    source = ShardedSource(
        tmp_path / "remote",
        tmp_path / "cache",
        download_retries=0,
        download_timeout=0.1,
        predownload=0,
    )
    lock = tmp_path / "cache" / ".locks" / f"{writer.shards[0].raw_name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(DownloadError, match=r"for the lock .* held by another process"):
            list(source)
        assert time.monotonic() - started < 5


def read_all(remote: str, local: str, log: str, partitions: int, barrier: Any) -> None:
    """One process of a node: read the whole dataset (runs in a child process)."""
    barrier.wait(timeout=20)  # all processes start reading at once
    with download_log(Path(log)):
        source = ShardedSource(remote, local, num_canonical_partitions=partitions, predownload=6)
        assert len(list(source)) == 40


@pytest.mark.timeout(60)
def test_one_process_per_node_downloads_each_shard(tmp_path):
    writer = write(tmp_path / "remote", 40, max_shard_bytes=800)
    context = multiprocessing.get_context("fork")
    log = tmp_path / "downloads.log"
    barrier = context.Barrier(3)
    arguments = (str(tmp_path / "remote"), str(tmp_path / "cache"), str(log), 1, barrier)
    processes = [context.Process(target=read_all, args=arguments) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert downloads(log) == Counter({shard.name: 1 for shard in writer.shards})


@pytest.mark.timeout(60)
def test_loader_workers_share_downloads(tmp_path, no_leftover_processes):
    writer = write(tmp_path / "remote", 30, max_shard_bytes=800)
    with download_log(tmp_path / "log"):
        source = ShardedSource(
            tmp_path / "remote", tmp_path / "cache", num_canonical_partitions=1, predownload=3
        )
        loader = el.SavableDataLoader(source, num_workers=2)
        assert sorted(int(s["i"]) for s in loader) == list(range(30))
        del loader
    # Both workers read every shard (one span, interleaved), but each is downloaded once.
    assert downloads(tmp_path / "log") == Counter({shard.name: 1 for shard in writer.shards})


def test_cache_limit_evicts_shards_already_read(tmp_path):
    writer = write(tmp_path / "remote", 60, max_shard_bytes=1000)
    largest = max(shard.raw_bytes for shard in writer.shards)
    limit = 2 * largest
    local = tmp_path / "cache"
    source = ShardedSource(
        tmp_path / "remote", local, shuffle=True, seed=2, predownload=20, cache_limit=limit
    )
    for epoch in range(2):
        seen, most = [], 0
        for item in source:
            most = max(most, usage(local))
            seen.append(int(item["i"]))
        assert sorted(seen) == list(range(60)), epoch
        assert most <= limit
    assert len(list(local.glob("shard-*.els"))) < len(writer.shards)
    # An evicted shard is fetched again when a sample of it is rebuilt.
    evicted = next(i for i, s in enumerate(writer.shards) if not (local / s.raw_name).exists())
    assert source.restore_sample((evicted, 0))["i"] == sum(
        s.samples for s in writer.shards[:evicted]
    )


def test_prefetch_threads_stop(tmp_path):
    writer = write(tmp_path / "remote", 40, max_shard_bytes=800)
    # A cache of two shards: the thread downloads two, then waits for room (so it is alive).
    limit = 2 * max(shard.raw_bytes for shard in writer.shards)
    source = ShardedSource(
        tmp_path / "remote", tmp_path / "cache", predownload=1000, cache_limit=limit
    )
    assert not prefetch_threads()  # nothing starts in the constructor
    iterator = source.iter_keyed()
    next(iterator)
    assert len(prefetch_threads()) == 1
    del iterator  # abandoned mid-epoch
    gc.collect()
    source.reset_state()
    gc.collect()
    deadline = time.monotonic() + 5
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not prefetch_threads()
    assert len(list(source)) == 40
    assert not prefetch_threads()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"predownload": -1}, ValueError, "`predownload` must be >= 0"),
        ({"cache_limit": 10}, ValueError, "must hold at least the largest shard"),
        ({"download_timeout": 0}, ValueError, "`download_timeout` must be a positive number"),
        ({"download_retries": 1.5}, TypeError, "`download_retries` must be an integer"),
        ({"num_canonical_partitions": 0}, ValueError, "`num_canonical_partitions` must be"),
        ({"shuffle": 1}, TypeError, "`shuffle` must be True or False"),
        ({"local": "s3://bucket/cache"}, TypeError, "`local` must be a local directory"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error, message):
    write(tmp_path / "remote", 4)
    kwargs = {"local": tmp_path / "cache", **kwargs}
    with pytest.raises(error, match=message):
        ShardedSource(tmp_path / "remote", **kwargs)
    with pytest.raises(ValueError, match="cache directory apart from the remote"):
        ShardedSource(tmp_path / "remote", tmp_path / "remote")


def test_restore_sample_refuses_bad_keys(tmp_path):
    write(tmp_path / "remote", 4)
    source = ShardedSource(tmp_path / "remote", tmp_path / "cache")
    for key in [(0,), (5, 0), (0, 4), (0, "1")]:
        with pytest.raises(ValueError, match=r"restore keys are \(shard, row\)"):
            source.restore_sample(key)


def test_a_shard_the_reader_comes_back_to_is_not_evicted_under_it(tmp_path):
    # Released shard 0, read again: making room for another shard must not delete it.
    write(tmp_path / "remote", 64, max_shard_bytes=1000)
    source = ShardedSource(tmp_path / "remote", tmp_path / "cache", cache_limit=2500)
    cache = source.cache()
    first = cache.ensure(0)
    cache.release(0)
    assert cache.ensure(0) == first
    cache.ensure(1, ahead=True)
    cache.ensure(2, ahead=True)
    assert first.exists()
