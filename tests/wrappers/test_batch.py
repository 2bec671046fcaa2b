"""BatchDataset: collation, last partial batch, keys, resume, batch-size change on restore."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import AddNoise, MakeSample
from tests.helpers import WORKERS_0_AND_2, indices


def _pipeline(batch_size: int = 4, drop_last: bool = False, length: int = 22) -> el.BatchDataset:
    source = el.IndexedSource.from_fn(length, MakeSample(), shuffle=True, seed=3)
    return el.BatchDataset(el.MapDataset(source, AddNoise()), batch_size, drop_last=drop_last)


def test_default_collate_stacks_tensors_arrays_and_numbers_and_lists_the_rest() -> None:
    samples = [
        {"t": torch.tensor([i, i]), "a": np.array([i]), "n": i, "s": str(i), "pair": (i, -i)}
        for i in range(3)
    ]
    batch = el.default_collate(samples)
    assert batch["t"].shape == (3, 2)
    assert isinstance(batch["a"], torch.Tensor) and batch["a"].shape == (3, 1)
    assert batch["n"].tolist() == [0, 1, 2] and batch["s"] == ["0", "1", "2"]
    assert [column.tolist() for column in batch["pair"]] == [[0, 1, 2], [0, -1, -2]]
    ragged = el.default_collate([torch.zeros(1), torch.zeros(2)])
    assert isinstance(ragged, list) and len(ragged) == 2


@pytest.mark.parametrize(("drop_last", "sizes"), [(False, [4, 4, 4, 4, 4, 2]), (True, [4] * 5)])
def test_last_partial_batch(drop_last: bool, sizes: list[int]) -> None:
    pipeline = _pipeline(drop_last=drop_last)
    assert [len(b["index"]) for b in pipeline] == sizes
    assert len(pipeline) == len(sizes)


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_exactly_including_the_partial_batch(workers: int) -> None:
    check_resume(lambda: _pipeline(), num_workers=workers, epochs=2)


@pytest.mark.parametrize("workers", [0, 2])
def test_restore_with_a_smaller_batch_size_that_divides_the_saved_one(workers: int) -> None:
    loader = el.SavableDataLoader(_pipeline(8, length=200), num_workers=workers)
    iterator = iter(loader)
    seen = [i for _ in range(7) for i in indices(next(iterator))]
    state = loader.save_state_rank()
    rest_big = [i for batch in iterator for i in indices(batch)]
    smaller = el.SavableDataLoader(_pipeline(4, length=200), num_workers=workers)
    smaller.restore_state_rank(state)
    batches = list(smaller)
    assert all(len(indices(b)) <= 4 for b in batches)
    rest_small = [i for batch in batches for i in indices(batch)]
    if workers == 0:
        assert rest_small == rest_big
    else:
        # Each worker continues its own stream exactly; only the interleaving of workers is
        # by smaller batches now.
        assert sorted(rest_small) == sorted(rest_big)
    assert sorted(seen + rest_small) == list(range(200))


@pytest.mark.parametrize(
    ("partitions", "length", "partial", "full_with_drop_last"),
    [(1, 125, 0, 125), (2, 126, 2, 124), (12, 132, 12, 120)],
)
def test_every_partition_batches_on_its_own(
    partitions: int, length: int, partial: int, full_with_drop_last: int
) -> None:
    # 2,000 samples in batches of 16 (the numbers docs/wrappers.md quotes): P=12 gives 8
    # partitions of 167 samples and 4 of 166, each 10 full batches and one of 7 or 6.
    def loader(drop_last: bool) -> el.SavableDataLoader:
        source = el.IndexedSource.from_fn(2000, MakeSample())
        pipeline = el.BatchDataset(source, 16, drop_last=drop_last)
        return el.SavableDataLoader(pipeline, num_partitions=partitions)

    plain = loader(False)
    sizes = [len(batch["index"]) for batch in plain]
    assert len(plain) == len(sizes) == length
    assert sum(size < 16 for size in sizes) == partial and sum(sizes) == 2000
    dropping = loader(True)
    sizes = [len(batch["index"]) for batch in dropping]
    assert len(dropping) == len(sizes) == full_with_drop_last
    assert set(sizes) == {16}


def test_constructor_rejects_bad_arguments() -> None:
    source = el.IndexedSource.from_fn(3, MakeSample())
    with pytest.raises(ValueError, match="`batch_size` must be positive"):
        el.BatchDataset(source, 0)
    with pytest.raises(TypeError, match="`batch_size` must be an integer"):
        el.BatchDataset(source, 2.0)
    with pytest.raises(TypeError, match="`collate_fn` must be callable"):
        el.BatchDataset(source, 2, collate_fn="stack")
    with pytest.raises(TypeError, match="`drop_last` must be True or False"):
        el.BatchDataset(source, 2, drop_last=None)


def _samples(batch: dict) -> list[tuple[int, float]]:
    """(index, noise) of every sample of a batch: what was made, not only which."""
    return [
        (int(i), round(float(n), 9))
        for i, n in zip(batch["index"].tolist(), batch["noise"].tolist(), strict=True)
    ]


@pytest.mark.timeout(240)
@settings(max_examples=12)
@given(
    length=st.integers(9, 40),
    old=st.sampled_from([4, 6, 8]),
    factor=st.sampled_from([2, "all"]),
    workers=st.sampled_from([0, 2]),
    data=st.data(),
)
def test_a_smaller_batch_size_continues_from_every_save_point_exactly(
    length: int, old: int, factor: object, workers: int, data: st.DataObject
) -> None:
    """Drawn lengths (so that an epoch's short last batch has any size), drawn save points up
    to and including the epoch's last batch: the rest of the epoch and the next one, with the
    smaller batches, are the uninterrupted run's samples, values included (in order without
    workers; per worker's stream with two, so compared as a multiset)."""
    new = old // 2 if factor == 2 else 1
    uninterrupted = el.SavableDataLoader(_pipeline(old, length=length), num_workers=workers)
    epochs = [[s for b in uninterrupted for s in _samples(b)] for _ in range(2)]
    batches = len(uninterrupted)
    step = data.draw(st.integers(0, batches), label="batches before the save")
    saving = el.SavableDataLoader(_pipeline(old, length=length), num_workers=workers)
    iterator = iter(saving)
    before = [s for _ in range(step) for s in _samples(next(iterator))]
    state = saving.save_state_rank()
    saving.close()
    smaller = el.SavableDataLoader(_pipeline(new, length=length), num_workers=workers)
    smaller.restore_state_rank(state)
    rest: list[tuple[int, float]] = []
    if smaller.epoch == 0:  # the saved epoch has items left: this iter() continues it
        rest = [s for b in smaller for s in _samples(b)]
    assert smaller.epoch == 1
    following = [s for b in smaller for s in _samples(b)]
    smaller.close()
    if workers == 0:
        assert before + rest == epochs[0]
        assert following == epochs[1]
    else:
        assert sorted(before + rest) == sorted(epochs[0])
        assert sorted(following) == sorted(epochs[1])
