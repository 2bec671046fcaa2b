"""LitDataSource on chunks litdata.optimize wrote, against what litdata's own StreamingDataset
returned for them (tests/sources/fixtures/make_fixtures.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.compare import first_difference

from .helpers import assert_elastic_resume, assert_matches_peer, assert_readers_interleave

FIXTURES = Path(__file__).parent / "fixtures" / "litdata"
PLAIN = FIXTURES / "plain"
COUNT = 45


@pytest.fixture(scope="module")
def expected():
    with np.load(FIXTURES / "expected.npz") as data:
        arrays = {key: data[key] for key in data.files}
    return json.loads((FIXTURES / "expected.json").read_text())["plain"], arrays


def _number(source: el.LitDataSource, key: tuple[int, int]) -> int:
    chunk, row = key
    return sum(info.samples for info in source.shards[:chunk]) + row


def _same(a: dict, b: dict) -> None:
    detail = first_difference(
        {k: v for k, v in a.items() if k != "image"}, {k: v for k, v in b.items() if k != "image"}
    )
    assert detail is None, detail


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_item_once_an_epoch_with_litdata_s_values(expected, shuffle):
    described, arrays = expected
    source = el.LitDataSource(PLAIN, shuffle=shuffle, seed=4)
    assert len(source) == COUNT
    for _epoch in range(2):
        got = list(source)
        numbers = [_number(source, el.restore_key_of(item)) for item in got]
        assert sorted(numbers) == list(range(COUNT))
        if not shuffle:
            assert numbers == list(range(COUNT))
        for number, item in zip(numbers, got):
            reference = described[number]
            fields = {k: v for k, v in item.items() if k != el.RESTORE_KEY}
            assert list(fields) == list(reference)  # litdata's key order too
            for name, value in fields.items():
                assert_matches_peer(value, reference[name], arrays, f"item {number}.{name}")
    restored = source.restore_sample((2, 3))
    assert restored["id"] == described[_number(source, (2, 3))]["id"]["value"]
    assert isinstance(restored["tokens"], torch.Tensor)


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_order_is_the_same_for_any_number_of_readers(shuffle):
    source = el.LitDataSource(PLAIN, shuffle=shuffle, seed=3, num_canonical_partitions=4)
    assert_readers_interleave(source, source.global_order(0, 4), [(1, 1), (1, 2), (2, 2), (1, 4)])


def test_the_same_stream_on_other_workers_and_world_sizes_and_exact_elastic_restores():
    def build() -> el.LitDataSource:
        return el.LitDataSource(PLAIN, shuffle=True, seed=9)

    assert_elastic_resume(build, _same, partitions=4, saved=(1, 2), head_steps=7)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact(num_workers, no_leftover_processes):
    report = check_resume(
        lambda: (
            el.LitDataSource(PLAIN, shuffle=True, seed=3, num_canonical_partitions=2)
            .map(lambda s: {"id": s["id"], "tokens": s["tokens"][:2], "grid": s["grid"][:, :1]})
            .batch(4)
        ),
        num_workers=num_workers,
    )
    assert report.events > 10


@given(stop=st.integers(0, 48), seed=st.integers(0, 3))
def test_resume_property(stop, seed):
    check_resume(lambda: el.LitDataSource(PLAIN, shuffle=True, seed=seed), stop_points=[stop])


def test_a_remote_dataset_reads_through_a_bounded_cache(tmp_path, no_leftover_processes):
    memory = fsspec.filesystem("memory")
    for path in PLAIN.iterdir():
        memory.pipe(f"/litdata-test/{path.name}", path.read_bytes())
    try:
        largest = max(info.raw_bytes for info in el.LitDataSource(PLAIN).shards)

        def build() -> el.LitDataSource:
            return el.LitDataSource(
                "memory://litdata-test",
                shuffle=True,
                seed=2,
                cache_dir=tmp_path / "cache",
                cache_limit=2 * largest,
                predownload=8,
            )

        got = list(el.SavableDataLoader(build(), batch_size=None, num_workers=2))
        assert sorted(s["id"] for s in got) == list(range(COUNT))
        reference = {s["id"]: s for s in el.LitDataSource(PLAIN)}
        for item in got:
            _same(item, reference[item["id"]])
        assert sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.bin")) <= 2 * largest
        check_resume(build, stop_points=[20])
    finally:
        memory.rm("/litdata-test", recursive=True)


def test_a_truncated_chunk_is_named(tmp_path, no_leftover_processes):
    shutil.copytree(PLAIN, tmp_path / "plain")
    chunk = tmp_path / "plain" / "chunk-0-2.bin"
    chunk.write_bytes(chunk.read_bytes()[:-5])
    source = el.LitDataSource(tmp_path / "plain")
    with pytest.raises(el.SourceDataError, match=r"chunk-0-2\.bin is truncated"):
        list(source)
    with pytest.raises(el.WorkerError, match=r"chunk-0-2\.bin is truncated"):
        list(el.SavableDataLoader(source, batch_size=None, num_workers=1))


def test_unread_formats_are_named(tmp_path):
    shutil.copytree(PLAIN, tmp_path / "plain")
    index_path = tmp_path / "plain" / "index.json"
    index = json.loads(index_path.read_text())
    for data_format, message in [
        ("json", "binary JSON"),
        ("jpeg", "torchvision"),
        ("video", "does not decode it"),
        ("pickle", "allow_unsafe_types=True"),
    ]:
        edited = json.loads(json.dumps(index))
        edited["config"]["data_format"][1] = data_format
        index_path.write_text(json.dumps(edited))
        with pytest.raises(el.SourceDataError, match=message):
            el.LitDataSource(tmp_path / "plain")
    edited = json.loads(json.dumps(index))
    edited["config"]["compression"] = "zstd"
    index_path.write_text(json.dumps(edited))
    with pytest.raises(el.SourceDataError, match="compression 'zstd'"):
        el.LitDataSource(tmp_path / "plain")
    edited["config"].update(compression=None, item_loader="TokensLoader")
    index_path.write_text(json.dumps(edited))
    with pytest.raises(el.SourceDataError, match="TokensLoader"):
        el.LitDataSource(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match=r"index\.json does not exist"):
        el.LitDataSource(tmp_path / "nothing")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seed": -1}, ValueError, "seed"),
        ({"shuffle": 1}, TypeError, "shuffle"),
        ({"allow_unsafe_types": "no"}, TypeError, "allow_unsafe_types"),
        ({"download_timeout": 0}, ValueError, "download_timeout"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        el.LitDataSource(PLAIN, **kwargs)


def test_bad_keys():
    source = el.LitDataSource(PLAIN)
    for key in [(6, 0), (0, 8), (0,), (0.5, 0)]:
        with pytest.raises(ValueError, match=r"\(shard, row\)"):
            source.restore_sample(key)
