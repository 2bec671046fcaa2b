"""UnbatchDataset: samples and micro-batches from every batch type, exact resume, replay mode."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

import energy_loader as el
from energy_loader.testing import check_resume, samples_equal
from energy_loader.testing.strategies import AddNoise, MakeSample
from energy_loader.wrappers import UnbatchDataset
from energy_loader.wrappers.unbatch import batch_length, take_rows
from tests.helpers import WORKERS_0_AND_2


def _source(length: int = 23, shuffle: bool = True) -> el.IndexedSource:
    return el.IndexedSource.from_fn(length, MakeSample(), shuffle=shuffle, seed=6)


class NoRestoreSource(el.IndexedSource):
    """An IndexedSource that cannot rebuild samples, like a stream that cannot re-fetch."""

    def can_restore_sample(self) -> bool:
        return False

    def restore_sample(self, key: Any) -> Any:
        raise NotImplementedError("this source cannot restore samples")


class NumberedBatches:
    """A producer's log of 9 batches of 1 to 4 rows: batch ``c`` holds rows ``100 * c + i``."""

    def __call__(self, cursor: int) -> dict[str, Any] | None:
        if cursor >= 9:
            return None
        size = 1 + cursor % 4
        return {
            "x": torch.arange(size) + 100 * cursor,
            "id": [f"{cursor}-{i}" for i in range(size)],
        }


class AfterNine:
    def __call__(self, cursor: int) -> bool:
        return cursor >= 9


def _batch(size: int = 7) -> dict[str, Any]:
    return {
        "t": torch.arange(size * 2).reshape(size, 2),
        "a": np.arange(size),
        "l": [f"s{i}" for i in range(size)],
        "pair": (torch.arange(size), [i * 10 for i in range(size)]),
        "nested": {"deep": np.ones((size, 3))},
    }


def test_micro_batches_of_every_batch_type_last_one_smaller() -> None:
    batch = _batch(7)
    pieces = [take_rows(batch, start, min(start + 3, 7)) for start in range(0, 7, 3)]
    assert [batch_length(p) for p in pieces] == [3, 3, 1]
    assert pieces[1]["t"].tolist() == [[6, 7], [8, 9], [10, 11]]
    assert pieces[2]["a"].tolist() == [6] and pieces[2]["l"] == ["s6"]
    assert pieces[1]["pair"][1] == [30, 40, 50]
    assert pieces[0]["nested"]["deep"].shape == (3, 3)


def test_single_samples_lose_the_batch_dimension() -> None:
    sample = take_rows(_batch(7), 4, None)
    assert sample["t"].tolist() == [8, 9] and sample["a"] == 4 and sample["l"] == "s4"
    assert sample["pair"][0].item() == 4 and sample["pair"][1] == 40


def test_pieces_are_copies_that_do_not_pin_the_batch() -> None:
    batch = {"t": torch.zeros(1000, 4), "a": np.zeros((1000, 4))}
    piece = take_rows(batch, 10, 12)
    piece["t"] += 1
    piece["a"] += 1
    assert batch["t"].sum() == 0 and batch["a"].sum() == 0
    assert piece["t"].untyped_storage().nbytes() == 2 * 4 * 4


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_nested_tensors_split_by_component_and_keep_their_layout(layout: torch.layout) -> None:
    parts = [torch.arange(n, dtype=torch.float32) for n in (3, 1, 4, 2, 5)]
    nested = torch.nested.nested_tensor(parts, layout=layout)
    assert batch_length(nested) == 5
    micro = take_rows(nested, 2, 4)
    assert micro.is_nested and micro.layout == layout
    assert [p.tolist() for p in micro.unbind()] == [parts[2].tolist(), parts[3].tolist()]
    assert torch.equal(take_rows(nested, 4, None), parts[4])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_tensordicts_including_nested_tensors(layout: torch.layout) -> None:
    tensordict = pytest.importorskip("tensordict")
    parts = [torch.arange(n) for n in (2, 3, 1, 4)]
    batch = tensordict.TensorDict(
        {
            "x": torch.arange(8).reshape(4, 2),
            "seq": torch.nested.nested_tensor(parts, layout=layout),
            "sub": {"y": torch.arange(4)},
        },
        batch_size=[4],
    )
    dataset = UnbatchDataset(el.IndexedSource([batch]), micro_batch_size=3)
    first, last = (piece for piece in dataset)
    assert isinstance(first, tensordict.TensorDictBase) and first.batch_size == (3,)
    assert last.batch_size == (1,) and last["x"].tolist() == [[6, 7]]
    assert [p.tolist() for p in first["seq"].unbind()] == [p.tolist() for p in parts[:3]]
    assert first["sub", "y"].tolist() == [0, 1, 2]
    single = take_rows(batch, 1, None)
    assert single["x"].tolist() == [2, 3] and single["seq"].tolist() == [0, 1, 2]


