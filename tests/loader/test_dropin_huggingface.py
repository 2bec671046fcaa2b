"""The drop-in loader over Hugging Face ``datasets`` objects: a streaming ``IterableDataset``
resumed and run for several epochs after, a map-style ``Dataset`` whose ``set_transform``
draws random numbers restored on other layouts, and a stream that was not split between
ranks."""

from __future__ import annotations

from typing import Any

import datasets
import pytest
from torch.utils.data import DataLoader

import energy_loader as el

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ROWS = 300


def stream() -> datasets.IterableDataset:
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
