"""Drop-in restores that depend on the global RNGs: exact, or refused saying what to restore.

1. A state saved before the first ``iter()`` (a checkpoint at step 0) pins the job's start: a
   restarted program whose global RNGs stand elsewhere at its ``iter()`` (another model's
   init drew first) continues the uninterrupted run exactly, and the loader that saved yields
   what it would have yielded without the save.
2. A sampler that draws from python's global ``random`` or numpy's global RNG: exact where the
   restarted program puts that RNG back with the loader's state (before or after
   ``load_state_dict``, before iterating), refused otherwise with a ``StateMismatchError``
   that says so (the restore stays pending: put the RNG back and iterate again).

The programs are training scripts: they seed python's, numpy's and torch's global RNGs at
start, draw from all three at every step, and save the loader's state to a file
(``torch.save`` of ``state_dict()``, or ``json`` of ``save_state_rank()``); a restart builds a
fresh loader (real worker processes or none) and loads that file. The expected batches are
always those of the uninterrupted program.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    WeightedRandomSampler,
    get_worker_info,
)

import energy_loader as el
from energy_loader.errors import StateFormatError, StateMismatchError
from energy_loader.testing.runs import move_global_rngs, program_start, training_step

from .loader.dropin_helpers import (
    Augmenting,
    DrawsAtIter,
    NumpyShuffle,
    PythonShuffle,
    assert_same,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

EPOCHS = 2
LENGTH = 11  # batches of 2: five full and a last one of one index


def _run(loader: Any, out: list[Any], stop: int | None = None, *, after_loop: bool = False) -> None:
    """The loop people write, appending ``(epoch, batch)``; returns early at ``stop`` batches
    in all (right after that batch, or, with ``after_loop``, after the ``for`` loop ended)."""
    while loader.epoch < EPOCHS:
        epoch = loader.epoch
        sampler = loader.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        for batch in loader:
            out.append((epoch, batch))
            training_step()
            if stop is not None and len(out) == stop and not after_loop:
                return
        if stop is not None and len(out) == stop:
            return


def _save(loader: Any, path: Path) -> None:
    """The loader's state into a file: ``torch.save`` of ``state_dict()`` for a ``.pt`` path,
    ``json`` of ``save_state_rank()`` otherwise."""
    if path.suffix == ".pt":
        torch.save(loader.state_dict(), path)
    else:
        path.write_text(json.dumps(loader.save_state_rank()))


def _load(loader: Any, path: Path) -> None:
    if path.suffix == ".pt":
        loader.load_state_dict(torch.load(path, weights_only=True))
    else:
        loader.restore_state_rank(json.loads(path.read_text()))


def _global_rngs() -> tuple[Any, Any, torch.Tensor]:
    """What a careful script's checkpoint keeps of the global RNGs."""
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _put_global_rngs(saved: tuple[Any, Any, torch.Tensor]) -> None:
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


# -- 1. a state saved before the first iter() -----------------------------------------------------


def _shuffled(workers: int) -> el.SavableDataLoader:
    return el.SavableDataLoader(Augmenting(23), batch_size=4, shuffle=True, num_workers=workers)


def _with_generator(workers: int) -> el.SavableDataLoader:
    generator = torch.Generator().manual_seed(7)
    return el.SavableDataLoader(
        Augmenting(23), batch_size=4, shuffle=True, generator=generator, num_workers=workers
    )


def _weighted(workers: int) -> el.SavableDataLoader:
    sampler = WeightedRandomSampler([1.0 + i % 3 for i in range(23)], 23)
    return el.SavableDataLoader(Augmenting(23), batch_size=4, sampler=sampler, num_workers=workers)


def _own_generator(workers: int) -> el.SavableDataLoader:
    sampler = RandomSampler(range(23), generator=torch.Generator().manual_seed(3))
    return el.SavableDataLoader(Augmenting(23), batch_size=4, sampler=sampler, num_workers=workers)


def _draws_at_iter(workers: int, persistent: bool = False) -> el.SavableDataLoader:
    return el.SavableDataLoader(
        Augmenting(23),
        batch_size=None,
        sampler=DrawsAtIter(23),
        num_workers=workers,
        persistent_workers=persistent,
    )


PINNED = {
    "shuffle": _shuffled,
    "generator": _with_generator,
    "weighted": _weighted,
    "own_generator": _own_generator,
    "draws_at_iter": _draws_at_iter,
}


