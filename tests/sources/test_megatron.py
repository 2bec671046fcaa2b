"""MegatronIndexedSource on files megatron-core's IndexedDatasetBuilder wrote, against the values
megatron-core's IndexedDataset read from them (tests/sources/fixtures/make_fixtures.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.testing import check_resume

from .helpers import assert_elastic_resume, assert_readers_interleave, keys_of

FIXTURES = Path(__file__).parent / "fixtures" / "megatron"
U16, I32 = str(FIXTURES / "corpus_u16"), str(FIXTURES / "corpus_i32")


@pytest.fixture(scope="module")
def expected() -> dict[str, list[np.ndarray]]:
    """What megatron-core's IndexedDataset returned for each corpus, by sequence number."""
    with np.load(FIXTURES / "expected.npz") as data:
        return {
            name: [data[f"{name}/{i}"] for i in range(int(data[f"{name}/count"]))]
            for name in ("corpus_u16", "corpus_i32")
        }


def _same(a: dict, b: dict) -> None:
    assert a["index"] == b["index"]
    assert a["tokens"].dtype == b["tokens"].dtype
    np.testing.assert_array_equal(a["tokens"], b["tokens"])


@pytest.mark.parametrize("name", ["corpus_u16", "corpus_i32"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_document_once_an_epoch_with_megatron_s_values(expected, name, shuffle):
    source = el.MegatronIndexedSource(FIXTURES / name, shuffle=shuffle, seed=5, block_documents=8)
    documents = expected[name]
    for epoch in range(2):
        got = list(source)
        assert sorted(s["index"] for s in got) == list(range(len(documents))), epoch
        for sample in got:
            reference = documents[sample["index"]]
            assert sample["tokens"].dtype == reference.dtype
            np.testing.assert_array_equal(sample["tokens"], reference)
            restored = source.restore_sample(el.restore_key_of(sample))
            np.testing.assert_array_equal(restored["tokens"], reference)
        if not shuffle:
            assert [s["index"] for s in got] == list(range(len(documents)))
    assert source.dtype == np.uint16 if name == "corpus_u16" else np.int32
    # a document in three pieces is three samples, as IndexedDataset counts them
    assert len(expected["corpus_i32"]) == 25


def test_the_shuffle_permutes_blocks_and_documents_within_them():
    source = el.MegatronIndexedSource(U16, shuffle=True, seed=1, block_documents=10)
    order = keys_of(source)
    blocks = [key[0] // 10 for key in order]
    runs = [block for at, block in enumerate(blocks) if at == 0 or blocks[at - 1] != block]
    assert sorted(runs) == list(range(10))  # a block at a time: local reads
    assert order != sorted(order)
    assert keys_of(el.MegatronIndexedSource(U16, shuffle=True, seed=2, block_documents=10)) != order


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_order_is_the_same_for_any_number_of_readers(shuffle):
    source = el.MegatronIndexedSource(
        U16, shuffle=shuffle, seed=3, block_documents=6, num_canonical_partitions=4
    )
    expected = [(document,) for document in source.global_order(0, 4)]
    assert_readers_interleave(source, expected, [(1, 1), (1, 2), (2, 2), (1, 4)])


def test_the_same_stream_on_other_workers_and_world_sizes_and_exact_elastic_restores():
    def build() -> el.MegatronIndexedSource:
        return el.MegatronIndexedSource(U16, shuffle=True, seed=9, block_documents=8)

    assert_elastic_resume(build, _same, partitions=4, saved=(1, 2), head_steps=13)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact(num_workers, no_leftover_processes):
    report = check_resume(
        lambda: (
            el.MegatronIndexedSource(
                I32, shuffle=True, seed=3, block_documents=4, num_canonical_partitions=2
            )
            .map(lambda s: {"tokens": s["tokens"][:2].astype(np.int64), "index": s["index"]})
            .batch(3, collate_fn=list)
        ),
        num_workers=num_workers,
    )
    assert report.events > 10


@given(stop=st.integers(0, 30), seed=st.integers(0, 3))
def test_resume_property(stop, seed):
    check_resume(
        lambda: el.MegatronIndexedSource(I32, shuffle=True, seed=seed, block_documents=5),
        stop_points=[stop],
    )


def _as_int64(sample: dict) -> np.ndarray:
    return sample["tokens"].astype(np.int64)


def test_the_documented_packing_and_blend_recipe(expected):
    # docs/sources/megatron.md: two corpora blended, documents packed into fixed-length samples
    # of seq_length + 1 tokens (padded), each document whole unless longer than that.
    seq_length, eod = 16, 0
    blend = el.BlendDataset(
        (el.MegatronIndexedSource(U16, shuffle=True, seed=1).map(_as_int64), 0.7),
        (el.MegatronIndexedSource(I32, shuffle=True, seed=1).map(_as_int64), 0.3),
        on_exhausted="drop",
    )
    packed = el.PackingDataset(blend, seq_length + 1, pad_id=eod)
    corpora = [expected["corpus_u16"], expected["corpus_i32"]]
    seen: dict[tuple[int, int], int] = {}
    for pack in packed:
        assert pack["tokens"].shape == (seq_length + 1,)
        bounds = pack["cu_seqlens"].tolist()
        for (key, start, stop), first, last in zip(el.restore_key_of(pack), bounds, bounds[1:]):
            corpus, (document,) = key
            reference = corpora[corpus][document][start:stop].astype(np.int64)
            np.testing.assert_array_equal(pack["tokens"][first:last].numpy(), reference)
            seen[(corpus, document)] = seen.get((corpus, document), 0) + stop - start
    every = {
        (corpus, document): len(tokens)
        for corpus, documents in enumerate(corpora)
        for document, tokens in enumerate(documents)
        if len(tokens)
    }
    assert seen == every  # every non-empty document's tokens, once
    batched = el.SavableDataLoader(packed.map(_tokens_only).batch(4), num_workers=0)
    assert next(iter(batched))["tokens"].shape == (4, seq_length + 1)


def _tokens_only(pack: dict) -> dict:
    return {"tokens": pack["tokens"]}


def test_a_remote_dataset_reads_through_the_cache(expected, tmp_path, no_leftover_processes):
    memory = fsspec.filesystem("memory")
    for suffix in (".bin", ".idx"):
        memory.pipe(
            f"/megatron-test/corpus_u16{suffix}", (FIXTURES / f"corpus_u16{suffix}").read_bytes()
        )
    try:

        def build() -> el.MegatronIndexedSource:
            return el.MegatronIndexedSource(
                "memory://megatron-test/corpus_u16", cache_dir=tmp_path / "cache", shuffle=True
            )

        got = list(el.SavableDataLoader(build(), batch_size=None, num_workers=2))
        assert sorted(s["index"] for s in got) == list(range(97))
        for sample in got:
            np.testing.assert_array_equal(sample["tokens"], expected["corpus_u16"][sample["index"]])
        assert (tmp_path / "cache" / "corpus_u16.bin").stat().st_size == (
            FIXTURES / "corpus_u16.bin"
        ).stat().st_size
        check_resume(build, stop_points=[40])
    finally:
        memory.rm("/megatron-test", recursive=True)


def test_a_truncated_bin_or_idx_is_named(tmp_path):
    for suffix in (".bin", ".idx"):
        shutil.copy(FIXTURES / f"corpus_u16{suffix}", tmp_path / f"corpus_u16{suffix}")
    data = (tmp_path / "corpus_u16.bin").read_bytes()
    (tmp_path / "corpus_u16.bin").write_bytes(data[:-10])
    with pytest.raises(el.SourceDataError, match=r"corpus_u16\.bin is truncated"):
        el.MegatronIndexedSource(tmp_path / "corpus_u16")
    (tmp_path / "corpus_u16.bin").write_bytes(data)
    source = el.MegatronIndexedSource(tmp_path / "corpus_u16")
    (tmp_path / "corpus_u16.bin").write_bytes(data[:100])  # cut after the source was built
    with pytest.raises(el.WorkerError, match=r"corpus_u16\.bin is truncated"):
        list(el.SavableDataLoader(source, batch_size=None, num_workers=1))
    index = (FIXTURES / "corpus_u16.idx").read_bytes()
    (tmp_path / "corpus_u16.idx").write_bytes(index[:-20])
    with pytest.raises(el.SourceDataError, match=r"corpus_u16\.idx is truncated"):
        el.MegatronIndexedSource(tmp_path / "corpus_u16")
    (tmp_path / "corpus_u16.idx").write_bytes(b"NOTANIDX" + index[8:])
    with pytest.raises(el.SourceDataError, match=r"corpus_u16\.idx is not a Megatron index"):
        el.MegatronIndexedSource(tmp_path / "corpus_u16.bin")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"block_documents": 0}, ValueError, "block_documents"),
        ({"seed": -1}, ValueError, "seed"),
        ({"shuffle": "yes"}, TypeError, "shuffle"),
        ({"cache_dir": "s3://x"}, TypeError, "cache_dir"),
        ({"predownload": -1}, ValueError, "predownload"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        el.MegatronIndexedSource(U16, **kwargs)


def test_bad_locations_and_keys(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx does not exist"):
        el.MegatronIndexedSource(tmp_path / "nothing")
    with pytest.raises(TypeError, match="path_prefix"):
        el.MegatronIndexedSource(3)  # type: ignore[arg-type]
    source = el.MegatronIndexedSource(U16)
    for key in [(97,), (-1,), (1, 2), ("0",), (True,)]:
        with pytest.raises(ValueError, match=r"\(document,\)"):
            source.restore_sample(key)
