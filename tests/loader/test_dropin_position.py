"""The drop-in's position, tested directly against torch's own samplers, and the restore's
self-check: a restore re-derives the saving loader's stream, generator draws at an epoch's
end included, or refuses naming the sampler -- never a silent continuation elsewhere."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import energy_loader as el
from energy_loader.errors import StateFormatError, StateMismatchError
from energy_loader.loader.dropin.position import positioned_iterator
from energy_loader.loader.dropin.sampling import EpochStart, SamplerRng
from energy_loader.loader.dropin.state import MapState


def _random(n: int, g: torch.Generator) -> Sampler[int]:
    return RandomSampler(range(n), generator=g)


def _with_replacement(n: int, g: torch.Generator) -> Sampler[int]:
    return RandomSampler(range(n), replacement=True, num_samples=2 * n, generator=g)


def _weighted(n: int, g: torch.Generator) -> Sampler[int]:
    return WeightedRandomSampler([1.0 + i % 3 for i in range(n)], n, generator=g)


def _subset(n: int, g: torch.Generator) -> Sampler[int]:
    return SubsetRandomSampler(list(range(0, 2 * n, 2)), generator=g)


def _sequential(n: int, g: torch.Generator) -> Sampler[int]:
    return SequentialSampler(range(n))


SAMPLERS = [_random, _with_replacement, _weighted, _subset, _sequential]


def _torch_epoch(make: Callable[[], tuple[Any, torch.Generator]]) -> tuple[list[Any], Any]:
    """torch's own: every unit of a ``for`` loop over the sampler, and its generator after."""
    sampler, generator = make()
    units = [unit if isinstance(unit, int) else list(unit) for unit in sampler]
    return units, generator.get_state()


@pytest.mark.parametrize("kind", SAMPLERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("n", [6, 7])
@pytest.mark.parametrize(
    ("batch", "drop_last"), [(None, False), (2, False), (2, True), (3, False), (3, True)]
)
def test_a_position_re_runs_torchs_sampler_to_every_unit_and_its_epoch_end_draws(
    kind: Callable[[int, torch.Generator], Sampler[int]], n: int, batch: int | None, drop_last: bool
) -> None:
    """For every position of an epoch (lengths the batch size divides and not, both
    ``drop_last``): the re-run stream continues with torch's own units, its last re-run unit is
    the one before, and once exhausted the generator stands where torch's ``for`` loop leaves
    it -- the draw of the pull past the last unit included."""

    def make() -> tuple[Any, torch.Generator]:
        generator = torch.Generator().manual_seed(4)
        sampler = kind(n, generator)
        if batch is not None:
            return BatchSampler(sampler, batch, drop_last), generator
        return sampler, generator

    units, end_state = _torch_epoch(make)
    for used in range(len(units) + 1):
        sampler, generator = make()
        rng = SamplerRng(None, sampler)
        start = EpochStart(0, rng.capture(), None)
        replayed = positioned_iterator(sampler, rng, start, used, None, len(sampler))
        rest = [] if replayed.iterator is None else list(replayed.iterator)
        assert [u if isinstance(u, int) else list(u) for u in rest] == units[used:]
        if used:
            last = replayed.last
            assert (last if isinstance(last, int) else list(last)) == units[used - 1]
        assert torch.equal(generator.get_state(), end_state), f"generator after {used} units"


class _Indexed(torch.utils.data.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _batches(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


@pytest.mark.parametrize(
    ("n", "batch", "drop_last"), [(50, 5, False), (45, 5, False), (3, 2, True)]
)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["last batch in the loop", "after the loop"])
def test_a_state_saved_at_an_epochs_end_continues_with_the_uninterrupted_next_epochs(
    n: int, batch: int, drop_last: bool, workers: int, where: str
) -> None:
    """The simplest restart: ``shuffle=True, generator=`` with a length the batch size divides
    (``RandomSampler`` draws once more when pulled past its last index) or ``drop_last`` with
    indices left over; saved at the epoch's last batch, inside the loop or after it."""

    def make(num_workers: int) -> Any:
        generator = torch.Generator().manual_seed(4)
        return el.SavableDataLoader(
            _Indexed(n), batch_size=batch, shuffle=True, generator=generator,
            drop_last=drop_last, num_workers=num_workers,
        )  # fmt: skip

    reference = make(0)
    expected = [_batches(reference) for _ in range(3)]
    saving = make(workers)
    state = None
    for step, _ in enumerate(saving):
        if where == "last batch in the loop" and step == len(saving) - 1:
            state = json.loads(json.dumps(saving.state_dict()))
    if state is None:
        state = json.loads(json.dumps(saving.state_dict()))
    restored = make(2 - workers)
    restored.load_state_dict(state)
    assert restored.epoch == 1
    assert [_batches(restored), _batches(restored)] == expected[1:]


class _ClockOrder(Sampler[int]):
    """Shuffles with a seed the loader cannot see (a new one every run)."""

    runs = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        _ClockOrder.runs += 1
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(_ClockOrder.runs))
        return iter(order.tolist())


class _DrawsAtTheEnd(Sampler[int]):
    """Its own generator's order, then, past the last index, a number of draws that differs
    from run to run: the next epoch's order depends on it."""

    runs = 0

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n = n
        self.generator = generator

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(self.n, generator=self.generator).tolist()
        _DrawsAtTheEnd.runs += 1
        torch.rand(_DrawsAtTheEnd.runs, generator=self.generator)


def test_a_sampler_that_draws_differently_on_restore_is_caught_and_named() -> None:
    """A fault injected on purpose: the restore re-makes another last batch, or other
    generator draws at the epoch's end. Refused naming the sampler; ``verify_restore=False``
    continues from the re-derived position."""
    saving = el.SavableDataLoader(_Indexed(12), batch_size=3, sampler=_ClockOrder(12))
    iterator = iter(saving)
    next(iterator), next(iterator)
    state = saving.state_dict()
    restored = el.SavableDataLoader(_Indexed(12), batch_size=3, sampler=_ClockOrder(12))
    restored.load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"BatchSampler\(_ClockOrder\).*does not replay"):
        iter(restored)
    unchecked = el.SavableDataLoader(
        _Indexed(12), batch_size=3, sampler=_ClockOrder(12), verify_restore=False
    )
    unchecked.load_state_dict(state)
    assert len(_batches(unchecked)) == 2  # the re-derived position: 2 of 4 batches left

    def at_the_end() -> Any:
        sampler = _DrawsAtTheEnd(8, torch.Generator().manual_seed(1))
        return el.SavableDataLoader(_Indexed(8), batch_size=4, sampler=sampler)

    saving = at_the_end()
    _batches(saving)
    state = saving.state_dict()
    restored = at_the_end()
    restored.load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"_DrawsAtTheEnd.*generators then differ"):
        iter(restored)