@pytest.mark.parametrize(
    ("kind", "workers", "restore_workers", "suffix"),
    [
        ("shuffle", 0, 2, ".pt"),
        ("shuffle", 2, 0, ".json"),
        ("generator", 0, 0, ".json"),
        pytest.param("weighted", 2, 0, ".pt", marks=pytest.mark.slow),
        ("own_generator", 0, 0, ".pt"),
        ("draws_at_iter", 0, 0, ".json"),
    ],
)
def test_a_state_saved_before_the_first_iter_restores_with_the_global_rngs_moved(
    kind: str, workers: int, restore_workers: int, suffix: str, tmp_path: Path
) -> None:
    """The program saves at step 0 and goes on; the restarted one drew more before iterating:
    both yield what a program that never saved yields (orders and augmentations), and the
    saving program's global torch RNG ends where the one that never saved ends (the save
    changed nothing)."""
    make = PINNED[kind]
    program_start(0)
    never_saved: list[Any] = []
    loader = make(workers)
    _run(loader, never_saved)
    loader.close()
    after_never_saved = torch.get_rng_state()

    program_start(0)
    loader = make(workers)
    state_file = tmp_path / f"state{suffix}"
    _save(loader, state_file)
    saved: list[Any] = []
    _run(loader, saved)
    loader.close()
    assert_same(saved, never_saved)
    assert torch.equal(torch.get_rng_state(), after_never_saved)

    program_start(0)
    move_global_rngs()
    restored = make(restore_workers)
    _load(restored, state_file)
    again: list[Any] = []
    _run(restored, again)
    restored.close()
    assert_same(again, never_saved)


@pytest.mark.parametrize(("workers", "restore_workers"), [(0, 2), (2, 0)])
def test_a_program_that_draws_between_its_save_and_its_first_iter_is_continued_by_its_restore(
    workers: int, restore_workers: int, tmp_path: Path
) -> None:
    """The save pins the job's start: the saving program's first epoch is drawn as the save
    said even though its global torch RNG moved after the save, so that its restore, with
    the RNG elsewhere again, continues it."""
    program_start(0)
    loader = _shuffled(workers)
    _save(loader, tmp_path / "state.pt")
    torch.rand(5)  # e.g. a model built after the checkpoint
    uninterrupted: list[Any] = []
    _run(loader, uninterrupted)
    loader.close()

    program_start(0)
    move_global_rngs()
    restored = _shuffled(restore_workers)
    _load(restored, tmp_path / "state.pt")
    again: list[Any] = []
    _run(restored, again)
    restored.close()
    assert_same(again, uninterrupted)


@pytest.mark.parametrize(
    ("saving", "restoring"), [((2, False), (0, False)), ((0, False), (2, True))]
)
def test_a_sampler_whose_iter_draws_restores_on_another_number_of_workers(
    saving: tuple[int, bool], restoring: tuple[int, bool], tmp_path: Path
) -> None:
    """torch's iterator calls ``iter(sampler)`` twice an epoch where it starts worker processes
    and once without: a restore on another number of workers (or persistent workers) calls it
    as often as the saving job, so a sampler whose ``iter()`` draws draws the job's orders in
    every later epoch."""
    program_start(0)
    uninterrupted: list[Any] = []
    loader = _draws_at_iter(*saving)
    _run(loader, uninterrupted)
    loader.close()
    program_start(0)
    loader = _draws_at_iter(*saving)
    again: list[Any] = []
    _run(loader, again, stop=10)
    _save(loader, tmp_path / "state.json")
    loader.close()
    program_start(0)
    move_global_rngs()
    restored = _draws_at_iter(*restoring)
    _load(restored, tmp_path / "state.json")
    _run(restored, again)
    restored.close()
    assert_same(again, uninterrupted)


def _rank_loader(rank: int) -> el.SavableDataLoader:
    dataset = Augmenting(23)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=5)
    config = el.WorkerConfig(rank=rank, world_size=2)
    return el.SavableDataLoader(dataset, batch_size=3, sampler=sampler, worker_config=config)


