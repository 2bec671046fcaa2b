"""A pipeline's restore checks itself: a state of another stream is refused, never continued.

Each partition's state carries the digest of the restore key of the last item it handed out
(the proof), and the replay from its checkpoint must re-make that item; the fields that place
the stream are covered by digests; the rank states of one save must agree on the seed and on
their position. The oracle of each test is the uninterrupted run or a state edited by hand.
"""

from __future__ import annotations

import copy
import json
import secrets
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.state.digests import content_digest, key_digest
from energy_loader.testing.strategies import AddNoise, MakeSample
from tests.helpers import MODEL_EXAMPLES, indices, reference_pipeline, saved_at

# What the filter keeps: a module global, so a test can change the pipeline's behaviour between
# the saving run and the restoring one without changing its config (as edited code would).
_KEEP = {"modulus": 3}


def _kept(sample: dict) -> bool:
    return sample["index"] % _KEEP["modulus"] != 0


def _coin(sample: dict) -> bool:
    return secrets.randbelow(2) == 0  # from the OS: no seed makes it repeat


def _filtered(predicate) -> el.SavableDataset:
    source = el.IndexedSource.from_fn(240, MakeSample(), shuffle=True, seed=3)
    return el.BatchDataset(el.FilterDataset(source, predicate), batch_size=4)


def _loader(pipeline: el.SavableDataset, workers: int) -> el.SavableDataLoader:
    # Rolling checkpoints every 8 items only (none by time, which a loaded machine would add
    # at random points): a save after 9 or 11 items has items to replay, to re-make the last.
    return el.SavableDataLoader(
        pipeline, num_workers=workers, checkpoint_every_n_samples=8, checkpoint_every_sec=None
    )


@pytest.fixture(autouse=True)
def _restore_the_filter():
    yield
    _KEEP["modulus"] = 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_filter_that_changed_since_the_save_is_refused_before_any_new_item(workers) -> None:
    state, rest = saved_at(_loader(_filtered(_kept), workers), 11)
    assert any(p["skip"] and p["last"] for p in state["partitions"])  # something to re-make
    _KEEP["modulus"] = 5
    changed = _loader(_filtered(_kept), workers)
    changed.restore_state_rank(state)
    with pytest.raises(el.StateMismatchError, match="not the one the saving loader handed out"):
        next(iter(changed))
    # The same pipeline as saved continues exactly, in a fresh loader and in the refused one.
    _KEEP["modulus"] = 3
    for loader in (_loader(_filtered(_kept), workers), changed):
        loader.restore_state_rank(state)
        assert [indices(batch) for batch in loader] == rest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("steps", [11, 12])
def test_a_worker_refusal_names_the_logical_worker_and_torchs_process_alike(steps) -> None:
    """After a restore torch's worker process p runs logical worker (p + rotation) % W: the
    message names the logical worker, and torch's process number beside it when they differ
    (it used to say "worker 1 ... worker process 0")."""
    import re

    state, _ = saved_at(_loader(_filtered(_kept), 2), steps)
    _KEEP["modulus"] = 5
    changed = _loader(_filtered(_kept), 2)
    changed.restore_state_rank(state)
    with pytest.raises(el.WorkerError) as caught:
        next(iter(changed))
    message = str(caught.value)
    logical = caught.value.worker_id
    physical = int(re.search(r"worker process (\d+)", message).group(1))
    assert message.startswith(f"worker {logical}")
    if logical != physical:
        assert f"worker {logical} (torch's worker process {physical})" in message


def test_verify_restore_false_continues_a_changed_filter_without_the_check() -> None:
    """The opt-out: the restore replays and continues from the re-derived position, with the
    changed filter's items (what the user asked for), instead of refusing."""
    state, _ = saved_at(_loader(_filtered(_kept), 0), 11)
    _KEEP["modulus"] = 5
    unchecked = el.SavableDataLoader(
        _filtered(_kept),
        checkpoint_every_n_samples=8,
        checkpoint_every_sec=None,
        verify_restore=False,
    )
    unchecked.restore_state_rank(state)
    batches = [indices(batch) for batch in unchecked]
    assert batches, "the restored epoch continues"
    assert all(index % 5 != 0 for batch in batches for index in batch)  # the changed filter


