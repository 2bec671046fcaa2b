"""The drop-in loader over Hugging Face ``datasets`` objects: a streaming ``IterableDataset``
resumed and run for several epochs after, a map-style ``Dataset`` whose ``set_transform``
draws random numbers restored on other layouts, and a stream that was not split between
ranks."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

import energy_loader as el
from energy_loader.workers.fetch import draws_nothing

from .dropin_helpers import assert_same, run_epochs

if TYPE_CHECKING:
    import datasets

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ROWS = 300


def stream() -> datasets.IterableDataset:
    import datasets  # heavy: imported when a test runs, not at collection

    return datasets.Dataset.from_dict({"id": list(range(ROWS))}).to_iterable_dataset(num_shards=4)


def ids(batches: Any) -> list[int]:
    return [int(i) for batch in batches for i in batch["id"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restored_stream_runs_every_later_epoch_whole(workers: int) -> None:
    # The uninterrupted run is torch's own loader: without set_epoch every epoch is the same.
    epoch = ids(DataLoader(stream(), batch_size=2, num_workers=workers))
    assert sorted(epoch) == list(range(ROWS))

    saving = el.SavableDataLoader(stream(), batch_size=2, num_workers=workers)
    iterator = iter(saving)
    before = ids(next(iterator) for _ in range(60))
    state = saving.state_dict()
    del iterator
    saving.close()

    restored = el.SavableDataLoader(stream(), batch_size=2, num_workers=workers)
    restored.load_state_dict(state)
    assert before + ids(restored) == epoch  # the resumed epoch
    for _ in range(2):  # the epochs after it start at the first row, not at the saved one
        assert ids(restored) == epoch
    restored.close()

    # A chained restart: saved again inside the resumed epoch (the loaded copy's own state).
    again = el.SavableDataLoader(stream(), batch_size=2, num_workers=workers)
    again.load_state_dict(state)
    iterator = iter(again)
    more = ids(next(iterator) for _ in range(30))
    chained = again.state_dict()
    del iterator
    again.close()
    last = el.SavableDataLoader(stream(), batch_size=2, num_workers=workers)
    last.load_state_dict(chained)
    assert before + more + ids(last) == epoch
    assert ids(last) == epoch
    last.close()


def test_a_table_yields_what_torchs_loader_yields() -> None:
    import datasets

    table = datasets.Dataset.from_dict({"x": list(range(10)), "t": [f"s{i}" for i in range(10)]})
    runs = []
    for cls in (DataLoader, el.SavableDataLoader):
        torch.manual_seed(0)
        runs.append(run_epochs(cls(table, batch_size=4, shuffle=True, num_workers=1), 2))
    theirs, ours = runs
    assert_same(ours[:3], theirs[:3])  # epoch 0 (later ones: the job's own shuffle)


def augment(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A ``set_transform`` that draws: python ``random`` and torch, one draw each a row."""
    return {
        "id": batch["id"],
        "py": [random.random() for _ in batch["id"]],
        "torch": torch.rand(len(batch["id"])).tolist(),
    }


def augmented_table(n: int = 40) -> datasets.Dataset:
    import datasets  # heavy: imported when a test runs, not at collection

    table = datasets.Dataset.from_dict({"id": list(range(n))})
    table.set_transform(augment)
    return table


class OneByOne(Dataset[Any]):
    """The same table without ``__getitems__``: torch's fetcher calls ``__getitem__`` per index."""

    def __init__(self, table: datasets.Dataset) -> None:
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> Any:
        return self.table[index]


def augmented_loader(data: Any, batch_size: int, workers: int = 0) -> el.SavableDataLoader:
    torch.manual_seed(0)  # the job seed: every run of the job seeds alike
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    return el.SavableDataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=workers)


def rows(batches: Any) -> dict[int, tuple[float, float]]:
    return {
        int(i): (float(p), float(t))
        for batch in batches
        for i, p, t in zip(batch["id"], batch["py"], batch["torch"])
    }


