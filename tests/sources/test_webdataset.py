"""WebDatasetSource and ``python -m energy_loader index``: tar shards, member index, global
order, decoding, resume with workers, damaged shards."""

from __future__ import annotations

import gc
import io
import json
import logging
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader import SourceDataError, WebDatasetSource, WorkerError
from energy_loader.cli.index import main as index_main
from energy_loader.testing import check_resume
from energy_loader.testing.resume import END, record_events
from tests.sources.helpers import assert_readers_interleave, keys_of


def members(i: int) -> list[tuple[str, bytes]]:
    """The members of sample ``i``: text, json, a class, a numpy array and a tensor."""
    array = io.BytesIO()
    np.save(array, np.arange(3, dtype=np.int16) + i)
    tensor = io.BytesIO()
    torch.save(torch.full((2,), float(i)), tensor)
    return [
        ("txt", f"text {i}".encode()),
        ("json", json.dumps({"i": i}).encode()),
        ("cls", str(i % 3).encode()),
        ("npy", array.getvalue()),
        ("pt", tensor.getvalue()),
    ]


def write_tar(path: Path, first: int, count: int, rename: dict[str, str] | None = None) -> None:
    with tarfile.open(path, "w") as archive:
        for i in range(first, first + count):
            for extension, data in members(i):
                name = f"sub/{i:06d}.{extension}"
                name = (rename or {}).get(name, name)
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