def test_verify_restore_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="verify_restore"):
        el.SavableDataLoader(_filtered(_kept), verify_restore="no")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ["state_dict", "rank_file"])
def test_the_proof_is_checked_through_every_entry_point(entry, tmp_path) -> None:
    # The same refusal whichever way the state travelled: DCP's leaves (state_dict) or a file.
    loader = _loader(_filtered(_kept), 2)
    iterator = iter(loader)
    for _ in range(11):
        next(iterator)
    if entry == "state_dict":
        saved = json.loads(json.dumps(loader.state_dict()))
    else:
        el.save_state_rank_file(loader, tmp_path)
    loader._shutdown_workers()
    _KEEP["modulus"] = 5
    changed = _loader(_filtered(_kept), 2)
    if entry == "state_dict":
        changed.load_state_dict(saved)
    else:
        el.restore_state_rank_file(changed, tmp_path)
    with pytest.raises(el.StateMismatchError, match="not the one the saving loader handed out"):
        next(iter(changed))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1])
def test_a_filter_that_draws_from_the_os_is_refused(workers) -> None:
    # Saved 3 batches after a checkpoint: the replay re-makes them from ~24 coin flips, which
    # all come out as before about once in 16 million runs (after 1 batch, about 1 in 256).
    state, _ = saved_at(_loader(_filtered(_coin), workers), 11)
    assert any(p["skip"] >= 3 and p["last"] for p in state["partitions"])
    again = _loader(_filtered(_coin), workers)
    again.restore_state_rank(state)
    with pytest.raises(el.StateMismatchError, match="depends on something besides the sample"):
        list(again)


def _slow(sample: dict) -> dict:
    time.sleep(0.002)
    return sample


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_restore_re_makes_the_last_item_even_when_a_checkpoint_follows_every_item(
    workers,
) -> None:
    # Items slower than checkpoint_every_sec: a time-based checkpoint follows nearly every
    # item, so each partition is placed from the one before its last item, to re-make it.
    def build() -> el.SavableDataLoader:
        source = el.IndexedSource.from_fn(200, MakeSample(), shuffle=True, seed=3)
        pipeline = el.BatchDataset(el.FilterDataset(el.MapDataset(source, _slow), _kept), 4)
        return el.SavableDataLoader(pipeline, num_workers=workers, checkpoint_every_sec=0.001)

    state, rest = saved_at(build(), 11)
    assert all(p["skip"] >= 1 and p["last"] for p in state["partitions"]), state["partitions"]
    loader = build()
    loader.restore_state_rank(state)
    assert [indices(batch) for batch in loader] == rest
    _KEEP["modulus"] = 5
    changed = build()
    changed.restore_state_rank(state)
    with pytest.raises(el.StateMismatchError, match="not the one the saving loader handed out"):
        next(iter(changed))


def test_the_proof_is_the_key_and_the_values_of_the_last_item_each_partition_handed_out() -> None:
    loader = el.SavableDataLoader(reference_pipeline(200, 8, 4), num_partitions=2)
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(5)]
    state = loader.save_state_rank()
    # One worker takes its two partitions in turn: batches 0, 2, 4 from one, 1, 3 the other.
    lasts = {p["partition"]: p["last"] for p in state["partitions"]}
    assert lasts == {
        0: key_digest(batches[4]["__restore_key__"]),
        1: key_digest(batches[3]["__restore_key__"]),
    }
    # ``made`` is the digest of the values as made, before the loader attached the restore key.
    made = {p["partition"]: p["made"] for p in state["partitions"]}
    values = [{k: v for k, v in batch.items() if k != "__restore_key__"} for batch in batches]
    assert made == {0: content_digest(values[4]), 1: content_digest(values[3])}