def test_a_set_transform_draws_the_same_for_a_row_restored_into_another_batch_size() -> None:
    assert hasattr(augmented_table(), "__getitems__")  # why this test exists
    uninterrupted = rows(augmented_loader(augmented_table(), 4))
    assert sorted(uninterrupted) == list(range(40))
    # The __getitem__-only path seeds per index already: the table draws what it draws.
    assert rows(augmented_loader(OneByOne(augmented_table()), 4)) == uninterrupted

    saving = augmented_loader(augmented_table(), 4)
    iterator = iter(saving)
    before = rows(next(iterator) for _ in range(3))
    state = saving.state_dict()
    del iterator
    restored = augmented_loader(augmented_table(), 6, workers=2)
    restored.load_state_dict(state)
    rest = rows(restored)
    restored.close()
    assert sorted([*before, *rest]) == list(range(40))
    assert {**before, **rest} == uninterrupted  # every restored row drew what it drew before


class BatchesOnly(Dataset[Any]):
    """Reads only through ``__getitems__`` (its ``__getitem__`` is torch's stub)."""

    def __init__(self, n: int, *, batched_result: bool = False) -> None:
        self.n = n
        self.batched_result = batched_result

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices: list[int]) -> Any:
        draws = [random.random() for _ in indices]
        if self.batched_result:  # against torch's contract: one batch, not a list of samples
            return {"id": indices, "py": draws}
        return [{"id": i, "py": d, "torch": 0.0} for i, d in zip(indices, draws)]


def test_a_getitems_only_dataset_is_read_one_index_at_a_time_or_refused_by_name() -> None:
    four = rows(augmented_loader(BatchesOnly(24), 4))
    assert sorted(four) == list(range(24))
    assert rows(augmented_loader(BatchesOnly(24), 5)) == four
    with pytest.raises(TypeError, match=r"__getitems__\(\[\d+\]\) returned dict.*seed_per_sample"):
        next(iter(augmented_loader(BatchesOnly(24, batched_result=True), 4)))
    loader = el.SavableDataLoader(
        BatchesOnly(24, batched_result=True),
        batch_size=4,
        collate_fn=lambda b: b,
        seed_per_sample=False,
    )
    assert next(iter(loader))["id"] == [0, 1, 2, 3]  # one call a batch, as torch calls it


@pytest.mark.slow  # ~10-12 s: two rank processes importing datasets; the next test is the cheap one
def test_an_unsplit_stream_on_two_ranks_is_refused_and_a_split_one_trains_in_step(
    tmp_path: Path,
) -> None:
    from tests import distributed_helpers as dh

    from .hf_rank_programs import split_or_refused

    dh.launch(split_or_refused, 2, tmp_path, timeout=120)
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert len(seen[0]["refused"]) == 1 and len(seen[1]["refused"]) == 2
    for refusal in [*seen[0]["refused"], *seen[1]["refused"]]:
        assert "split_dataset_by_node" in refusal
    assert "not split between the ranks" in seen[1]["refused"][0]
    assert "for rank 0 of 2, but the loader runs as rank 1 of 2" in seen[1]["refused"][1]
    # Each rank read its own half; together every row once (a plain-Python oracle).
    assert not set(seen[0]["ids"]) & set(seen[1]["ids"])
    assert sorted(seen[0]["ids"] + seen[1]["ids"]) == list(range(ROWS))


def test_a_stream_split_for_another_layout_is_refused_in_one_process() -> None:
    import datasets.distributed

    split = datasets.distributed.split_dataset_by_node(stream(), rank=1, world_size=2)
    with pytest.raises(ValueError, match="for rank 1 of 2, but the loader runs as rank 0 of 1"):
        el.SavableDataLoader(split, batch_size=2)
    config = el.WorkerConfig(rank=1, world_size=2)
    assert len(ids(el.SavableDataLoader(split, batch_size=2, worker_config=config))) == ROWS // 2
    with pytest.raises(ValueError, match="not split between the ranks"):
        el.SavableDataLoader(stream(), batch_size=2, worker_config=config)


def test_a_table_without_a_transform_is_read_a_batch_a_call_and_a_late_transform_is_seen() -> None:
    import datasets

    table = datasets.Dataset.from_dict({"id": list(range(40))})
    assert draws_nothing(table)  # HF's formats are deterministic: batched reads stay
    assert not draws_nothing(augmented_table())
    assert not draws_nothing(OneByOne(table))
    assert draws_nothing(Subset(table, [3, 1])) and not draws_nothing(Subset(OneByOne(table), [1]))
    late = augmented_loader(table, 4)
    table.set_transform(augment)  # after the loader was built, before it reads
    assert rows(late) == rows(augmented_loader(augmented_table(), 4))
