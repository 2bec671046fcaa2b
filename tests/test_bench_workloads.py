"""The benchmarks' real workloads (benchmarks/harness) on tiny data: the cache builder makes what
the docs say, and our llm and vision pipelines resume exactly (sequence for sequence, pixel for
pixel) with 0 and 2 workers."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

pytest.importorskip("tokenizers")

from benchmarks.harness import llm, vision
from benchmarks.harness.data import CLASSES, EOS, PAD, ensure_data, parquet_files, tar_shards
from energy_loader import SavableDataLoader
from energy_loader.testing import check_resume
from tests.helpers import LazyModule

ROOT = Path(__file__).resolve().parents[1]

# pyarrow is imported by the first test that runs, not at collection (LazyModule says why).
pq = LazyModule("pyarrow.parquet")

DOCS = 240
IMAGES = 96


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-cache")


@pytest.fixture(scope="module")
def llm_data(cache):
    return ensure_data(cache, "llm", DOCS, progress=False)


@pytest.fixture(scope="module")
def vision_data(cache):
    return ensure_data(cache, "vision", IMAGES, progress=False)


def test_llm_data_is_parquet_documents_with_row_groups_and_a_tokenizer(llm_data) -> None:
    files = parquet_files(llm_data)
    assert len(files) == 8
    ids, lengths = [], []
    for path in files:
        parquet = pq.ParquetFile(path)
        assert parquet.metadata.num_row_groups >= 2
        table = parquet.read()
        ids += table.column("id").to_pylist()
        lengths += [len(text.split()) for text in table.column("text").to_pylist()]
    assert ids == list(range(DOCS))
    # Log-normal lengths: a long tail well above the median.
    lengths.sort()
    assert lengths[0] >= 8 and lengths[-1] > 3 * lengths[len(lengths) // 2]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(llm_data / "tokenizer.json"))
    text = pq.ParquetFile(files[0]).read().column("text")[0].as_py()
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert {tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)} == {0, 1}


def test_vision_data_is_jpegs_of_256_to_512_pixels_in_tars(vision_data) -> None:
    shards = tar_shards(vision_data)
    assert len(shards) == 8
    keys = []
    for shard in shards:
        assert (vision_data / "tars" / (shard.rsplit("/", 1)[1] + ".idx.json")).exists()
        with tarfile.open(shard) as archive:
            members = {m.name: archive.extractfile(m).read() for m in archive}
        for name, data in members.items():
            key, _, extension = name.partition(".")
            if extension == "jpg":
                keys.append(key)
                picture = Image.open(io.BytesIO(data))
                assert picture.format == "JPEG"
                assert all(256 <= side <= 512 for side in picture.size)
                assert len(data) > 10_000  # grain: not a flat colour
                assert 0 <= int(members[f"{key}.cls"]) < CLASSES
    assert keys == [f"{i:08d}" for i in range(IMAGES)]


def test_the_cache_is_made_once_and_remade_when_incomplete(cache, llm_data) -> None:
    marker = llm_data / "done.json"
    stamp = marker.stat().st_mtime_ns
    assert ensure_data(cache, "llm", DOCS, progress=False) == llm_data
    assert marker.stat().st_mtime_ns == stamp
    small = ensure_data(cache, "llm", 64, progress=False)
    (small / "done.json").unlink()
    (small / "parquet" / "part-00000.parquet").unlink()
    ensure_data(cache, "llm", 64, progress=False)
    assert json.loads((small / "done.json").read_text())["size"] == 64
    assert len(parquet_files(small)) == 8
    with pytest.raises(ValueError, match="choose from llm, vision"):
        ensure_data(cache, "audio", 10)
    with pytest.raises(ValueError, match="positive integer"):
        ensure_data(cache, "llm", 0)


def test_decode_and_augment_is_a_function_of_the_generator(vision_data) -> None:
    with tarfile.open(tar_shards(vision_data)[0]) as archive:
        members = {m.name.partition(".")[2]: archive.extractfile(m).read() for m in archive}
        sample = {"jpg": members["jpg"], "cls": members["cls"]}
    first = vision.decode_and_augment(sample, torch.Generator().manual_seed(5))
    again = vision.decode_and_augment(sample, torch.Generator().manual_seed(5))
    other = vision.decode_and_augment(sample, torch.Generator().manual_seed(6))
    assert first["image"].shape == (3, 224, 224) and first["image"].dtype == torch.uint8
    assert torch.equal(first["image"], again["image"])
    assert not torch.equal(first["image"], other["image"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_llm_pipeline_resumes_sequence_for_sequence(llm_data, workers: int) -> None:
    batches = list(SavableDataLoader(llm.llm_pipeline(llm_data), num_workers=workers))
    assert all(b["tokens"].shape[1] == llm.SEQ_LEN for b in batches)
    real = sum(int(b["lengths"].sum()) for b in batches)
    tokenize = llm.Tokenize(llm.tokenizer_path(llm_data))
    texts = [t for path in parquet_files(llm_data) for t in pq.read_table(path)["text"].to_pylist()]
    assert real == sum(len(tokenize({"text": t})) for t in texts)  # every token, once
    stops = [1, len(batches) // 2, len(batches) - 1]
    report = check_resume(
        lambda: llm.llm_pipeline(llm_data), num_workers=workers, epochs=1, stop_points=stops
    )
    assert report.stop_points == tuple(stops)


@pytest.fixture
def one_thread():
    """Torch ops in the main process on one thread, as in a loader worker (two threads on a
    loaded 2-core machine spend their time waiting for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.timeout(120)
# 2 workers: slow (~3x the in-process run). The vision pipeline resumes pixel for pixel here
# in process; WebDataset shards resume with workers in tests/sources/test_webdataset.py, and
# maps drawing random numbers resume with workers in tests/test_resume_properties.py.
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_vision_pipeline_resumes_pixel_for_pixel(vision_data, workers: int, one_thread) -> None:
    batches = list(SavableDataLoader(vision.vision_pipeline(vision_data), num_workers=workers))
    assert sum(len(b["label"]) for b in batches) == IMAGES
    assert batches[0]["image"].shape[1:] == (3, 224, 224)
    stops = [1, len(batches) + 1]  # mid-epoch, and in the second epoch
    report = check_resume(
        lambda: vision.vision_pipeline(vision_data),
        num_workers=workers,
        epochs=2,
        stop_points=stops,
    )
    assert report.stop_points == tuple(stops)


@pytest.mark.slow  # test_cli runs the bench end to end; the llm pipeline resumes exactly above
@pytest.mark.timeout(280)
def test_bench_loader_runs_the_llm_workload_at_a_tiny_size(cache, llm_data, tmp_path) -> None:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_loader.py"), "--workload", "llm",
        "--samples", str(DOCS), "--repetitions", "1", "--cache", str(cache),
        "--out", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=270)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert set(summary["table"]) == {"plain", "energy_loader+save50"}
    for row in summary["table"].values():
        assert row["samples_per_s"] > 0 and row["cpu_s_per_1000"] > 0 and row["rss_mib"] > 0
    ours = summary["restore"]["energy_loader"]
    assert ours["exact_resume"] is True and set(ours["exact"]) == {"0.1", "0.5", "0.9"}
    assert summary["workload"]["unit"] == "sequences (2,048 real tokens)"
    assert summary["missing"] == {}  # the peers are benchmarks/bench_peers.py's
    assert (tmp_path / "bench.png").exists()