def test_a_restored_loader_saved_again_keeps_the_proof_and_checks_it_again() -> None:
    state, rest = saved_at(_loader(_filtered(_kept), 0), 11)
    restored = _loader(_filtered(_kept), 0)
    restored.restore_state_rank(state)
    again = restored.save_state_rank()  # before any item: the restored position itself
    assert [p["last"] for p in again["partitions"]] == [p["last"] for p in state["partitions"]]
    _KEEP["modulus"] = 5
    changed = _loader(_filtered(_kept), 0)
    changed.restore_state_rank(again)
    with pytest.raises(el.StateMismatchError):
        next(iter(changed))
    _KEEP["modulus"] = 3
    fresh = _loader(_filtered(_kept), 0)
    fresh.restore_state_rank(again)
    assert [indices(batch) for batch in fresh] == rest


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update(delivered=s["delivered"] + 1), r"checks\.position does not match"),
        (lambda s: s.update(epoch=1), r"checks\.position does not match"),
        (lambda s: s.update(seed=1), r"checks\.position does not match"),
        (
            lambda s: s["workers"][0].update(next=1 - s["workers"][0]["next"]),
            r"checks\.position does not match",
        ),
        (lambda s: s["partitions"][0].update(skip=2), r"partitions\[0\]\.check does not match"),
        (
            lambda s: s["partitions"][0]["checkpoint"]["inner"].update(counter=1),
            r"partitions\[0\]\.check does not match",
        ),
        (
            lambda s: s["partitions"][0].update(last="0" * 16),
            r"partitions\[0\]\.check does not match",
        ),
    ],
)
def test_a_field_that_places_the_stream_edited_after_the_save_is_refused(edit, message) -> None:
    loader = el.SavableDataLoader(reference_pipeline(200, 8, 4), num_partitions=2)
    state, rest = saved_at(loader, 7)
    edited = copy.deepcopy(state)
    edit(edited)
    fresh = el.SavableDataLoader(reference_pipeline(200, 8, 4), num_partitions=2)
    with pytest.raises(el.StateFormatError, match=message):
        fresh.restore_state_rank(edited)
    fresh.restore_state_rank(state)
    assert [indices(batch) for batch in fresh] == rest


def _ranks(world: int, seeds, steps: int) -> list[dict]:
    states = []
    for rank in range(world):
        config = el.WorkerConfig(rank=rank, world_size=world, seed=seeds[rank])
        loader = el.SavableDataLoader(reference_pipeline(200, 8, 4), worker_config=config)
        states.append(saved_at(loader, steps[rank])[0])
    return states


def _one_rank(seed: int = 0) -> el.SavableDataLoader:
    config = el.WorkerConfig(rank=0, world_size=1, seed=seed)
    return el.SavableDataLoader(reference_pipeline(200, 8, 4), worker_config=config)


def test_rank_states_of_different_saves_are_refused() -> None:
    states = _ranks(2, [0, 0], [3, 6])
    with pytest.raises(
        el.StateMismatchError, match="rank 0 has delivered=3, rank 1 has delivered=6"
    ):
        _one_rank().restore_state_global(states)


def test_rank_states_with_their_own_seeds_are_refused_on_another_world_size() -> None:
    # Partition 1 ran under seed 1001: continuing it under 1000 would give other draws.
    states = _ranks(2, [1000, 1001], [4, 4])
    with pytest.raises(el.StateMismatchError, match="seed=1000, rank 1 has seed=1001"):
        _one_rank(1000).restore_state_global(states)


def test_rank_states_with_their_own_seeds_restore_on_their_own_world_size(tmp_path) -> None:
    # Each rank continues its own partitions under its own seed: exact, through the list
    # and through the files (whose witness compares positions, not seeds).
    rests, states = [], []
    for rank in range(2):
        config = el.WorkerConfig(rank=rank, world_size=2, seed=1000 + rank)
        loader = el.SavableDataLoader(reference_pipeline(200, 8, 4), worker_config=config)
        iterator = iter(loader)
        for _ in range(4):
            next(iterator)
        states.append(loader.save_state_rank())
        el.save_state_rank_file(loader, tmp_path)
        rests.append([indices(batch) for batch in iterator])
    for rank in range(2):
        for restore in (
            lambda loader: loader.restore_state_global(states),
            lambda loader: el.restore_state_rank_file(loader, tmp_path),
        ):
            config = el.WorkerConfig(rank=rank, world_size=2, seed=1000 + rank)
            loader = el.SavableDataLoader(reference_pipeline(200, 8, 4), worker_config=config)
            restore(loader)
            assert [indices(batch) for batch in loader] == rests[rank]


