"""The drop-in loader under a DistributedSampler resumes on another number of ranks or another
batch size: the rest of the epoch's permutation, dealt as DistributedSampler deals.

Ranks are simulated in one process (a DistributedSampler takes ``num_replicas`` and ``rank``);
tests/test_distributed.py runs the same with real gloo ranks. The expected rest is computed
here from torch's own sampler, independently of the loader: the old ranks consumed the first
``steps x batch x W`` positions of the epoch's (unpadded) permutation; the new rank ``r'``
takes every ``W'``-th of the rest from ``r'``, padded from the rest's start to a multiple of
``W'``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

import energy_loader as el
from energy_loader.errors import StateMismatchError

from .dropin_helpers import Augmenting, dealt_rest, distributed_order, plain_roundtrip

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

SEED = 7


def _loader(n: int, world: int, rank: int, batch: int | None, **options: Any) -> Any:
    sampler_options = {k: options.pop(k) for k in ("shuffle", "drop_last") if k in options}
    sampler = DistributedSampler(
        Augmenting(n), num_replicas=world, rank=rank, seed=SEED, **sampler_options
    )
    return el.SavableDataLoader(Augmenting(n), batch_size=batch, sampler=sampler, **options)


def _samples(batch: Any) -> list[tuple[int, float]]:
    """(index, torch augmentation value) per sample of a batch (or of one sample)."""
    if isinstance(batch["index"], torch.Tensor) and batch["index"].dim() == 1:
        return [(int(i), float(v[0])) for i, v in zip(batch["index"], batch["torch"])]
    return [(int(batch["index"]), float(batch["torch"][0]))]


def _epoch(loader: Any, epoch: int) -> list[tuple[int, float]]:
    loader.sampler.set_epoch(epoch)
    return [s for batch in loader for s in _samples(batch)]


def _resize(
    n: int,
    old: int,
    new: int,
    batch: int | None,
    new_batch: int | None,
    steps: int,
    *,
    shuffle: bool = True,
    sampler_drop_last: bool = False,
    workers: int = 0,
    saving_rank: int = 0,
) -> None:
    epoch = 1  # not the first: the sampler's epoch and the job seed both matter
    unit = batch or 1
    # The old job: every rank takes `steps` batches of epoch 1 in lockstep; one rank saves.
    reference: dict[int, float] = {}
    consumed: list[int] = []
    state = None
    for rank in range(old):
        for run in ("reference", "saving"):
            torch.manual_seed(0)  # ranks seeded alike, as trainers seed them
            loader = _loader(n, old, rank, batch, shuffle=shuffle, drop_last=sampler_drop_last)
            _epoch(loader, 0)
            if run == "reference":
                full = _epoch(loader, epoch)
                reference.update(full)
                consumed += [i for i, _ in full[: steps * unit]]
                loader.close()
        loader.sampler.set_epoch(epoch)
        iterator = iter(loader)
        over = steps >= len(loader)  # saved after the epoch's last batch
        for _ in range(min(steps, len(loader))):
            next(iterator)
        if rank == saving_rank:
            state = plain_roundtrip(loader.state_dict())
        loader.close()
    assert state is not None
    order = distributed_order(n, epoch, seed=SEED, shuffle=shuffle)
    if sampler_drop_last:
        order = order[: (n // old) * old]
    done = min(steps * unit, -(-len(order) // old)) * old
    # The new job: each rank restores the one state and finishes the epoch, then the next.
    got: list[int] = []
    for rank in range(new):
        torch.manual_seed(123)  # the restarted program's RNG is elsewhere
        restored = _loader(
            n, new, rank, new_batch, shuffle=shuffle, drop_last=sampler_drop_last,
            num_workers=workers,
        )  # fmt: skip
        restored.load_state_dict(state)
        assert restored.epoch == epoch + over  # the epoch the next iter() runs
        rest = [] if over else _epoch(restored, epoch)
        if new == old and new_batch == batch:  # the same layout: the sampler's own stream
            expected = list(restored.sampler)[steps * unit :]
        else:
            expected = dealt_rest(order, done, new, rank)
        assert [i for i, _ in rest] == expected, f"rank {rank}"
        assert all(reference[i] == value for i, value in rest), "augmentation differs"
        got += [i for i, _ in rest]
        torch.manual_seed(0)
        fresh = _loader(n, new, rank, new_batch, shuffle=shuffle, drop_last=sampler_drop_last)
        _epoch(fresh, 0)
        _epoch(fresh, epoch)
        assert _epoch(restored, epoch + 1) == _epoch(fresh, epoch + 1), "the next epoch"
        restored.close()
    # Nothing lost, nothing repeated but DistributedSampler's padding.
    trained = set(order) if sampler_drop_last else set(range(n))
    assert set(consumed) | set(got) >= trained
    repeats = len(consumed) + len(got) - len(trained)
    assert repeats < old + new


@settings(max_examples=max(25, settings().max_examples))
@given(
    n=st.integers(1, 40),
    old=st.integers(1, 4),
    new=st.integers(1, 4),
    batch=st.sampled_from([None, 1, 2, 3, 4, 8]),
    new_batch=st.sampled_from([1, 2, 3, 4, 8]),
    step_fraction=st.floats(0, 1),
    shuffle=st.booleans(),
    sampler_drop_last=st.booleans(),
)
def test_a_resized_job_deals_the_rest_of_the_epoch_and_the_next_is_the_samplers(
    n: int,
    old: int,
    new: int,
    batch: int | None,
    new_batch: int,
    step_fraction: float,
    shuffle: bool,
    sampler_drop_last: bool,
) -> None:
    if sampler_drop_last and n < max(old, new):
        return  # (DistributedSampler's drop_last leaves a rank nothing)
    per_rank = -(-n // old) if not sampler_drop_last else n // old
    units = -(-per_rank // (batch or 1))
    steps = round(step_fraction * units)
    _resize(n, old, new, batch, None if batch is None else new_batch, steps,
            shuffle=shuffle, sampler_drop_last=sampler_drop_last)  # fmt: skip


@pytest.mark.parametrize(
    ("old", "new", "batch", "new_batch"),
    [(2, 1, 4, 4), (2, 3, 4, 4), (2, 4, 8, 4), (4, 2, 4, 8), (3, 2, 4, 4)],
)
def test_resizes_with_workers(old: int, new: int, batch: int, new_batch: int) -> None:
    _resize(23, old, new, batch, new_batch, steps=2, workers=2, saving_rank=old - 1)


def test_a_resized_epoch_saved_again_continues_its_dealing() -> None:
    """2 ranks -> 3 ranks, saved mid-way, -> 1 rank: still the permutation once."""
    n, epoch = 29, 0
    order = distributed_order(n, epoch, seed=SEED)
    state = None
    seen: list[int] = []
    for rank in range(2):
        loader = _loader(n, 2, rank, 2)
        loader.sampler.set_epoch(epoch)
        iterator = iter(loader)
        seen += [i for _ in range(3) for i in next(iterator)["index"].tolist()]
        state = plain_roundtrip(loader.state_dict())
    second = None
    for rank in range(3):
        loader = _loader(n, 3, rank, 3)
        loader.load_state_dict(state)
        loader.sampler.set_epoch(epoch)
        iterator = iter(loader)
        seen += next(iterator)["index"].tolist()
        second = plain_roundtrip(loader.state_dict())
    last = _loader(n, 1, 0, 5)
    last.load_state_dict(second)
    seen += [i for i, _ in _epoch(last, epoch)]
    assert sorted(seen) == sorted(order) and len(seen) == n  # 12 + 9 + 8: no padding needed


def test_what_cannot_be_continued_is_refused_by_name() -> None:
    loader = _loader(20, 2, 0, 4)
    loader.sampler.set_epoch(0)
    next(iter(loader))
    state = plain_roundtrip(loader.state_dict())
    with pytest.raises(StateMismatchError, match="dataset_length"):
        _loader(21, 3, 0, 4).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="seed"):
        sampler = DistributedSampler(Augmenting(20), num_replicas=3, rank=0, seed=SEED + 1)
        el.SavableDataLoader(Augmenting(20), batch_size=4, sampler=sampler).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="shuffle"):
        _loader(20, 3, 0, 4, shuffle=False).load_state_dict(state)


def test_a_resized_epoch_saved_after_its_last_batch_restores_into_the_next() -> None:
    """2 ranks -> 3 ranks, which finish the epoch and save, -> 1, 2 or 3 ranks: the restore
    runs epoch 1 (loader.epoch says so), the sampler's own for that layout. The resized
    epoch's last batch is not the saving layout's ``len()``-th."""
    n = 13
    for rank in range(2):
        torch.manual_seed(0)  # the job seed, as the fresh job below has it
        loader = _loader(n, 2, rank, 2)
        loader.sampler.set_epoch(0)
        next(iter(loader))
        state = plain_roundtrip(loader.state_dict())
    for rank in range(3):
        loader = _loader(n, 3, rank, 2)
        loader.load_state_dict(state)
        assert [i for i, _ in _epoch(loader, loader.epoch)] == dealt_rest(
            distributed_order(n, 0, seed=SEED), 4, 3, rank
        )
        assert loader.epoch == 1
        finished = plain_roundtrip(loader.state_dict())
    for world in (1, 2, 3):
        torch.manual_seed(0)
        fresh = _loader(n, world, 0, 2)
        _epoch(fresh, 0)
        restored = _loader(n, world, 0, 2)
        restored.load_state_dict(finished)
        assert restored.epoch == 1, world
        assert _epoch(restored, 1) == _epoch(fresh, 1), world