def test_ranks_of_a_distributed_sampler_saved_before_the_first_iter_keep_their_augmentations(
    tmp_path: Path,
) -> None:
    """Two ranks (simulated, each seeded its own way) save at step 0; restarted with their
    global RNGs elsewhere, each restores its own file and makes every sample with the
    augmentation the uninterrupted rank made (the job seed is pinned)."""
    for rank in range(2):
        program_start(1000 + rank)
        loader = _rank_loader(rank)
        _save(loader, tmp_path / f"rank{rank}.json")
        uninterrupted: list[Any] = []
        _run(loader, uninterrupted)
        loader.close()

        program_start(1000 + rank)
        move_global_rngs()
        restored = _rank_loader(rank)
        _load(restored, tmp_path / f"rank{rank}.json")
        again: list[Any] = []
        _run(restored, again)
        restored.close()
        assert_same(again, uninterrupted)


def _step_0_warnings(saved_by: int, saver_seed: int, restorer_seed: int, moved: bool) -> list[str]:
    """Rank 0 restores the step-0 ``state_dict()`` of rank ``saved_by`` (seeded
    ``saver_seed``; rank 0 seeded ``restorer_seed``, its generator ``moved`` since): the
    warnings about another rank's step-0 entry at its first iter()."""
    program_start(saver_seed)
    saved = _rank_loader(saved_by).state_dict()
    assert list(saved) == ["rank_any"], "a DistributedSampler's state is any rank's"
    program_start(restorer_seed)
    if moved:
        move_global_rngs()
    restored = _rank_loader(0)
    restored.load_state_dict(saved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(restored))
    restored.close()
    return [str(w.message) for w in caught if "before the first iter() by rank" in str(w.message)]


def test_rank_0_restoring_another_ranks_step_0_entry_warns_where_the_seeds_differ() -> None:
    """A torch.distributed.checkpoint of a step-0 save keeps one rank's ``rank_any`` entry
    (every rank's position is the same), and the job takes rank 0's seed at its first iter().
    Rank 0 restoring rank 1's entry warns where that entry pins another seed than rank 0's
    generator gives (ranks seeded apart), and restores quietly where they seed alike or the
    entry is its own (its generator moved since: the pin restores the job's start)."""
    (warning,) = _step_0_warnings(1, 1001, 1000, moved=False)
    assert "by rank 1 of 2" in warning and "Seed every rank alike" in warning
    assert _step_0_warnings(1, 7, 7, moved=False) == []
    assert _step_0_warnings(0, 1000, 1000, moved=True) == []


class _Drawing(IterableDataset[Any]):
    """An iterable that shards by worker and draws from torch's global generator."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(worker, 12, workers):
            yield {"index": index, "x": torch.rand(2)}


def test_an_iterable_drop_in_saved_before_the_first_iter_restores_with_the_rngs_moved(
    tmp_path: Path,
) -> None:
    """An iterable dataset's copies draw in worker processes seeded per (worker, epoch), not
    from the training process's global RNGs: a step-0 state restores exactly there too."""

    def make() -> el.SavableDataLoader:
        return el.SavableDataLoader(_Drawing(), batch_size=2, num_workers=2)

    program_start(0)
    loader = make()
    _save(loader, tmp_path / "state.pt")
    uninterrupted: list[Any] = []
    _run(loader, uninterrupted)
    loader.close()
    program_start(0)
    move_global_rngs()
    restored = make()
    _load(restored, tmp_path / "state.pt")
    again: list[Any] = []
    _run(restored, again)
    restored.close()
    assert_same(again, uninterrupted)


# -- 2. a sampler drawing from python's or numpy's global RNG -------------------------------------


# The sampler, and the batch size: in batches its draw comes at the batch sampler's first pull;
# unbatched (``batch_size=None``) the loader calls its ``iter()``, which draws.
SAMPLERS: dict[str, tuple[Callable[[], Sampler[int]], int | None]] = {
    "python": (lambda: PythonShuffle(LENGTH), 2),
    "python_at_iter": (lambda: PythonShuffle(LENGTH), None),
    "numpy": (lambda: NumpyShuffle(LENGTH), 2),
}


def _drawing_loader(kind: str, workers: int, **options: Any) -> el.SavableDataLoader:
    sampler, batch_size = SAMPLERS[kind]
    return el.SavableDataLoader(
        Augmenting(LENGTH),
        batch_size=batch_size,
        sampler=sampler(),
        num_workers=workers,
        **options,
    )