def test_a_loader_with_another_seed_refuses_the_state() -> None:
    (state,) = _ranks(1, [5], [4])
    with pytest.raises(el.StateMismatchError, match="seed=5; this loader has seed=0"):
        _one_rank(0).restore_state_rank(state)


def test_rank_states_of_one_save_restore_on_another_world_size() -> None:
    # The oracle: the two ranks' uninterrupted continuations, interleaved as one rank takes them.
    runs = []
    for rank in range(2):
        config = el.WorkerConfig(rank=rank, world_size=2, seed=9)
        runs.append(
            saved_at(el.SavableDataLoader(reference_pipeline(200, 8, 4), worker_config=config), 4)
        )
    one = _one_rank(9)
    one.restore_state_global([state for state, _ in runs])
    resumed = [indices(batch) for batch in one]
    expected = [batch for pair in zip(runs[0][1], runs[1][1]) for batch in pair]
    assert resumed[: len(expected)] == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_an_edited_config_is_refused_even_where_it_would_pass_for_smaller_batches(
    workers,
) -> None:
    """batch_size 4 edited to 8 in the saved config would read as a restore with half the
    saved batch size (the replay doubled: items lost); 4 -> 0 as a broken config."""
    state, _ = saved_at(_loader(_filtered(_kept), workers), 11)
    for size in (8, 0):
        edited = copy.deepcopy(state)
        edited["config"]["batch_size"] = size
        loader = _loader(_filtered(_kept), workers)
        with pytest.raises(el.StateFormatError, match=r"checks\.config"):
            loader.restore_state_rank(edited)
    # Through state_dict() leaves too: each leaf's header carries the config and its check.
    saver = _loader(_filtered(_kept), workers)
    iterator = iter(saver)
    for _ in range(5):
        next(iterator)
    edited_leaves = {}
    for key, text in saver.state_dict().items():
        leaf = json.loads(text)
        leaf["rank_state"]["config"]["batch_size"] = 8
        edited_leaves[key] = json.dumps(leaf)
    with pytest.raises(el.StateFormatError, match=r"checks\.config"):
        _loader(_filtered(_kept), workers).load_state_dict(edited_leaves)


def _rank_loader(rank: int, world: int = 2) -> el.SavableDataLoader:
    config = el.WorkerConfig(rank=rank, world_size=world, seed=4)
    return el.SavableDataLoader(reference_pipeline(200, 8, 4), worker_config=config)


def test_a_rank_file_left_from_another_save_is_refused_by_its_witness(tmp_path) -> None:
    # Two saves of a 2-rank job into two folders; then rank 1's file of the later save is
    # copied over the earlier folder's (a rank that wrote this time, into a reused folder).
    rests = {}
    for folder, steps in (("early", 3), ("late", 6)):
        for rank in range(2):
            loader = _rank_loader(rank)
            iterator = iter(loader)
            for _ in range(steps):
                next(iterator)
            el.save_state_rank_file(loader, tmp_path / folder)
            rests[folder, rank] = [indices(batch) for batch in iterator]
    for rank in range(2):  # one save: each rank continues exactly from its own file
        loader = _rank_loader(rank)
        el.restore_state_rank_file(loader, tmp_path / "early")
        assert [indices(batch) for batch in loader] == rests["early", rank]
    late = el.rank_state_path(tmp_path / "late", _rank_loader(1))
    late.replace(el.rank_state_path(tmp_path / "early", _rank_loader(1)))
    for rank in range(2):  # rank 0 reads rank 1's header, rank 1 reads rank 0's
        with pytest.raises(
            el.StateMismatchError, match=r"delivered=3.*delivered=6|delivered=6.*delivered=3"
        ):
            el.restore_state_rank_file(_rank_loader(rank), tmp_path / "early")


def _small(length: int) -> el.SavableDataset:
    source = el.IndexedSource.from_fn(length, MakeSample(), shuffle=True, seed=11)
    return el.MapDataset(source, AddNoise())