def test_batches_whose_parts_disagree_or_cannot_be_split_are_errors() -> None:
    with pytest.raises(ValueError, match=r"disagree on the batch size: \{'a': 3, 'b': 2\}"):
        batch_length({"a": torch.zeros(3), "b": [1, 2]})
    with pytest.raises(ValueError, match="0-d Tensor"):
        batch_length({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"batch\['n'\] is a int"):
        batch_length({"n": 3})


@pytest.mark.parametrize("micro", [None, 1, 3, 4])
def test_unbatching_a_batched_pipeline_gives_back_the_samples(micro: int | None) -> None:
    samples = list(_source())
    batched = UnbatchDataset(el.BatchDataset(_source(), 4), micro_batch_size=micro)
    pieces = list(batched)
    if micro is None:
        assert [p["index"] for p in pieces] == [s["index"] for s in samples]
        batch_key, row = pieces[5][el.RESTORE_KEY]
        assert row == 1 and len(batch_key) == 4
    else:
        assert [i for p in pieces for i in p["index"]] == [s["index"] for s in samples]
        assert all(len(p["index"]) <= micro for p in pieces)
    for piece in pieces:
        rebuilt = batched.restore_sample(piece[el.RESTORE_KEY])
        assert samples_equal(rebuilt, {k: v for k, v in piece.items() if k != el.RESTORE_KEY})


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_micro_batches_of_a_stream_source_resume_exactly(workers: int) -> None:
    stream = pytest.importorskip("energy_loader.sources.stream")

    def build() -> el.SavableDataset:
        source = stream.StreamSource(
            NumberedBatches(), is_exhausted=AfterNine(), poll_interval=0.01
        )
        return UnbatchDataset(source, micro_batch_size=3)

    if workers == 0:
        pieces = list(build())
        assert [p["x"].tolist() for p in pieces[:4]] == [
            [0],
            [100, 101],
            [200, 201, 202],
            [300, 301, 302],
        ]
        assert pieces[4]["x"].tolist() == [303] and pieces[4][el.RESTORE_KEY] == ((3,), 3, 4)
    check_resume(build, num_workers=workers, epochs=2)


def test_state_names_the_batch_and_the_offset() -> None:
    unbatched = UnbatchDataset(el.BatchDataset(_source(), 4), micro_batch_size=3)
    iterator = iter(unbatched)
    first = next(iterator)
    state = json.loads(json.dumps(unbatched.save_state()))
    assert state["offset"] == 3 and state["batch"] == [list(k) for k in first[el.RESTORE_KEY][0]]
    next(iterator)
    assert unbatched.save_state()["batch"] is None


@pytest.mark.parametrize("micro", [None, 3])
@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_is_exact(workers: int, micro: int | None) -> None:
    def build() -> el.SavableDataset:
        batched = el.BatchDataset(el.MapDataset(_source(), AddNoise()), 5)
        return UnbatchDataset(batched, micro_batch_size=micro)

    check_resume(build, num_workers=workers, epochs=2)


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_an_inner_that_cannot_restore_samples_is_replayed(workers: int) -> None:
    def build() -> el.SavableDataset:
        source = NoRestoreSource.from_fn(23, MakeSample(), shuffle=True, seed=2)
        return UnbatchDataset(el.BatchDataset(el.MapDataset(source, AddNoise()), 5), 2)

    assert build().replay
    check_resume(build, num_workers=workers, epochs=2, check_restore_sample=False)


def test_replay_state_holds_the_inner_state_from_before_the_batch() -> None:
    unbatched = UnbatchDataset(el.BatchDataset(NoRestoreSource([10, 11, 12, 13, 14]), 3), 1)
    iterator = iter(unbatched)
    next(iterator)
    next(iterator)
    state = unbatched.save_state()
    assert state["inner"]["phase"] == "fresh" and state["offset"] == 2
    next(iterator)
    assert unbatched.save_state()["batch"] is None
    assert unbatched.save_state()["inner"]["inner"]["position"] == 3
    next(iterator)
    state = unbatched.save_state()
    assert [list(key) for key in state["batch"]] == [[3], [4]]
    assert state["inner"]["inner"]["position"] == 3


def test_constructor_and_restore_keys_are_validated() -> None:
    with pytest.raises(ValueError, match="`micro_batch_size` must be positive"):
        UnbatchDataset(el.BatchDataset(_source(), 2), 0)
    with pytest.raises(TypeError, match="`micro_batch_size` must be an integer"):
        UnbatchDataset(el.BatchDataset(_source(), 2), "2")
    with pytest.raises(ValueError, match=r"\(batch_key, start, stop\)"):
        UnbatchDataset(el.BatchDataset(_source(), 2), 2).restore_sample((((1,),), 0))
