"""Datasets, samplers and the resume check shared by the drop-in loader's tests."""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info


class Dicts(Dataset[Any]):
    """Dict samples with a string, a number and a tensor (deterministic); ``edit`` added to
    the tensor makes the data as if its files were rewritten in place (other values, the
    same count)."""

    def __init__(self, length: int, edit: float = 0.0) -> None:
        self.length = length
        self.edit = edit

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        x = torch.full((2,), float(index) + self.edit)
        return {"name": f"s{index}", "index": index, "x": x}


class Augmenting(Dataset[Any]):
    """``__getitem__`` draws from python's, numpy's and torch's global RNGs (``edit``: as
    :class:`Dicts`)."""

    def __init__(self, length: int, edit: float = 0.0) -> None:
        self.length = length
        self.edit = edit

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "python": random.random(),
            "numpy": float(np.random.rand()),
            "torch": torch.rand(2) + self.edit,
        }


class Sharded(IterableDataset[Any]):
    """An iterable that shards by ``get_worker_info()``, as torch's docs show."""

    def __init__(self, length: int) -> None:
        self.length = length

    def _shard(self) -> range:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return range(worker, self.length, workers)

    def __iter__(self) -> Iterator[dict[str, int]]:
        for index in self._shard():
            yield {"index": index}


class StatefulSharded(Sharded):
    """:class:`Sharded` with torchdata's Stateful protocol (its position in its shard)."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.position = 0
        self._resume_at = 0

    def __iter__(self) -> Iterator[dict[str, int]]:
        start, self._resume_at = self._resume_at, 0
        for position, index in enumerate(self._shard()):
            if position < start:
                continue
            self.position = position + 1
            yield {"index": index}

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = state["position"]


class StatefulSampler(Sampler[int]):
    """A shuffling sampler with state_dict()/load_state_dict() (a seed, an epoch, a position)."""

    def __init__(self, length: int, seed: int) -> None:
        self.length, self.seed = length, seed
        self.epoch, self.position, self._resume_at = 0, 0, 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(
            self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        ).tolist()
        start, self._resume_at = self._resume_at, 0
        for position in range(start, self.length):
            self.position = position + 1
            yield order[position]
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._resume_at = state["epoch"], state["position"]


class PythonShuffle(Sampler[int]):
    """Shuffles with python's global ``random`` when ``iter()`` is called (``__iter__`` is not a
    generator): an order the training process's draws move."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.length))
        random.shuffle(order)
        return iter(order)


class NumpyShuffle(Sampler[int]):
    """Draws a permutation from numpy's global RNG at its first pull."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        yield from np.random.permutation(self.length).tolist()


class DrawsAtIter(Sampler[int]):
    """Draws its permutation from torch's global generator when ``iter()`` is called (its
    ``__iter__`` is not a generator): torch's iterator with workers calls it twice an epoch."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.length).tolist())