def _save_points(kind: str) -> list[tuple[int, bool]]:
    """(batches handed out, after the for loop): mid-epoch 0, its last batch in the loop and
    after it, mid-epoch 1."""
    per_epoch = 6 if SAMPLERS[kind][1] == 2 else LENGTH
    return [(per_epoch // 2, False), (per_epoch, False), (per_epoch, True), (per_epoch + 2, False)]


def _head_and_state(
    kind: str, workers: int, stop: int, after_loop: bool, path: Path
) -> tuple[list[Any], tuple[Any, Any, torch.Tensor]]:
    """The program run to ``stop`` and saved there: its batches and its global RNGs."""
    program_start(0)
    loader = _drawing_loader(kind, workers)
    head: list[Any] = []
    _run(loader, head, stop, after_loop=after_loop)
    _save(loader, path)
    rngs = _global_rngs()
    loader.close()
    return head, rngs


@pytest.mark.parametrize(
    ("kind", "workers"),
    [
        ("python", 0),
        pytest.param("python_at_iter", 0, marks=pytest.mark.slow),
        pytest.param("numpy", 0, marks=pytest.mark.slow),
        pytest.param("python", 2, marks=pytest.mark.slow),
        pytest.param("python_at_iter", 2, marks=pytest.mark.slow),
        pytest.param("numpy", 2, marks=pytest.mark.slow),
    ],
)
def test_a_sampler_drawing_from_a_global_rng_restores_exactly_where_the_program_puts_it_back(
    kind: str, workers: int, tmp_path: Path
) -> None:
    """Saved mid-epoch, at an epoch's last batch (in the loop and after it) and in the next
    epoch; restarted with its global RNGs elsewhere and put back from the checkpoint, before
    or after ``load_state_dict``: every epoch after the restore is the uninterrupted one."""
    program_start(0)
    uninterrupted: list[Any] = []
    loader = _drawing_loader(kind, workers)
    _run(loader, uninterrupted)
    loader.close()
    for number, (stop, after_loop) in enumerate(_save_points(kind)):
        path = tmp_path / f"state{number}{'.pt' if number % 2 else '.json'}"
        head, rngs = _head_and_state(kind, workers, stop, after_loop, path)
        for put_back_first in (True, False):
            program_start(0)
            move_global_rngs()
            restored = _drawing_loader(kind, 0 if workers else 2)
            if put_back_first:
                _put_global_rngs(rngs)
            _load(restored, path)
            if not put_back_first:
                _put_global_rngs(rngs)
            again = list(head)
            _run(restored, again)
            restored.close()
            assert_same(again, uninterrupted)


@pytest.mark.parametrize(("kind", "workers"), [("python", 2), ("python_at_iter", 0), ("numpy", 0)])
def test_a_sampler_drawing_from_a_global_rng_is_refused_where_the_program_left_it_elsewhere(
    kind: str, workers: int, tmp_path: Path
) -> None:
    """The restarted program did not put the RNG back: the first iter() refuses, naming the
    RNG and the call that puts it back, and stays restorable: once the RNG is put back the
    next iter() continues the uninterrupted run."""
    program_start(0)
    uninterrupted: list[Any] = []
    loader = _drawing_loader(kind, workers)
    _run(loader, uninterrupted)
    loader.close()
    stop, after_loop = _save_points(kind)[2]
    head, rngs = _head_and_state(kind, workers, stop, after_loop, tmp_path / "state.pt")

    program_start(0)
    move_global_rngs()
    restored = _drawing_loader(kind, workers)
    _load(restored, tmp_path / "state.pt")
    call = "random.setstate" if kind.startswith("python") else "np.random.set_state"
    what = "python's global `random`" if kind.startswith("python") else "numpy's global RNG"
    with pytest.raises(StateMismatchError, match=f"{what}.*{call}.*verify_restore=False"):
        iter(restored)
    _put_global_rngs(rngs)
    again = list(head)
    _run(restored, again)
    restored.close()
    assert_same(again, uninterrupted)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_state_saved_before_the_first_iter_of_a_python_sampler(
    workers: int, tmp_path: Path
) -> None:
    """Saved at step 0: where the restarted program has python's ``random`` where the save
    found it (a fresh start, or put back), the run is exact; where it drew more first, the
    sampler's first draw from it is refused."""
    program_start(0)
    loader = _drawing_loader("python", workers)
    _save(loader, tmp_path / "state.json")
    rngs = _global_rngs()
    uninterrupted: list[Any] = []
    _run(loader, uninterrupted)
    loader.close()

    program_start(0)
    torch.rand(1)  # only torch's global generator elsewhere: the pin covers it
    restored = _drawing_loader("python", workers)
    _load(restored, tmp_path / "state.json")
    again: list[Any] = []
    _run(restored, again)
    restored.close()
    assert_same(again, uninterrupted)

    program_start(0)
    move_global_rngs()
    restored = _drawing_loader("python", workers)
    _load(restored, tmp_path / "state.json")
    with pytest.raises(StateMismatchError, match="python's global `random`"):
        _run(restored, [])
    restored.close()

    program_start(0)
    move_global_rngs()
    restored = _drawing_loader("python", workers)
    _load(restored, tmp_path / "state.json")
    _put_global_rngs(rngs)
    again = []
    _run(restored, again)
    restored.close()
    assert_same(again, uninterrupted)


def _refused_then_exact(
    restored: Any, rngs: tuple[Any, Any, torch.Tensor], head: list[Any], uninterrupted: list[Any]
) -> None:
    """``restored``'s first iter() refuses (python's ``random`` is elsewhere); with it put back
    from ``rngs``, the run goes on from ``head`` as ``uninterrupted`` did."""
    with pytest.raises(StateMismatchError, match="python's global `random`"):
        iter(restored)
    _put_global_rngs(rngs)
    again = list(head)
    _run(restored, again)
    assert_same(again, uninterrupted)


def test_an_unseeded_python_sampler_saved_at_a_one_index_last_batch_is_always_refused() -> None:
    """An epoch of 11 indices in batches of 2 ends with a batch of one index, which a restore
    that drew another permutation re-makes by chance about once in 11: the proof of the last
    batch alone let a few of these restores through. Python's ``random`` seeded from the OS
    in each program: 40 restores saved at the epoch's end all refuse (the RNG is elsewhere),
    and all continue exactly where the program puts it back."""
    for _ in range(40):
        random.seed()  # an unseeded program
        loader = _drawing_loader("python", 0)
        head: list[Any] = []
        _run(loader, head, 6, after_loop=True)
        state = loader.save_state_rank()
        rngs = _global_rngs()
        uninterrupted = list(head)
        _run(loader, uninterrupted)

        random.seed()  # the restarted program, unseeded too
        restored = _drawing_loader("python", 0)
        restored.restore_state_rank(state)
        _refused_then_exact(restored, rngs, head, uninterrupted)


def test_without_verify_restore_a_moved_rng_continues_unchecked(tmp_path: Path) -> None:
    _head_and_state("python", 0, 6, True, tmp_path / "state.pt")
    program_start(0)
    move_global_rngs()
    restored = _drawing_loader("python", 0, verify_restore=False)
    _load(restored, tmp_path / "state.pt")
    rest: list[Any] = []
    _run(restored, rest)
    assert [epoch for epoch, _ in rest] == [1] * 6


def test_the_saving_loader_warns_when_its_sampler_draws_from_an_rng_moved_after_its_save() -> None:
    """A step-0 save, then python's ``random`` drawn before the first iter(), then a sampler
    that draws its order from it: no restore of that save can draw this order again."""
    program_start(0)
    loader = _drawing_loader("python", 0)
    loader.save_state_rank()
    random.random()
    with pytest.warns(UserWarning, match="moved between the loader's save before this first"):
        next(iter(loader))


def test_edited_global_rng_fields_are_refused_at_load(tmp_path: Path) -> None:
    _head_and_state("python_at_iter", 0, 3, False, tmp_path / "state.json")  # (drew at iter())
    state = json.loads((tmp_path / "state.json").read_text())
    assert set(state["global_rngs"]) == {"python"} and set(state["global_rngs_at_save"]) == {
        "python"
    }
    edited = json.loads(json.dumps(state))
    text = edited["global_rngs"]["python"]["at_iter"]
    edited["global_rngs"]["python"]["at_iter"] = ("B" if text[100] != "B" else "C").join(
        (text[:100], text[101:])
    )
    with pytest.raises(StateFormatError, match=r"state\.global_rngs"):
        _drawing_loader("python_at_iter", 0).restore_state_rank(edited)
    edited = json.loads(json.dumps(state))
    edited["global_rngs_at_save"]["python"] = "0" * 16
    with pytest.raises(StateFormatError, match=r"state\.global_rngs_at_save\b.*state\.digest"):
        _drawing_loader("python_at_iter", 0).restore_state_rank(edited)
    edited = json.loads(json.dumps(state))
    edited["global_rngs"]["python"]["at_iter"] = "not base64!"
    with pytest.raises(StateFormatError, match="base64"):
        _drawing_loader("python_at_iter", 0).restore_state_rank(edited)
