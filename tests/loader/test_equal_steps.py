"""Equal steps: every rank takes as many steps in every epoch, after any resize, every sample
once (energy_loader/loader/equal_steps.py).

The pure rule is tested directly; the property runs simulated ranks in one process (explicit
``WorkerConfig`` s, as tests/test_elastic.py does) against a model of the uninterrupted job
that uses none of the loader: the ids of an epoch are ``range(length)``, each once. Real
processes (torchrun jobs that train) are in tests/test_training_jobs.py.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.errors import StateMismatchError
from energy_loader.loader.equal_steps import (
    consumed_by,
    piece_bounds,
    pieces_for,
    split_item,
    tally,
)
from energy_loader.loader.partitions import PartitionLayout

from ..helpers import MODEL_EXAMPLES

SEED = 3
EPOCHS = 2


# -- the pure rule -----------------------------------------------------------------------------


@given(st.integers(1, 40), st.integers(0, 200), st.integers(0, 39))
def test_consumed_by_counts_the_visits_of_the_stream(partitions: int, consumed: int, start: int):
    start %= partitions
    position = (start + consumed) % partitions
    visits = [0] * partitions
    for k in range(consumed):  # the stream from `start`: partition (start + k) % P
        visits[(start + k) % partitions] += 1
    assert [consumed_by(p, position, consumed, partitions) for p in range(partitions)] == visits


def test_the_resized_job_of_the_report_is_cut_to_fourteen_steps_each() -> None:
    # 384 samples, batches of 8, 12 partitions of 4 batches; 8 batches consumed on 2 ranks,
    # resumed on 3: 40 batches left, 14 / 13 / 13 by partition, so two ranks cut one each.
    lengths = [4] * 12
    layout = PartitionLayout(12, 3, 0, start=8)
    tallies = [tally(lengths, layout, rank, consumed=8) for rank in range(3)]
    assert [t.items_left for t in tallies] == [14, 13, 13]
    assert [t.items_left + t.extra for t in tallies] == [14, 14, 14]
    assert {t.job_left for t in tallies} == {40}


def test_a_short_rank_cuts_its_last_items_and_its_last_takes_what_is_lacking() -> None:
    assert pieces_for(items_left=10, extra=1, partitions=2) == 1
    assert pieces_for(items_left=3, extra=1, partitions=2) == 2
    assert pieces_for(items_left=1, extra=3, partitions=2) == 4
    assert pieces_for(items_left=1, extra=0, partitions=2) == 1


@given(st.integers(1, 30), st.integers(1, 30))
def test_piece_bounds_cover_the_rows_in_order(rows: int, pieces: int) -> None:
    pieces = min(rows, pieces)
    bounds = piece_bounds(rows, pieces)
    assert [b for a, b in bounds][:-1] == [a for a, b in bounds][1:]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_a_batch_is_cut_with_the_keys_of_its_rows() -> None:
    batch = {"x": torch.arange(5), "__restore_key__": tuple((i,) for i in range(5))}
    first, second = split_item(batch, 2)
    assert first["x"].tolist() == [0, 1, 2] and second["x"].tolist() == [3, 4]
    assert first["__restore_key__"] == ((0,), (1,), (2,))
    assert second["__restore_key__"] == ((3,), (4,))
    assert split_item({"x": torch.arange(1)}, 2) is None  # one row
    assert split_item(7, 2) is None  # not a batch


# -- the property: simulated ranks --------------------------------------------------------------


def _sample(index: int) -> dict[str, Any]:
    return {"id": torch.tensor(index)}


def _loaders(setup: dict[str, Any], world_size: int) -> list[el.SavableDataLoader]:
    out = []
    for rank in range(world_size):
        source = el.IndexedSource.from_fn(setup["length"], _sample, shuffle=True, seed=SEED)
        out.append(
            el.SavableDataLoader(
                el.BatchDataset(source, setup["batch_size"]),
                worker_config=el.WorkerConfig(rank=rank, world_size=world_size, seed=SEED),
                num_partitions=setup["partitions"],
            )
        )
    return out


def _ids(batch: dict[str, Any]) -> list[int]:
    return batch["id"].reshape(-1).tolist()


def _run(loaders: list[el.SavableDataLoader], steps: int | None, log: dict[int, list[Any]]) -> int:
    """Every rank in lockstep, ``steps`` steps (None: to the end of the last epoch), each
    batch appended to ``log[epoch]`` as ``(rank, ids)``; returns the steps taken."""
    taken = 0
    while loaders[0].epoch < EPOCHS and (steps is None or taken < steps):
        epoch = loaders[0].epoch
        iterators = [iter(loader) for loader in loaders]
        while steps is None or taken < steps:
            batches = [next(iterator, None) for iterator in iterators]
            ended = [batch is None for batch in batches]
            assert len(set(ended)) == 1, f"epoch {epoch}: ranks {ended} ended at different steps"
            if ended[0]:
                break
            for rank, batch in enumerate(batches):
                log.setdefault(epoch, []).append((rank, _ids(batch)))
            taken += 1
    return taken


@st.composite
def _setups(draw: st.DrawFn) -> dict[str, Any]:
    partitions = draw(st.sampled_from([4, 6, 12]))
    divisors = [w for w in range(1, partitions + 1) if partitions % w == 0 and w <= 6]
    return {
        "length": draw(st.integers(partitions, 120)),
        "batch_size": draw(st.integers(2, 8)),
        "partitions": partitions,
        "world": draw(st.sampled_from(divisors)),
        "new_world": draw(st.sampled_from(divisors)),
        "fraction": draw(st.floats(0, 1)),
    }


@MODEL_EXAMPLES
@given(_setups())
def test_every_rank_takes_the_same_steps_and_every_sample_comes_once(setup: dict[str, Any]):
    warnings.simplefilter("ignore")  # a batch of one row cannot be cut (checked below)
    full: dict[int, list[Any]] = {}
    total = _run(_loaders(setup, setup["world"]), None, full)
    for batches in full.values():  # the model: every id once per epoch
        assert sorted(i for _, ids in batches for i in ids) == list(range(setup["length"]))
    stop = round(setup["fraction"] * total)

    log: dict[int, list[Any]] = {}
    first = _loaders(setup, setup["world"])
    _run(first, stop, log)
    states = json.loads(json.dumps([loader.save_state_rank() for loader in first]))
    for loader in first:
        loader.close()
    resumed = _loaders(setup, setup["new_world"])
    try:
        for loader in resumed:
            loader.restore_state_global(states)
    except StateMismatchError as refusal:  # only inside a cut item, onto another layout
        assert setup["new_world"] != setup["world"], refusal
        assert "in pieces" in str(refusal)
        return
    if setup["new_world"] == setup["world"]:  # the same layout: exactly the uninterrupted run
        _run(resumed, None, log)
        assert log == full
        return
    try:
        _run(resumed, None, log)
    except AssertionError:
        # Ranks may end apart only where a last batch of one row cannot be cut.
        assert setup["length"] < setup["partitions"] * 2 * setup["batch_size"], setup
        return
    for epoch in range(EPOCHS):
        ids = sorted(i for _, batch in log[epoch] for i in batch)
        assert ids == list(range(setup["length"])), f"epoch {epoch}: not every sample once"


def test_the_reported_resize_on_real_workers_gives_fourteen_steps_each() -> None:
    setup = {"length": 384, "batch_size": 8, "partitions": 12}
    first = _loaders(setup, 2)
    log: dict[int, list[Any]] = {}
    _run(first, 4, log)  # global batch 8
    states = [loader.save_state_rank() for loader in first]
    resumed = [
        el.SavableDataLoader(
            el.BatchDataset(el.IndexedSource.from_fn(384, _sample, shuffle=True, seed=SEED), 8),
            worker_config=el.WorkerConfig(rank=rank, world_size=3, num_workers=2, seed=SEED),
            num_partitions=12,
        )
        for rank in range(3)
    ]
    try:
        for loader in resumed:
            loader.restore_state_global(states)
        counts = [sum(1 for _ in loader) for loader in resumed]
        assert counts == [14, 14, 14]
    finally:
        for loader in resumed:
            loader.close()


@pytest.mark.parametrize("held_back", [0, 1])
def test_a_state_saved_inside_a_cut_item_restores_exactly_on_its_layout(held_back: int):
    # 389 samples: partitions of 5 and 4 batches, rank 1 of 2 lacks a step and cuts one of
    # its last batches; a save at every step of the epoch's tail restores exactly.
    setup = {"length": 389, "batch_size": 8, "partitions": 12, "world": 2}
    full: dict[int, list[Any]] = {}
    total = _run(_loaders(setup, 2), None, full)
    per_epoch = total // EPOCHS
    for stop in range(per_epoch - 8, per_epoch + 1):
        log: dict[int, list[Any]] = {}
        first = _loaders(setup, 2)
        _run(first, stop, log)
        states = [loader.save_state_rank(held_back=held_back) for loader in first]
        if held_back:  # the held-back batch is the saved position's next
            for epoch, batches in log.items():
                log[epoch] = batches[: len(batches) - 2] if epoch == max(log) else batches
        resumed = _loaders(setup, 2)
        for loader in resumed:
            loader.restore_state_global(json.loads(json.dumps(states)))
        _run(resumed, None, log)
        assert log == full, f"stop {stop}"