def write_shards(directory: Path, sizes: list[int]) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    first = 0
    for number, size in enumerate(sizes):
        write_tar(directory / f"shard-{number:03d}.tar", first, size)
        first += size
    return first


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Four shards of 7, 5, 9 and 3 samples (24 in all), indexed."""
    directory = tmp_path_factory.mktemp("wds")
    write_shards(directory, [7, 5, 9, 3])
    WebDatasetSource(directory)  # builds the indexes
    return directory


def test_samples_are_decoded_and_restorable(shards):
    source = WebDatasetSource(shards)
    got = list(source)
    assert len(got) == len(source) == 24
    first = got[0]
    assert first["__key__"] == "sub/000000"
    assert first["txt"] == "text 0" and first["json"] == {"i": 0} and first["cls"] == 0
    assert first["npy"].dtype == np.int16 and first["npy"].tolist() == [0, 1, 2]
    assert torch.equal(first["pt"], torch.zeros(2))
    assert [s["json"]["i"] for s in got] == list(range(24))
    restored = source.restore_sample(el.restore_key_of(got[10]))
    assert restored["json"] == {"i": 10} and restored["__key__"] == "sub/000010"
    assert sorted(p.name for p in shards.glob("*.idx.json")) == [
        f"shard-00{n}.tar.idx.json" for n in range(4)
    ]


def test_decode_options(shards):
    raw = next(iter(WebDatasetSource(shards, decode=False)))
    assert raw["txt"] == b"text 0" and isinstance(raw["npy"], bytes)
    custom = next(iter(WebDatasetSource(shards, decode={"txt": bytes.upper, "npy": None})))
    assert custom["txt"] == b"TEXT 0" and isinstance(custom["npy"], bytes)
    assert custom["json"] == {"i": 0}
    hooked = next(iter(WebDatasetSource(shards, decode=lambda raw: sorted(raw))))
    assert hooked == ["__key__", "cls", "json", "npy", "pt", "txt"]


def test_images_decode_with_pillow(tmp_path):
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 20, 30)).save(buffer, format="PNG")
    with tarfile.open(tmp_path / "images.tar", "w") as archive:
        info = tarfile.TarInfo("a.png")
        info.size = len(buffer.getvalue())
        archive.addfile(info, io.BytesIO(buffer.getvalue()))
    (sample,) = list(WebDatasetSource(tmp_path))
    assert sample["png"].size == (4, 3) and sample["png"].getpixel((0, 0)) == (10, 20, 30)


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_order_is_the_same_for_any_number_of_readers(shards, shuffle):
    source = WebDatasetSource(shards, shuffle=shuffle, seed=5, num_canonical_partitions=4)
    expected = source.global_order(epoch=0)
    assert sorted(expected) == sorted(keys_of(WebDatasetSource(shards)))
    assert_readers_interleave(source, expected, [(1, 1), (2, 1), (1, 4), (2, 2), (3, 1)])


def test_shuffle_differs_per_epoch_and_seed(shards):
    source = WebDatasetSource(shards, shuffle=True, seed=1)
    first = keys_of(source)
    second = [key for key, _ in source.iter_keyed()]
    assert first != second and sorted(first) == sorted(second)
    assert keys_of(WebDatasetSource(shards, shuffle=True, seed=2)) != first
    assert keys_of(WebDatasetSource(shards, shuffle=True, seed=1)) == first


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact(shards, num_workers, no_leftover_processes):
    report = check_resume(
        lambda: (
            WebDatasetSource(shards, shuffle=True, seed=3, num_canonical_partitions=4)
            .map(lambda s: {"i": s["json"]["i"], "x": s["pt"]})
            .batch(3)
        ),
        num_workers=num_workers,
    )
    assert report.events > 10


@given(stop=st.integers(0, 26), seed=st.integers(0, 3))
def test_resume_property(shards, stop, seed):
    check_resume(
        lambda: WebDatasetSource(shards, shuffle=True, seed=seed, decode=False),
        stop_points=[stop],
    )


# -- the index command ------------------------------------------------------------------------


def test_index_command_builds_and_keeps_indexes(tmp_path, capsys):
    write_shards(tmp_path / "d", [3, 4])
    assert index_main([str(tmp_path / "d"), "--quiet", "--jobs", "2"]) == 0
    assert "indexed 2 shards (7 samples)" in capsys.readouterr().out
    index = json.loads((tmp_path / "d" / "shard-001.tar.idx.json").read_text())
    assert index["samples"] == 4 and index["keys"][0] == "sub/000003"
    assert index_main([str(tmp_path / "d" / "shard-{000..001}.tar"), "--quiet"]) == 0
    assert "0 shards (0 samples); 2 already had an index" in capsys.readouterr().out
    assert index_main([str(tmp_path / "d"), "--quiet", "--cache-dir", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "indexes" / "shard-000.tar.idx.json").exists()
    source = WebDatasetSource(tmp_path / "d")
    assert len(source) == 7
    assert index_main([str(tmp_path / "nothing"), "--quiet"]) == 1
    assert "neither a .tar shard nor a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        index_main(["--help"])
    assert "Build the member index" in capsys.readouterr().out


def test_a_read_only_directory_gets_its_indexes_in_the_cache(tmp_path):
    write_shards(tmp_path / "ro", [2])
    (tmp_path / "ro").chmod(0o555)
    try:
        source = WebDatasetSource(tmp_path / "ro", cache_dir=tmp_path / "cache")
        assert len(list(source)) == 2
    finally:
        (tmp_path / "ro").chmod(0o755)
    if not (tmp_path / "ro" / "shard-000.tar.idx.json").exists():  # not root
        assert (tmp_path / "cache" / "indexes").is_dir()


# -- damaged input ------------------------------------------------------------------------------


def test_a_truncated_tar_is_named_when_indexing(tmp_path):
    write_shards(tmp_path, [4])
    path = tmp_path / "shard-000.tar"
    data = path.read_bytes()
    for cut in (len(data) // 3, 2048 + 100):
        path.write_bytes(data[:cut])
        with pytest.raises(SourceDataError, match=r"shard-000\.tar .*truncated or damaged"):
            WebDatasetSource(tmp_path)


def test_a_missing_member_is_named(tmp_path):
    write_shards(tmp_path, [3])
    source = WebDatasetSource(tmp_path)
    write_tar(tmp_path / "shard-000.tar", 0, 3, rename={"sub/000001.json": "sub/000001.jsn"})
    with pytest.raises(SourceDataError, match=r"sample 1 \(key 'sub/000001'\): member "):
        list(source)
    with pytest.raises(SourceDataError, match=r"member 'sub/000001\.json' is missing"):
        source.restore_sample((0, 1))


def test_a_shard_damaged_under_a_loader_is_a_worker_error_and_resume_stays_exact(
    tmp_path, no_leftover_processes
):
    write_shards(tmp_path / "d", [6, 6, 6, 6])
    good = tmp_path / "good.tar"
    shutil.copy(tmp_path / "d" / "shard-003.tar", good)

    def build() -> el.SavableDataLoader:
        # One item a trip: the workers read at most prefetch_factor samples ahead, so the
        # shard cut below is still unread when it is cut.
        source = WebDatasetSource(tmp_path / "d", decode=False)
        return el.SavableDataLoader(source, num_workers=2, items_per_transfer=1)

    full, _ = record_events(build(), 1)
    loader = build()
    head, _ = record_events(loader, 1, stop=5)
    state = loader.save_state_rank()
    (tmp_path / "d" / "shard-003.tar").write_bytes(good.read_bytes()[:3000])

    def failure(loader: el.SavableDataLoader) -> str:
        try:
            record_events(loader, 1)
        except WorkerError as error:
            return str(error)
        return "no error"

    message = failure(loader)
    del loader
    gc.collect()
    # Which read trips over the cut depends on how far ahead the worker was.
    assert "SourceDataError" in message and "shard-003.tar" in message
    shutil.copy(good, tmp_path / "d" / "shard-003.tar")
    restored = build()
    restored.restore_state_rank(state)
    tail, _ = record_events(restored, 1)
    del restored
    assert [s["__restore_key__"] for s in head + tail if s is not END] == [
        s["__restore_key__"] for s in full if s is not END
    ]


def test_undecodable_samples_raise_or_are_skipped_and_counted(tmp_path, caplog):
    write_shards(tmp_path, [3])
    source = WebDatasetSource(tmp_path, decode={"txt": lambda data: 1 / 0})
    with pytest.raises(SourceDataError, match=r"sample 0 \(key 'sub/000000'\): cannot decode"):
        list(source)
    skipping = WebDatasetSource(tmp_path, decode={"txt": lambda data: 1 / 0}, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="energy_loader.sources.webdataset"):
        assert list(skipping) == []
    assert skipping.save_state()["skipped"] == 3
    assert "skipped sample (0, 2) (3 so far)" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"shuffle": 1}, TypeError, "`shuffle` must be True or False"),
        ({"seed": -1}, ValueError, "`seed` must be >= 0"),
        ({"num_canonical_partitions": 0}, ValueError, "must be positive"),
        ({"decode": 3}, TypeError, "`decode` must be True, False"),
        ({"decode": {"txt": 3}}, TypeError, "extension: fn"),
        ({"on_error": "ignore"}, ValueError, "`on_error` must be one of"),
        ({"download_timeout": 0}, ValueError, "`download_timeout` must be a positive"),
        ({"storage_options": "x"}, TypeError, "`storage_options` must be a dict"),
        ({"cache_dir": "s3://b/c"}, TypeError, "`cache_dir` must be a local directory"),
    ],
)
def test_bad_arguments(shards, kwargs, error, message):
    with pytest.raises(error, match=message):
        WebDatasetSource(shards, **kwargs)


def test_bad_locations_and_keys(shards, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no \.tar shards"):
        WebDatasetSource(tmp_path)
    with pytest.raises(TypeError, match="`urls_or_dir` must be"):
        WebDatasetSource([])
    with pytest.raises(ValueError, match="local or share one fsspec protocol"):
        WebDatasetSource([str(shards / "shard-000.tar"), "s3://bucket/a.tar"])
    with pytest.raises(ValueError, match="more than once"):
        WebDatasetSource([shards / "shard-000.tar", shards / "shard-000.tar"])
    source = WebDatasetSource(shards)
    for key in [(4, 0), (0, 7), (0,), ("0", 1), (True, 1)]:
        with pytest.raises(ValueError, match=r"restore keys are \(shard, row\)"):
            source.restore_sample(key)
