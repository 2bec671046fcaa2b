"""Hugging Face datasets: a map-style Dataset through IndexedSource, an IterableDataset through
HuggingFaceIterableSource (its own state_dict kept as plain data)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

import energy_loader as el
from energy_loader import HuggingFaceIterableSource, IndexedSource
from energy_loader.sources.huggingface import to_plain_state
from energy_loader.testing import check_resume
from energy_loader.worker import WorkerContext

if TYPE_CHECKING:
    from datasets import Dataset


def table(n: int = 24) -> Dataset:
    import datasets  # heavy: imported when a test runs, not at collection

    return datasets.Dataset.from_dict({"i": list(range(n)), "text": [f"t{i}" for i in range(n)]})


def test_a_map_style_dataset_is_an_indexed_source(no_leftover_processes):
    data = table()
    source = IndexedSource(data, shuffle=True, seed=3)
    got = list(source)
    assert sorted(s["i"] for s in got) == list(range(24))
    assert source.restore_sample(got[5][el.RESTORE_KEY]) == {k: got[5][k] for k in ("i", "text")}
    check_resume(lambda: IndexedSource(table(), shuffle=True, seed=3).batch(5), num_workers=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_resumes_exactly(num_workers, no_leftover_processes):
    def build() -> el.SavableDataset:
        stream = table().to_iterable_dataset(num_shards=4).shuffle(seed=1, buffer_size=1)
        return HuggingFaceIterableSource(stream)

    report = check_resume(build, num_workers=num_workers, check_restore_sample=False)
    assert report.events == 2 * 25


def test_copies_split_the_stream_and_the_state_is_plain():
    stream = table().to_iterable_dataset(num_shards=4)
    seen: list[Any] = []
    for worker in range(2):
        source = HuggingFaceIterableSource(stream)
        source.bind(WorkerContext(partition=worker, num_partitions=2))
        iterator = source.iter_keyed()
        seen += [sample["i"] for _, sample in [next(iterator), next(iterator)]]
        state = source.save_state()
        assert json.loads(json.dumps(state)) == state and state["count"] == 2
        seen += [sample["i"] for _, sample in iterator]
    assert sorted(seen) == list(range(24))


def test_to_plain_state_converts_or_names_what_it_cannot():
    import numpy as np

    assert to_plain_state({"a": (1, np.int64(2)), "b": np.float32(0.5)}) == {
        "a": [1, 2],
        "b": 0.5,
    }
    with pytest.raises(TypeError, match=r"state_dict\.a\[0\] is a object"):
        to_plain_state({"a": [object()]})


def test_wrong_inputs_are_refused():
    with pytest.raises(TypeError, match="goes through IndexedSource"):
        HuggingFaceIterableSource(table())
    with pytest.raises(TypeError, match=r"needs a datasets\.IterableDataset"):
        HuggingFaceIterableSource([1, 2])
    source = HuggingFaceIterableSource(table().to_iterable_dataset())
    assert not source.can_restore_sample()
    with pytest.raises(TypeError, match="cannot rebuild a sample"):
        source.restore_sample((0, 0))


def _augment(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A set_transform that draws: python random and torch, one draw each a row."""
    import random

    import torch

    return {
        "i": batch["i"],
        "py": [random.random() for _ in batch["i"]],
        "torch": torch.rand(len(batch["i"])).tolist(),
    }


def _augmented(n: int = 60) -> Dataset:
    data = table(n)
    data.set_transform(_augment)
    return data


def _jitter(row: dict[str, Any]) -> dict[str, Any]:
    """A map that draws after the set_transform did (python random and numpy)."""
    import random

    import numpy as np

    return {**row, "map_py": random.random(), "map_np": float(np.random.rand())}


def _pipeline(with_map: bool) -> el.SavableDataset:
    """The set_transform's rows in batches of 4; ``with_map``: through a random map right on
    the source (which shares its seeding with the read) and a shuffle buffer (which rebuilds
    rows from their keys)."""
    source = IndexedSource(_augmented(), shuffle=True, seed=3)
    return source.map(_jitter).shuffle_buffer(8).batch(4) if with_map else source.batch(4)


@pytest.mark.parametrize("with_map", [False, True])
def test_a_set_transform_draws_the_same_after_a_restore_on_other_workers(
    with_map: bool, no_leftover_processes: None
) -> None:
    fields = ("py", "torch", *(("map_py", "map_np") if with_map else ()))

    def loader(workers: int) -> el.SavableDataLoader:
        return el.SavableDataLoader(_pipeline(with_map), num_workers=workers, num_partitions=2)

    def rows(batches: Any) -> dict[int, tuple[float, ...]]:
        return {
            int(i): tuple(float(v) for v in values)
            for batch in batches
            for i, *values in zip(batch["i"], *(batch[f] for f in fields))
        }

    uninterrupted = rows(loader(2))
    assert sorted(uninterrupted) == list(range(60))
    if with_map:  # one seeding, two functions drawing: the read's and the map's differ
        assert all(row[0] != row[2] for row in uninterrupted.values())
    saving = loader(2)
    iterator = iter(saving)
    before = rows(next(iterator) for _ in range(4))
    state = saving.save_state_global()
    del iterator
    saving.close()
    restored = loader(1)  # another worker count: the rows move between processes
    restored.restore_state_global(state)
    rest = rows(restored)
    restored.close()
    assert sorted([*before, *rest]) == list(range(60))
    assert {**before, **rest} == uninterrupted  # every restored row drew what it drew before
    sample = _pipeline(with_map).dataset.restore_sample((7,))  # the row under the batch
    assert tuple(float(sample[f]) for f in fields) == uninterrupted[7]


def test_seeding_defaults_to_dataset_objects_and_stays_out_of_plain_states():
    assert IndexedSource(_augmented()).seed_per_sample
    assert not IndexedSource(list(range(5))).seed_per_sample
    assert not IndexedSource.from_fn(5, lambda i: i).seed_per_sample
    assert "seed_per_sample" not in IndexedSource(list(range(5))).config()
    with pytest.raises(TypeError, match="seed_per_sample"):
        IndexedSource(_augmented(), seed_per_sample=1)  # type: ignore[arg-type]