@MODEL_EXAMPLES
@given(
    length=st.integers(7, 40),
    saved=st.sampled_from([1, 2, 3]),
    restored=st.sampled_from([1, 2, 3]),
    steps=st.integers(0, 16),
    stale=st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(0, 16))),
)
def test_rank_states_continue_the_job_exactly_or_are_refused(
    length: int, saved: int, restored: int, steps: int, stale
) -> None:
    """Drawn jobs of 1-3 ranks (6 partitions, some ending before others) saved after drawn
    steps, one rank's state maybe from another step, restored on 1-3 ranks: the restore is
    refused, or the rest of the epoch is every item the given states had not handed out,
    each once, with the uninterrupted run's augmentation (the model: one uninterrupted pass).
    States of different steps are accepted only where they are one position (the ranks whose
    shorter epochs ended stand the same at both steps), and then continue it exactly."""
    model = {sample["index"]: sample["noise"] for sample in _all_of(length)}
    if stale is not None and (saved < 2 or stale[0] >= saved):
        stale = None  # a stale state needs another rank's to disagree with
    states, handed_out = [], []
    for rank in range(saved):
        at = steps if stale is None or stale[0] != rank else stale[1]
        config = el.WorkerConfig(rank=rank, world_size=saved, seed=2)
        loader = el.SavableDataLoader(_small(length), worker_config=config, num_partitions=6)
        iterator = iter(loader)
        handed_out += [sample for _, sample in zip(range(at), iterator)]
        states.append(loader.save_state_rank())
    resumed = []
    try:
        for rank in range(restored):
            config = el.WorkerConfig(rank=rank, world_size=restored, seed=2)
            loader = el.SavableDataLoader(_small(length), worker_config=config, num_partitions=6)
            loader.restore_state_global(states)
            for sample in loader:
                if loader.epoch != 0:  # the epoch had nothing left: this is the next one
                    break
                resumed.append(sample)
    except el.StateMismatchError:
        assert stale is not None and stale[1] != steps, "refused a state of one save"
        return
    seen = [sample["index"] for sample in handed_out + resumed]
    assert sorted(seen) == list(range(length)), "items lost or repeated"
    assert all(sample["noise"] == model[sample["index"]] for sample in resumed)


def _all_of(length: int) -> list[dict]:
    config = el.WorkerConfig(rank=0, world_size=1, seed=2)
    return list(el.SavableDataLoader(_small(length), worker_config=config, num_partitions=6))


def test_a_state_of_another_pipeline_is_refused_with_the_way_out() -> None:
    state, _ = saved_at(_loader(_filtered(_kept), 0), 3)
    other = el.SavableDataLoader(
        el.BatchDataset(el.IndexedSource.from_fn(240, MakeSample(), shuffle=True, seed=3), 3)
    )
    with pytest.raises(el.StateMismatchError) as refused:
        other.restore_state_rank(state)
    message = str(refused.value)
    assert message.startswith("the state belongs to a different pipeline: ")
    assert "FilterDataset" in message and "inspect" in message and "whole factor" in message


_LIMIT = {"below": 1000}


def _below_limit(sample: dict) -> bool:
    return sample["index"] < _LIMIT["below"]


def test_a_pipeline_that_makes_fewer_items_than_the_save_replayed_names_its_stages() -> None:
    def build() -> el.SavableDataLoader:
        source = el.IndexedSource.from_fn(40, MakeSample())
        return el.SavableDataLoader(
            el.FilterDataset(source, _below_limit),
            checkpoint_every_n_samples=8,
            checkpoint_every_sec=None,
        )

    state, _ = saved_at(build(), 38)  # a checkpoint after 32 items: 6 to replay
    (partition,) = state["partitions"]
    assert partition["skip"] == 6
    _LIMIT["below"] = 35  # the predicate now drops the last items: the replay ends early
    try:
        changed = build()
        changed.restore_state_rank(state)
        with pytest.raises(el.StateMismatchError) as refused:
            next(iter(changed))
    finally:
        _LIMIT["below"] = 1000
    message = str(refused.value)
    assert "expected 6 item(s) to replay" in message and "ended after 3" in message
    assert "FilterDataset.predicate" in message and "IndexedSource" in message
