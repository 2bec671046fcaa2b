"""Model-based properties of the drop-in loader: its run equals torch's DataLoader's, and a
training loop killed and restarted (once or in a chain) equals its own uninterrupted run.

The model is the uninterrupted run of the same setup, run once: a restarted run must hand
out the same batches (keys, values, dtypes) in the same epochs, through three epochs. Setups
are drawn: map-style and iterable datasets (a ``__getitem__`` that draws from python's,
numpy's and torch's global RNGs among them), lengths the batch size divides and not,
``drop_last``, every kind of sampler, 0-3 workers and another count on each restart,
persistent workers, samplers that draw from python's ``random`` or numpy's global RNG.
Save points are drawn among: before the first batch, mid-epoch, an epoch's last batch inside
the loop, after the loop, right after a load before any ``iter()``, and chains of those. The
training loop is the one people write (:mod:`energy_loader.testing.runs`): global RNGs seeded
at program start, every step drawing from them, ``set_epoch`` before each epoch, a restart
that puts torch's global RNG state back, every global RNG's (as careful scripts do), or none, and
whose global RNGs may stand elsewhere even for a state saved before the first ``iter()``
(another model's init drew first). Every restore ends exact, or, where a sampler draws from a
global RNG the restarted program did not put back, refused: never another stream.

A map-style dataset whose data changed between the save and the restore (the same count,
other values: a file edited in place) is refused at every restore that has a batch to re-make,
never continued with the new values.

Ranks are simulated in one process (several ``DistributedSampler(num_replicas=W, rank=r)``
loaders): saved at world size W, restored at W' with the ranks seeded alike, per rank, or not
at all. The model for another W' is the union of the indices per epoch, each index's
augmentation the uninterrupted run's.

``ENERGY_LOADER_HYPOTHESIS=nightly`` runs 500 examples of each property; the default run 12,
CI's slow step 30 of the ranks' property.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import energy_loader as el
from energy_loader.errors import StateMismatchError
from energy_loader.testing.diagnosis import compare_runs, diagnose
from energy_loader.testing.runs import (
    Batch,
    Chain,
    ChainRun,
    SavePoint,
    TrainingLoop,
    load,
    program_start,
    round_trip,
    run_chain,
)

from ..helpers import MODEL_EXAMPLES, SLOW_MODEL_EXAMPLES
from .dropin_helpers import (
    Augmenting,
    Dicts,
    DrawsAtIter,
    NumpyShuffle,
    PythonShuffle,
    Sharded,
    StatefulSampler,
    StatefulSharded,
    assert_same,
    run_epochs,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

EPOCHS = 3
MAP_SAMPLERS = [
    "sequential",
    "shuffle",
    "distributed",
    "weighted",
    "subset",
    "own",
    "stateful",
    "batch_sampler",
    "python",
    "numpy",
    "draws_at_iter",
]
# Samplers whose order torch draws from its global generator (the sampler has no generator of
# its own, nor, for "shuffle", the loader): from the second epoch on the drop-in draws them
# from the job's own stream (docs/loader.md).
DRAW_FROM_GLOBAL = {"weighted", "subset", "batch_sampler", "draws_at_iter"}
# Samplers that draw from python's or numpy's global RNG: exact where the restarted program
# puts every global RNG back, else refused (docs/restores.md).
DRAW_FROM_OTHER_GLOBALS = {"python", "numpy"}
# Where a save point falls (drawn per point of a chain).
WHERE = ["anywhere", "epoch_last_in_loop", "after_loop", "right_after_load"]


@st.composite
def _setups(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["map", "augmenting", "iterable", "stateful_iterable"]))
    iterable = kind.endswith("iterable")
    workers = draw(st.integers(0, 3))
    arguments: dict[str, Any] = {
        "num_workers": workers,
        "persistent_workers": workers > 0 and draw(st.booleans()),
    }
    sampler, generator = None, False
    if not iterable:
        sampler = draw(st.sampled_from(MAP_SAMPLERS))
        generator = draw(st.booleans())
    batch_size = draw(st.sampled_from([None, 1, 2, 3, 5]))
    if sampler == "batch_sampler":
        batch_size = draw(st.sampled_from([1, 2, 3, 5]))
    else:
        arguments["batch_size"] = batch_size
    drop_last = batch_size is not None and draw(st.booleans())
    if sampler != "batch_sampler" and batch_size is not None:
        arguments["drop_last"] = drop_last
    if draw(st.booleans()):  # a length the batch size divides
        length = (batch_size or 1) * draw(st.integers(1, 23 // (batch_size or 1)))
    else:
        length = draw(st.integers(1, 23))
    restarts = draw(st.integers(1, 3))
    return {
        "kind": kind,
        "length": length,
        "arguments": arguments,
        "batch_size": batch_size,
        "drop_last": drop_last,
        "sampler": sampler,
        "generator": generator,
        "where": [draw(st.sampled_from(WHERE)) for _ in range(restarts)],
        "fractions": [draw(st.floats(0, 1)) for _ in range(restarts)],
        "resume_workers": [workers if iterable else draw(st.integers(0, 3)) for _ in range(3)],
        "resume_persistent": draw(st.booleans()),
        "restore_rng": draw(st.sampled_from(["none", "torch", "every"])),
        "move_at_start": draw(st.booleans()),
    }


def _make(
    setup: dict[str, Any], cls: Any, workers: int | None = None, persistent: Any = None
) -> Any:
    arguments = dict(setup["arguments"])
    if workers is not None:
        arguments["num_workers"] = workers
        arguments["persistent_workers"] = bool(persistent) and workers > 0
    length = setup["length"]
    if setup["generator"]:
        arguments["generator"] = torch.Generator().manual_seed(length)
    kind = setup["sampler"]
    if kind == "shuffle":
        arguments["shuffle"] = True
    elif kind == "distributed":
        arguments["sampler"] = DistributedSampler(range(length), num_replicas=2, rank=1, seed=3)
    elif kind == "weighted":
        arguments["sampler"] = WeightedRandomSampler([1.0 + i % 3 for i in range(length)], length)
    elif kind == "subset":
        arguments["sampler"] = SubsetRandomSampler(range(0, length, 2))
    elif kind == "own":
        own = torch.Generator().manual_seed(length + 1)
        arguments["sampler"] = RandomSampler(range(length), generator=own)
    elif kind == "stateful":
        arguments["sampler"] = StatefulSampler(length, seed=length)
    elif kind == "batch_sampler":  # the user's own batching over a sampler of the global RNG
        arguments["batch_sampler"] = BatchSampler(
            RandomSampler(range(length)), setup["batch_size"], setup["drop_last"]
        )
    elif kind == "python":
        arguments["sampler"] = PythonShuffle(length)
    elif kind == "numpy":
        arguments["sampler"] = NumpyShuffle(length)
    elif kind == "draws_at_iter":
        arguments["sampler"] = DrawsAtIter(length)
    dataset = {
        "map": Dicts,
        "augmenting": Augmenting,
        "iterable": Sharded,
        "stateful_iterable": StatefulSharded,
    }[setup["kind"]](length)
    if setup.get("edited"):  # the data changed in place since the save (same count)
        dataset.edit = 0.5
    return cls(dataset, **arguments)


def _set_epoch(loader: Any, epoch: int) -> None:
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)


def _torch_epochs(setup: dict[str, Any]) -> list[Any]:
    """Each epoch's batches from torch's DataLoader and from ours, run the same way."""
    runs = []
    for cls in (DataLoader, el.SavableDataLoader):
        program_start(1)
        loader = _make(setup, cls)
        epochs = []
        for epoch in range(EPOCHS):
            _set_epoch(loader, epoch)
            epochs.append(run_epochs(loader, 1))
        if cls is not DataLoader:
            loader.close()
        runs.append(epochs)
    return runs


def _factory(setup: dict[str, Any]) -> Callable[[int], Any]:
    """``make(num_workers)`` for one run: its first loader as drawn, its restarts with the
    drawn ``persistent_workers``."""
    calls = [0]

    def make(workers: int) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return _make(setup, el.SavableDataLoader)
        return _make(setup, el.SavableDataLoader, workers, setup["resume_persistent"])

    return make


def _chain(setup: dict[str, Any], full: ChainRun) -> Chain:
    """The drawn chain of save points over the uninterrupted run ``full``."""
    total = len(full.batches)
    ends = full.ends or [total]
    points: list[SavePoint] = []
    for where, fraction in zip(setup["where"], setup["fractions"]):
        floor = points[-1] if points else SavePoint(0)
        if where == "right_after_load" and points:
            points.append(floor)
            continue
        if where in ("epoch_last_in_loop", "after_loop"):
            later = [end for end in ends if SavePoint(end, where == "after_loop") >= floor]
            end = later[min(len(later) - 1, int(fraction * len(later)))] if later else total
            point = SavePoint(end, after_loop=where == "after_loop" and bool(later))
        else:
            point = SavePoint(floor.batches + round(fraction * (total - floor.batches)))
        points.append(max(point, floor))
    workers = (setup["arguments"]["num_workers"], *setup["resume_workers"][: len(points)])
    return Chain(tuple(points), workers)


@MODEL_EXAMPLES
@given(_setups())
def test_equal_to_torch_and_a_restarted_loop_equals_the_uninterrupted_one(
    setup: dict[str, Any],
) -> None:
    if setup["kind"] != "augmenting":  # deterministic __getitem__: torch's batches exactly
        theirs, ours = _torch_epochs(setup)
        departs = setup["sampler"] in DRAW_FROM_GLOBAL or (
            setup["sampler"] == "shuffle" and not setup["generator"]
        )
        same = 1 if departs else EPOCHS
        assert_same(ours[:same], theirs[:same])
        assert [len(epoch) for epoch in ours] == [len(epoch) for epoch in theirs]
    workers = setup["arguments"]["num_workers"]
    full = run_chain(_factory(setup), Chain((), (workers,)), EPOCHS)
    chain = _chain(setup, full)
    try:
        got = run_chain(
            _factory(setup),
            chain,
            EPOCHS,
            restore_global_rngs=setup["restore_rng"] == "torch",
            restore_every_global_rng=setup["restore_rng"] == "every",
            move_rngs_at_start=setup["move_at_start"],
        )
    except StateMismatchError as refusal:
        # Refused only where a restart left the RNG its sampler draws from elsewhere.
        moved = setup["move_at_start"] or any(point.batches for point in chain.points)
        may_refuse = (
            setup["sampler"] in DRAW_FROM_OTHER_GLOBALS
            and setup["restore_rng"] != "every"
            and moved
        )
        assert may_refuse, f"{chain}: a legitimate restore was refused: {refusal}"
        assert "global RNG" in str(refusal) or "global `random`" in str(refusal), str(refusal)
        return
    # Where the restarted programs put the global RNGs back, the training's own draws after
    # every batch are the uninterrupted run's too (a model with dropout: the same weights).
    rngs = {"every": ("python", "numpy", "torch"), "torch": ("torch",)}.get(
        setup["restore_rng"], ()
    )
    difference = compare_runs(full.batches, got.batches, rngs=rngs)
    if difference is not None:
        why = diagnose(_factory(setup), chain, EPOCHS, 0, full, got, difference)
        pytest.fail(f"{chain}: {why}")


@MODEL_EXAMPLES
@given(_setups(), st.floats(0, 1))
def test_a_dataset_edited_between_save_and_restore_is_refused(
    setup: dict[str, Any], fraction: float
) -> None:
    """The restarted program's dataset makes other values for the same indices (its files
    were edited in place): the restore of a state saved after any batch is refused, naming
    the values. (A ``Stateful`` sampler that loads its own state re-derives no indices to
    re-make: drawn here as a sampler with its own generator instead.)"""
    kind = "augmenting" if setup["kind"] == "augmenting" else "map"
    sampler = "own" if setup["sampler"] in (None, "stateful") else setup["sampler"]
    setup = {**setup, "kind": kind, "sampler": sampler}
    workers = setup["arguments"]["num_workers"]
    total = EPOCHS * len(_make(setup, DataLoader, 0))  # batches of the uninterrupted run
    if total < 2:  # (a save after the run's last batch has no restore that iterates)
        return
    point = SavePoint(1 + round(fraction * (total - 2)))
    chain = Chain((point,), (workers, setup["resume_workers"][0]))
    calls = [0]

    def make(count: int) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return _make(setup, el.SavableDataLoader)
        edited = {**setup, "edited": True}
        return _make(edited, el.SavableDataLoader, count, setup["resume_persistent"])

    with pytest.raises(StateMismatchError, match="the same indices gave other values"):
        run_chain(make, chain, EPOCHS, restore_every_global_rng=True)


# -- simulated ranks -----------------------------------------------------------------------------

SEEDINGS = ["equal", "per_rank", "none"]


@st.composite
def _rank_setups(draw: st.DrawFn) -> dict[str, Any]:
    old = draw(st.integers(1, 3))
    return {
        "length": draw(st.integers(7, 23)),
        "old": old,
        "new": draw(st.integers(1, 3)),
        "batch_size": draw(st.sampled_from([None, 1, 2, 3])),
        "shuffle": draw(st.booleans()),
        "drop_last": draw(st.booleans()),  # the sampler's
        "seeding": draw(st.sampled_from(SEEDINGS)),
        "unseeded": draw(st.integers(0, 2**30)),  # where an unseeded program's RNGs happen to be
        "workers": draw(st.integers(0, 2)),
        "new_workers": draw(st.integers(0, 2)),
        "where": draw(st.sampled_from(WHERE[:3])),
        "fraction": draw(st.floats(0, 1)),
        "source_rank": draw(st.integers(0, old - 1)),
        "own_states": draw(st.booleans()),
        "via_torch": draw(st.booleans()),
    }


def _rank_seed(setup: dict[str, Any], rank: int, restarted: bool) -> int:
    """The seed a rank's program starts from: the same on every rank, its own per rank
    (``1000 + rank``), or none (each rank's global RNGs wherever they happen to be)."""
    if setup["seeding"] == "equal":
        return 0
    if setup["seeding"] == "per_rank":
        return 1000 + rank
    return setup["unseeded"] + 7919 * rank + (104729 if restarted else 0)


def _rank_loader(setup: dict[str, Any], world: int, rank: int, workers: int) -> Any:
    dataset = Augmenting(setup["length"])
    sampler = DistributedSampler(
        dataset,
        num_replicas=world,
        rank=rank,
        shuffle=setup["shuffle"],
        seed=5,
        drop_last=setup["drop_last"],
    )
    return el.SavableDataLoader(
        dataset, batch_size=setup["batch_size"], sampler=sampler, num_workers=workers
    )


def _samples(batches: list[Batch]) -> list[tuple[int, int, tuple[float, ...]]]:
    """(epoch, index, augmentation) of every sample of the batches."""
    out = []
    for batch in batches:
        value = batch.value
        indices = value["index"]
        if isinstance(indices, torch.Tensor) and indices.dim() == 1:
            for row, index in enumerate(indices.tolist()):
                drawn = (float(value["python"][row]), float(value["numpy"][row]))
                out.append((batch.epoch, index, (*drawn, *value["torch"][row].tolist())))
        else:
            drawn = (float(value["python"]), float(value["numpy"]))
            out.append((batch.epoch, int(indices), (*drawn, *value["torch"].tolist())))
    return out


def _rank_run(
    setup: dict[str, Any], world: int, rank: int, workers: int, stop: SavePoint | None = None
) -> tuple[list[Batch], Any]:
    """One rank's program from the start: to the end, or to ``stop`` (then its state)."""
    program_start(_rank_seed(setup, rank, restarted=False))
    loader = _rank_loader(setup, world, rank, workers)
    out: list[Batch] = []
    loop = TrainingLoop(loader, EPOCHS, out, stop, restored=False)
    stopped = loop.run()
    state = round_trip(loader, setup["via_torch"])[0] if stop is not None else None
    loader.close()
    assert stop is None or stopped, f"rank {rank} never reached {stop}"
    return out, state


# ~30 s for 30 examples (9 loaders each): CI's slow step; test_dropin_elastic.py covers resized
# ranks in the default run.
@pytest.mark.slow
@SLOW_MODEL_EXAMPLES
@given(_rank_setups())
def test_simulated_ranks_resized_keep_every_index_and_its_augmentation(
    setup: dict[str, Any],
) -> None:
    """Simulated ranks have no process group, through which a real job's ranks agree on one
    job seed at the first iter() (tests/test_distributed.py resizes per-rank seeded jobs on
    real gloo ranks): ranks seeded apart here restore each its own state on its own layout."""
    if setup["seeding"] != "equal":
        setup = {**setup, "new": setup["old"], "own_states": True}
    old, new, workers = setup["old"], setup["new"], setup["workers"]
    full = [_rank_run(setup, old, rank, workers)[0] for rank in range(old)]
    total = len(full[0])  # the ranks of a DistributedSampler run in lockstep
    ends = _ends(full[0]) or [total]
    if setup["where"] == "anywhere":
        stop = SavePoint(round(setup["fraction"] * total))
    else:
        end = ends[min(len(ends) - 1, int(setup["fraction"] * len(ends)))]
        stop = SavePoint(end, after_loop=setup["where"] == "after_loop")
    heads, states = zip(*(_rank_run(setup, old, rank, workers, stop) for rank in range(old)))
    tails = []
    for rank in range(new):
        program_start(_rank_seed(setup, rank, restarted=True))
        loader = _rank_loader(setup, new, rank, setup["new_workers"])
        own = new == old and setup["own_states"]
        load(loader, states[rank if own else setup["source_rank"]])
        out = [Batch(-1, number, None) for number in range(stop.batches)]  # (the head's place)
        TrainingLoop(loader, EPOCHS, out, None, restored=True).run()
        loader.close()
        tails.append(out[stop.batches :])
    if new == old:  # the same layout: every rank exactly its own uninterrupted run
        for rank in range(old):
            difference = compare_runs(full[rank], [*heads[rank], *tails[rank]])
            assert difference is None, f"rank {rank}: {difference}"
        return
    reference: dict[tuple[int, int], tuple[float, ...]] = {}
    for epoch, index, drawn in _samples([b for run in full for b in run]):
        known = reference.setdefault((epoch, index), drawn)
        assert known == drawn, f"epoch {epoch} index {index}: two augmentations in one run"
    trained = _samples([b for run in heads for b in run] + [b for run in tails for b in run])
    # The epochs the new layout runs from their start are DistributedSampler's own for W'
    # (with drop_last, the tail dropped to a multiple of W'); an epoch the save cut in two
    # is the saving job's (cut to a multiple of W).
    resumed = _epoch_of(stop, full[0])
    fresh = resumed if stop.batches in [0, *_ends(full[0])] else resumed + 1
    for epoch in range(EPOCHS):
        union = {index for e, index, _ in trained if e == epoch}
        expected = {index for e, index in reference if e == epoch}
        if epoch >= fresh and setup["drop_last"]:
            length = setup["length"]
            assert len(union) == length - length % new and union <= set(range(length))
        else:
            assert union == expected, f"epoch {epoch}: {sorted(union ^ expected)} differ"
    for epoch, index, drawn in trained:
        known = reference.get((epoch, index))
        assert known is None or known == drawn, f"epoch {epoch} index {index}: augmentation"


def _ends(run: list[Batch]) -> list[int]:
    """The batch counts at which an epoch's for loop ended (every epoch has batches here)."""
    return [
        b.number + 1
        for b, after in zip(run, [*run[1:], None])
        if after is None or after.epoch != b.epoch
    ]


def _epoch_of(stop: SavePoint, run: list[Batch]) -> int:
    """The epoch a restore from ``stop`` continues (the next one after an epoch's last batch)."""
    ends = _ends(run)
    return sum(1 for end in ends if end <= stop.batches)
