"""MDSSource on shards streaming-community's MDSWriter wrote (zstd-compressed, every common column
encoding; and uncompressed), against what streaming's own StreamingDataset returned for them
(tests/sources/fixtures/make_fixtures.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.compare import first_difference

from .helpers import assert_elastic_resume, assert_matches_peer, assert_readers_interleave

FIXTURES = Path(__file__).parent / "fixtures" / "mds"
ZSTD, PLAIN = FIXTURES / "zstd", FIXTURES / "plain"
COUNTS = {"zstd": 60, "plain": 37}


@pytest.fixture(scope="module")
def expected():
    with np.load(FIXTURES / "expected.npz") as data:
        arrays = {key: data[key] for key in data.files}
    return json.loads((FIXTURES / "expected.json").read_text()), arrays


def _row_number(source: el.MDSSource, key: tuple[int, int]) -> int:
    shard, row = key
    return sum(info.samples for info in source.shards[:shard]) + row


def _same(a: dict, b: dict) -> None:
    detail = first_difference(
        {k: v for k, v in a.items() if k not in ("jpeg", "png", "pil")},
        {k: v for k, v in b.items() if k not in ("jpeg", "png", "pil")},
    )
    assert detail is None, detail


@pytest.mark.parametrize("name", ["zstd", "plain"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_an_epoch_with_streaming_s_values(expected, tmp_path, name, shuffle):
    described, arrays = expected
    source = el.MDSSource(FIXTURES / name, shuffle=shuffle, seed=4, cache_dir=tmp_path)
    assert len(source) == COUNTS[name]
    for _epoch in range(2):
        got = list(source)
        numbers = [_row_number(source, el.restore_key_of(sample)) for sample in got]
        assert sorted(numbers) == list(range(COUNTS[name]))
        if not shuffle:
            assert numbers == list(range(COUNTS[name]))
        for number, sample in zip(numbers, got):
            reference = described[name][number]
            columns = {k: v for k, v in sample.items() if k != el.RESTORE_KEY}
            assert sorted(columns) == sorted(reference)
            for column, value in columns.items():
                assert_matches_peer(value, reference[column], arrays, f"{name}[{number}].{column}")
    restored = source.restore_sample((1, 2))
    assert restored["id"] == described[name][_row_number(source, (1, 2))]["id"]["value"]


def test_compressed_shards_are_decompressed_into_the_cache(tmp_path):
    el.MDSSource(ZSTD, cache_dir=tmp_path / "cache").restore_sample((2, 0))
    assert (tmp_path / "cache" / "shard.00002.mds").exists()
    assert not list(ZSTD.glob("*.mds"))  # the dataset directory is left as it was


def test_columns_selects(tmp_path):
    sample = next(iter(el.MDSSource(ZSTD, columns=["id", "vec"], cache_dir=tmp_path)))
    assert sorted(k for k in sample if k != el.RESTORE_KEY) == ["id", "vec"]
    with pytest.raises(ValueError, match=r"`columns` \['nope'\] are not in .*shards\[0\] has"):
        el.MDSSource(ZSTD, columns=["nope"], cache_dir=tmp_path)


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_order_is_the_same_for_any_number_of_readers(shuffle):
    source = el.MDSSource(PLAIN, shuffle=shuffle, seed=3, num_canonical_partitions=4)
    assert_readers_interleave(source, source.global_order(0, 4), [(1, 1), (1, 2), (2, 2), (1, 4)])


def test_the_same_stream_on_other_workers_and_world_sizes_and_exact_elastic_restores(tmp_path):
    def build() -> el.MDSSource:
        return el.MDSSource(ZSTD, shuffle=True, seed=9, cache_dir=tmp_path)

    assert_elastic_resume(build, _same, partitions=4, saved=(1, 2), head_steps=9)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact(tmp_path, num_workers, no_leftover_processes):
    report = check_resume(
        lambda: (
            el.MDSSource(ZSTD, shuffle=True, seed=3, num_canonical_partitions=2, cache_dir=tmp_path)
            .map(lambda s: {"id": s["id"], "vec": s["vec"][:1].copy(), "grid": s["grid"].copy()})
            .batch(4)
        ),
        num_workers=num_workers,
    )
    assert report.events > 10


@given(stop=st.integers(0, 40), seed=st.integers(0, 3))
def test_resume_property(stop, seed):
    check_resume(lambda: el.MDSSource(PLAIN, shuffle=True, seed=seed), stop_points=[stop])


def test_a_remote_dataset_reads_through_a_bounded_cache(tmp_path, no_leftover_processes):
    memory = fsspec.filesystem("memory")
    for path in ZSTD.iterdir():
        memory.pipe(f"/mds-test/{path.name}", path.read_bytes())
    try:
        largest = max(info.raw_bytes for info in el.MDSSource(ZSTD, cache_dir=tmp_path).shards)

        def build() -> el.MDSSource:
            return el.MDSSource(
                "memory://mds-test",
                shuffle=True,
                seed=2,
                cache_dir=tmp_path / "cache",
                cache_limit=3 * largest,
                predownload=8,
            )

        got = list(el.SavableDataLoader(build(), batch_size=None, num_workers=2))
        assert sorted(s["id"] for s in got) == list(range(60))
        reference = {s["id"]: s for s in el.MDSSource(ZSTD, cache_dir=tmp_path)}
        for sample in got:
            _same(sample, reference[sample["id"]])
        cached = sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.mds"))
        assert cached <= 3 * largest
        check_resume(build, stop_points=[25])
    finally:
        memory.rm("/mds-test", recursive=True)


def test_a_truncated_shard_is_named(tmp_path, no_leftover_processes):
    shutil.copytree(PLAIN, tmp_path / "plain")
    shard = tmp_path / "plain" / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-9])
    source = el.MDSSource(tmp_path / "plain")
    with pytest.raises(el.SourceDataError, match=r"shard\.00001\.mds is truncated"):
        list(source)
    with pytest.raises(el.WorkerError, match=r"shard\.00001\.mds is truncated"):
        list(el.SavableDataLoader(source, batch_size=None, num_workers=1))
    shutil.copytree(ZSTD, tmp_path / "zstd")
    packed = tmp_path / "zstd" / "shard.00003.mds.zstd"
    packed.write_bytes(packed.read_bytes()[:-30])
    source = el.MDSSource(tmp_path / "zstd", cache_dir=tmp_path / "cache", download_retries=0)
    with pytest.raises(el.SourceDataError, match=r"shard\.00003\.mds\.zstd is corrupt"):
        source.restore_sample((3, 0))


def test_bad_indexes_and_encodings_are_named(tmp_path):
    shutil.copytree(PLAIN, tmp_path / "plain")
    index_path = tmp_path / "plain" / "index.json"
    index = json.loads(index_path.read_text())
    index["shards"][1]["column_encodings"][1] = "mystery"
    index_path.write_text(json.dumps(index))
    with pytest.raises(el.SourceDataError, match=r"shards\[1\]: column encoding 'mystery'"):
        el.MDSSource(tmp_path / "plain")
    index["shards"][1]["column_encodings"][1] = "pkl"
    index_path.write_text(json.dumps(index))
    with pytest.raises(el.SourceDataError, match="allow_unsafe_types=True"):
        el.MDSSource(tmp_path / "plain")
    index["shards"][1]["column_encodings"][1] = "str"
    index["shards"][1]["compression"] = "snappy"
    index_path.write_text(json.dumps(index))
    with pytest.raises(el.SourceDataError, match="compressed with 'snappy'"):
        el.MDSSource(tmp_path / "plain")
    index_path.write_text("{}")
    with pytest.raises(el.SourceDataError, match="is not an MDS index"):
        el.MDSSource(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match=r"index\.json does not exist"):
        el.MDSSource(tmp_path / "nothing")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seed": -1}, ValueError, "seed"),
        ({"columns": "id"}, TypeError, "columns"),
        ({"allow_unsafe_types": 1}, TypeError, "allow_unsafe_types"),
        ({"cache_dir": "s3://x"}, TypeError, "cache_dir"),
        ({"cache_limit": 0}, ValueError, "cache_limit"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        el.MDSSource(PLAIN, **kwargs)


def test_bad_keys():
    source = el.MDSSource(PLAIN)
    for key in [(99, 0), (0, 99), (0,), ("0", 0)]:
        with pytest.raises(ValueError, match=r"\(shard, row\)"):
            source.restore_sample(key)
