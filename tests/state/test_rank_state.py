"""The rank state: plain data, small, versioned, and strict about what it accepts."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch

import energy_loader as el
from energy_loader.state import RANK_STATE_VERSION, check_plain
from tests.helpers import indices, reference_pipeline, resealed


def _mid_epoch_state(workers: int = 0, buffer: int = 1000, length: int = 5000) -> dict:
    loader = el.SavableDataLoader(reference_pipeline(length, buffer, 32), num_workers=workers)
    iterator = iter(loader)
    for _ in range(40):
        next(iterator)
    return loader.save_state_rank()


def test_state_of_a_1000_sample_shuffle_buffer_is_small_and_plain() -> None:
    state = _mid_epoch_state(buffer=1000)
    text = json.dumps(state)
    assert len(text) <= 32 * 1024, len(text)
    check_plain(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


def test_state_size_does_not_grow_with_dataset_size() -> None:
    small = len(json.dumps(_mid_epoch_state(buffer=100, length=2_000)))
    large = len(json.dumps(_mid_epoch_state(buffer=100, length=2_000_000)))
    # 1000x more data: only the 100 buffered keys gain 3 digits each (and a few positions).
    assert large - small <= 100 * 3 + 20, (small, large)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.pop("format"), "no 'format' field"),
        (lambda s: s.update(format="something else"), "state.format is 'something else'"),
        (
            lambda s: s.update(version=RANK_STATE_VERSION + 1),
            f"state.version is {RANK_STATE_VERSION + 1}",
        ),
        (
            lambda s: s.update(version=0),
            "state.version is 0; this energy_loader reads version 1",
        ),
        (lambda s: s.update(workers="nope"), "state.workers must be a list"),
        (lambda s: s.update(workers=[]), "state.workers has 0 entries"),
        (
            lambda s: s["partitions"][0].update(skip=-1),
            r"state.partitions\[0\].skip must be >= 0",
        ),
        (
            lambda s: s["partitions"][0].update(skip="3"),
            r"state.partitions\[0\].skip must be an integer",
        ),
        (lambda s: s["partitions"][0].update(partition=3), "names partitions \\[3\\] of only 1"),
        (lambda s: s["workers"][0].update(partitions=[]), r"state.workers\[\*\].partitions has 0"),
        (lambda s: s.update(num_partitions=0), "num_partitions must be >= 1"),
        (lambda s: s.update(next_worker=5), "next_worker 5 is not below"),
        (
            lambda s: s["partitions"][0]["checkpoint"].update(phase="sideways"),
            r"partition 0 checkpoint: .*phase must be one of",
        ),
        (
            lambda s: s["partitions"][0]["checkpoint"]["inner"].pop("counter"),
            "has no field 'counter'",
        ),
        (
            lambda s: s["partitions"][0]["checkpoint"]["inner"].update(indices=[1, "x"]),
            r"indices\[1\] must be an integer",
        ),
        (lambda s: s.update(config=float("nan")), "state.config must be a dict"),
    ],
)
def test_garbage_raises_state_format_error_naming_the_field(mutate, message) -> None:
    state = _mid_epoch_state(buffer=10, length=2000)
    broken = copy.deepcopy(state)
    mutate(broken)
    if "checkpoint" in message or "counter" in message or "indices" in message:
        # Inside a checkpoint the digest speaks first; beneath it, the field is named.
        loader = el.SavableDataLoader(reference_pipeline(2000, 10, 32))
        with pytest.raises(el.StateFormatError, match=r"partitions\[0\]\.check does not match"):
            loader.restore_state_rank(broken)
        broken = resealed(broken)
    loader = el.SavableDataLoader(reference_pipeline(2000, 10, 32))
    with pytest.raises(el.StateFormatError, match=message):
        loader.restore_state_rank(broken)
    # The loader is unharmed: the good state still restores and the stream is exact.
    loader.restore_state_rank(state)
    twin = el.SavableDataLoader(reference_pipeline(2000, 10, 32))
    twin.restore_state_rank(state)
    assert [indices(b) for b in loader] == [indices(b) for b in twin]


@pytest.mark.parametrize("garbage", [None, 42, "state", [], b"\x00", {"format": 1}])
def test_not_a_state_at_all(garbage) -> None:
    loader = el.SavableDataLoader(reference_pipeline(100, 4, 4))
    with pytest.raises(el.StateFormatError):
        loader.restore_state_rank(garbage)


def test_other_pipeline_raises_mismatch_naming_the_difference() -> None:
    state = _mid_epoch_state(buffer=10, length=2000)
    other = el.SavableDataLoader(reference_pipeline(2000, 12, 32))
    with pytest.raises(
        el.StateMismatchError, match=r"BatchDataset > ShuffleBufferDataset.size: saved 10, now 12"
    ):
        other.restore_state_rank(state)


def test_larger_or_non_dividing_batch_size_raises_mismatch() -> None:
    state = _mid_epoch_state(buffer=10, length=2000)
    for size in (64, 24):
        loader = el.SavableDataLoader(reference_pipeline(2000, 10, size))
        with pytest.raises(el.StateMismatchError, match=f"batch_size: saved 32, now {size}"):
            loader.restore_state_rank(state)


def test_another_partition_count_is_a_mismatch_naming_both() -> None:
    state = _mid_epoch_state(buffer=10, length=2000)
    config = el.WorkerConfig(rank=1, world_size=2)
    loader = el.SavableDataLoader(reference_pipeline(2000, 10, 32), worker_config=config)
    # Given no num_partitions the loader would adopt the saved count, which 2 ranks cannot run.
    with pytest.raises(
        el.StateMismatchError, match=r"num_partitions=1, which world_size=2 cannot run"
    ):
        loader.restore_state_rank(state)
    pinned = el.SavableDataLoader(
        reference_pipeline(2000, 10, 32), worker_config=config, num_partitions=2
    )
    with pytest.raises(
        el.StateMismatchError,
        match=r"saved with num_partitions=1 .* this loader runs num_partitions=2\. 1 partitions",
    ):
        pinned.restore_state_rank(state)


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_leaves_are_the_compact_json_of_the_whole_leaf(workers: int) -> None:
    """The workers' encoded checkpoints spliced into the leaves (or, without workers, the
    checkpoints encoded at the save) give the bytes ``json.dumps`` of each leaf gives, and a
    state decoded from plain data gives the same leaves again."""
    loader = el.SavableDataLoader(reference_pipeline(), num_workers=workers, num_partitions=2)
    iterator = iter(loader)
    for _ in range(40):  # past each worker's first rolling checkpoint (every 16 items)
        next(iterator)
    leaves = loader.state_dict()
    plain = loader.save_state_rank()
    header = {k: v for k, v in plain.items() if k != "partitions"}
    assert len(leaves) == len(plain["partitions"]) == 2
    for text in leaves.values():
        leaf = json.loads(text)
        assert leaf["rank_state"] == header and leaf["partition"] in plain["partitions"]
        assert text == json.dumps(leaf, separators=(",", ":"))
    assert loader.state_dict_of_ranks([plain]) == leaves
    loader.close()


def test_a_partition_state_crosses_a_process_boundary_whole() -> None:
    """A worker's snapshot pickles each partition's record: every field comes back, those
    that equality ignores (the checkpoint's digest with its JSON, the replay slack) too."""
    import pickle

    from energy_loader.state.digests import checkpoint_digest
    from energy_loader.state.rank_state import PartitionState

    checkpoint = {"source": {"position": 17}, "buffer": [3, 1, 2]}
    entry = PartitionState(
        5, checkpoint, 2, False, ("key", 9), checkpoint_digest(checkpoint), "m" * 16, 1
    )
    back = pickle.loads(pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == entry
    assert (back.checkpoint_check, back.replay_slack) == (entry.checkpoint_check, 1)
    assert back.checkpoint_check.text == json.dumps(checkpoint, separators=(",", ":"))