def distributed_order(n: int, epoch: int, *, seed: int, shuffle: bool = True) -> list[int]:
    """torch's ``DistributedSampler`` order of ``n`` samples in ``epoch``, before padding
    (through a 1-rank sampler): the permutation every layout of a job deals from."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, seed=seed, shuffle=shuffle)
    sampler.set_epoch(epoch)
    return list(sampler)


def dealt_rest(order: list[int], done: int, world: int, rank: int) -> list[int]:
    """The rule of a resized job, computed apart from the loader: rank ``rank`` of ``world``
    takes every ``world``-th of the positions after ``done``, padded from the rest's start
    to a multiple of ``world`` (as ``DistributedSampler`` pads)."""
    rest = order[done:]
    if not rest:
        return []
    per_rank = -(-len(rest) // world)
    padded = (rest * world)[: per_rank * world]
    return padded[rank::world]


def run_epochs(loader: Any, epochs: int) -> list[Any]:
    return [batch for _ in range(epochs) for batch in loader]


def plain_roundtrip(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same(ours: Any, theirs: Any, path: str = "batch") -> None:
    """Same structure, types, dtypes and values."""
    assert type(ours) is type(theirs), f"{path}: {type(ours)} != {type(theirs)}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), f"{path} differs"
    elif isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), path
        for name in theirs:
            assert_same(ours[name], theirs[name], f"{path}[{name!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{path}: {len(ours)} != {len(theirs)} items"
        for index, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{path}[{index}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


def train(
    loader: Any,
    epochs: int,
    out: list[Any],
    *,
    stop: int | None = None,
    set_epoch: Callable[[int], None] | None = None,
) -> Any:
    """A training loop as people write it: every step draws from torch's global generator
    (dropout); ``set_epoch(epoch)`` before each epoch; the epoch is the loader's own (the one
    the next ``iter()`` runs, also after a restore). Appends the batches to ``out``; after
    ``stop`` batches in all returns the saved ``(loader state, torch RNG state)``, else None."""
    while loader.epoch < epochs:
        if set_epoch is not None:
            set_epoch(loader.epoch)
        for batch in loader:
            out.append(batch)
            torch.rand(3)  # the training step's own draws
            if len(out) == stop:
                return plain_roundtrip(loader.state_dict()), torch.get_rng_state()
    return None


def stop_and_resume(
    make: Callable[[int], Any],
    workers: int,
    resume_workers: int,
    stop: int,
    epochs: int,
    *,
    restore_rng: bool = False,
    set_epoch: Callable[[Any, int], None] | None = None,
    resume_make: Callable[[int], Any] | None = None,
) -> None:
    """Run :func:`train` once uninterrupted; then again, killed after ``stop`` batches, and
    restarted as the program starts (``torch.manual_seed(0)``, a fresh loader on
    ``resume_workers`` made by ``resume_make``, default ``make``, then ``load_state_dict``),
    with or without the training process putting its global RNG state back: the batches
    (augmentations included) equal the first run's."""

    def hook(loader: Any) -> Callable[[int], None] | None:
        return None if set_epoch is None else lambda epoch: set_epoch(loader, epoch)

    torch.manual_seed(0)
    uninterrupted: list[Any] = []
    loader = make(workers)
    train(loader, epochs, uninterrupted, set_epoch=hook(loader))
    loader.close()
    torch.manual_seed(0)
    loader = make(workers)
    got: list[Any] = []
    if stop == 0:
        saved = (plain_roundtrip(loader.state_dict()), torch.get_rng_state())
    else:
        saved = train(loader, epochs, got, stop=stop, set_epoch=hook(loader))
    assert saved is not None, f"stop {stop} is past the end of the run"
    loader.close()
    torch.manual_seed(0)  # the program starts again
    restored = (resume_make or make)(resume_workers)
    if restore_rng:
        torch.set_rng_state(saved[1])
    restored.load_state_dict(saved[0])
    if stop:  # (a state saved before the first batch holds no draw: the job starts anew)
        torch.rand(5)  # the restarted program's global RNG is elsewhere than the saving one's
    train(restored, epochs, got, set_epoch=hook(restored))
    restored.close()
    assert_same(got, uninterrupted, f"stop {stop}")


def build_shuffled_loader() -> Any:
    """What a training script's ``--pipeline`` function returns for ``replay``: a drop-in
    loader over a plain dataset (the command reads the dataset and sampling from it)."""
    import energy_loader as el

    return el.SavableDataLoader(Dicts(23), batch_size=4, shuffle=True)


def build_augmenting_loader() -> Any:
    """A ``--pipeline`` function for ``replay --samples``: a drop-in loader over a dataset
    whose ``__getitem__`` draws from python's, numpy's and torch's global RNGs."""
    import energy_loader as el

    return el.SavableDataLoader(Augmenting(23), batch_size=4, shuffle=True)


def build_rank_loader(rank: int, world_size: int) -> Any:
    """A ``--pipeline`` function taking the rank and world size ``replay`` passes: rank
    ``rank``'s loader of ``tests/distributed_helpers.dropin_loader``'s job, built without a
    process group."""
    from torch.utils.data import DistributedSampler

    import energy_loader as el

    dataset = Augmenting(40)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=5)
    return el.SavableDataLoader(dataset, batch_size=3, sampler=sampler)


def build_rank_0_loader() -> Any:
    """A ``--pipeline`` function that always builds rank 0 of 2 (``replay`` resets its
    sampler to the rank asked)."""
    return build_rank_loader(0, 2)


def build_loader_of_the_process_group() -> Any:
    """A ``--pipeline`` function as a training script writes it: the ``DistributedSampler``
    asks the (absent) process group for the rank."""
    from torch.utils.data import DistributedSampler

    import energy_loader as el

    dataset = Augmenting(40)
    sampler = DistributedSampler(dataset, shuffle=True, seed=5)
    return el.SavableDataLoader(dataset, batch_size=3, sampler=sampler)


def build_unseeded_loader() -> Any:
    """``build_shuffled_loader`` with ``seed_per_sample=False``: ``replay --samples`` warns."""
    import energy_loader as el

    return el.SavableDataLoader(Dicts(23), batch_size=4, shuffle=True, seed_per_sample=False)