def test_every_field_that_places_the_stream_is_checked_at_load() -> None:
    """A flipped digit in ``used`` or ``epoch`` is refused by the position digest; a position
    outside the epoch (a foreign state, its digest intact) by the loader's own length."""

    def make() -> Any:
        return el.SavableDataLoader(_Indexed(104), batch_size=4, shuffle=True)

    loader = make()
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    state = loader.save_state_rank()
    for field, value in (("used", 6), ("epoch", 1), ("rank", 1)):
        with pytest.raises(StateFormatError, match=r"state\.digest"):
            make().restore_state_rank({**state, field: value})
    foreign = attrs.evolve(MapState.from_plain(state), used=999).to_plain()
    with pytest.raises(StateMismatchError, match=r"state\.used is 999.*26 batches"):
        make().restore_state_rank(foreign)


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


@pytest.mark.parametrize("kind", ["map-style", "iterable", "pipeline"])
def test_one_epoch_rule_a_restore_at_an_epochs_last_batch_is_in_the_next_epoch(kind: str) -> None:
    """The documented loop ``while loader.epoch < E: for batch in loader`` trains E epochs
    across a restore saved right after an epoch's last batch, whatever the loader runs."""

    def make() -> Any:
        if kind == "map-style":
            return el.SavableDataLoader(_Indexed(10), batch_size=5)
        if kind == "iterable":
            return el.SavableDataLoader(_Stream(), batch_size=5)
        return el.SavableDataLoader(el.IndexedSource(list(range(10))), batch_size=5)

    saving = make()
    for step, _ in enumerate(saving):
        if step == 1:  # the epoch's last batch, its end not pulled yet
            assert saving.epoch == 0
            state = saving.state_dict()
    restored = make()
    restored.load_state_dict(state)
    assert restored.epoch == 1
    trained = []
    while restored.epoch < 3:
        trained += [(restored.epoch, batch.tolist()) for batch in restored]
    assert [epoch for epoch, _ in trained] == [1, 1, 2, 2]
    assert [b for _, b in trained] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]] * 2


def test_a_distributed_state_saved_again_on_another_rank_checks_that_rank() -> None:
    """Any rank's state restores every rank: a restore on rank 1 of rank 0's state, saved
    again before its first batch, carries rank 1's proof, which rank 0 then checks against
    rank 1's dealing (a chained restart through the other rank)."""
    from torch.utils.data import DistributedSampler

    def make(rank: int) -> Any:
        sampler = DistributedSampler(_Indexed(23), num_replicas=2, rank=rank, seed=3)
        return el.SavableDataLoader(_Indexed(23), batch_size=3, sampler=sampler)

    uninterrupted = [_batches(make(rank)) for rank in range(2)]
    saving = make(0)
    iterator = iter(saving)
    next(iterator), next(iterator)
    first = json.loads(json.dumps(saving.state_dict()))
    second_rank = make(1)
    second_rank.load_state_dict(first)
    iterator = iter(second_rank)
    again = json.loads(json.dumps(second_rank.state_dict()))  # before its first batch
    assert [b.tolist() for b in iterator] == uninterrupted[1][2:]
    for rank in range(2):
        restored = make(rank)
        restored.load_state_dict(again)
        assert _batches(restored) == uninterrupted[rank][2:]


def test_a_restored_distributed_epoch_is_the_saved_sampler_epochs_whatever_set_epoch_said() -> None:
    """The resumed epoch continues the permutation of the sampler epoch it was saved in, even
    when the restarted script calls ``set_epoch`` with another number before ``iter()``."""
    from torch.utils.data import DistributedSampler

    def make() -> Any:
        sampler = DistributedSampler(_Indexed(20), num_replicas=2, rank=1, seed=3)
        return el.SavableDataLoader(_Indexed(20), batch_size=3, sampler=sampler)

    loader = make()
    loader.sampler.set_epoch(5)
    expected = _batches(loader)
    saving = make()
    saving.sampler.set_epoch(5)
    iterator = iter(saving)
    next(iterator)
    restored = make()
    restored.load_state_dict(saving.state_dict())
    restored.sampler.set_epoch(0)  # a script that numbers epochs otherwise
    assert _batches(restored) == expected[1:]
