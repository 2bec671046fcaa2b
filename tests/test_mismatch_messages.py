"""Every refusal of a saved state says where, what it expected, what it found, and the way out.

A ``StateMismatchError`` names the stage (a pipeline's stage, a dataset or a sampler), the
partition, rank or state file it concerns, the value the state holds and the value found
now, and what the user can do. Each test triggers one raise site through a public entry
point (``restore_state_rank``, ``load_state_dict``, ``restore_state_rank_file``,
``restore_state_global`` without a process group), with real loaders and real files, and
checks the concrete values in the message: the saved one (read from the state or named by
the test) and the one of the restoring loader.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import energy_loader as el
from energy_loader.testing.strategies import MakeSample
from tests.helpers import saved_at

# What _shifted adds: a module global, so a test changes the function's values between the
# saving run and the restoring one without changing its code (a Counter, not plain data: its
# code fingerprint takes it by type, so a changed value is not a changed code).
_SHIFT = collections.Counter({"value": 0})


def _shifted(sample: dict) -> dict:
    return {**sample, "y": sample["index"] + _SHIFT["value"]}


def _kept(sample: dict) -> bool:
    return sample["index"] % (3 + _SHIFT["value"]) != 0


@pytest.fixture
def shift():
    """``_SHIFT``, put back after the test."""
    yield _SHIFT
    _SHIFT["value"] = 0


def _pipeline(batch: int = 4, fn: Any = _shifted) -> el.SavableDataset:
    source = el.IndexedSource.from_fn(60, MakeSample(), shuffle=True, seed=5)
    return el.BatchDataset(el.MapDataset(source, fn), batch_size=batch)


def _filtered() -> el.SavableDataset:
    source = el.IndexedSource.from_fn(120, MakeSample(), shuffle=True, seed=5)
    return el.BatchDataset(el.FilterDataset(source, _kept), batch_size=4)


def _loader(pipeline: el.SavableDataset, **config: Any) -> el.SavableDataLoader:
    # Rolling checkpoints every 8 items only: a save after 11 batches has items to replay.
    return el.SavableDataLoader(
        pipeline,
        worker_config=el.WorkerConfig(num_workers=0, **config),
        checkpoint_every_n_samples=8,
        checkpoint_every_sec=None,
    )


def _refusal(call: Any) -> str:
    with pytest.raises(el.StateMismatchError) as caught:
        call()
    return str(caught.value)


# -- savable pipelines -----------------------------------------------------------------------


def test_another_seed_names_both_seeds_and_the_one_to_pass() -> None:
    state, _ = saved_at(_loader(_pipeline(), seed=5), 3)
    message = _refusal(lambda: _loader(_pipeline(), seed=0).restore_state_rank(state))
    assert re.search(r"WorkerConfig seed=5; this loader has seed=0", message), message
    assert "Build the loader with seed=5" in message


def test_another_pipeline_config_names_the_stage_both_values_and_the_way_out() -> None:
    state, _ = saved_at(_loader(_pipeline(batch=4)), 3)
    message = _refusal(lambda: _loader(_pipeline(batch=3)).restore_state_rank(state))
    assert re.search(r"BatchDataset\.batch_size: saved 4, now 3", message), message
    assert "Restore it into the pipeline that saved it" in message


def _replay_refusal(build: Any, shift: dict, value: int) -> tuple[dict[str, Any], str]:
    """The entry of the partition with items to replay in a state saved after 11 batches of
    ``build()``, and the refusal of its restore once ``shift`` is ``value``."""
    state, _ = saved_at(_loader(build()), 11)
    (entry,) = [p for p in state["partitions"] if p["skip"] and p["last"] and p["made"]]
    shift["value"] = value
    loader = _loader(build())
    loader.restore_state_rank(state)
    return entry, _refusal(lambda: next(iter(loader)))


def test_a_changed_filter_names_the_partition_both_key_digests_and_the_way_out(shift) -> None:
    # The filter keeps other samples: the replay re-makes another last batch.
    entry, message = _replay_refusal(_filtered, shift, 2)
    assert f"partition {entry['partition']}:" in message, message
    found = re.search(r"key digest ([0-9a-f]{16})\) is not the one", message)
    assert found is not None and found.group(1) != entry["last"], message
    assert f"(key digest {entry['last']})" in message
    assert "BatchDataset > FilterDataset.predicate" in message  # the stage running user code
    assert "verify_restore=False" in message


def test_other_values_name_the_partition_the_stage_both_digests_and_the_way_out(shift) -> None:
    entry, message = _replay_refusal(_pipeline, shift, 1)  # the same code and keys
    assert f"partition {entry['partition']}:" in message, message
    found = re.search(rf"values digest {entry['made']} saved, ([0-9a-f]+) now", message)
    assert found is not None and found.group(1) != entry["made"], message
    assert "MapDataset.fn (tests.test_mismatch_messages._shifted)" in message
    assert "verify_restore=False" in message


def _noisy(index: int) -> dict:
    return {"index": index, "noise": torch.rand(()).item()}


def _ranks(world_size: int, seed_per_sample: bool) -> list[el.SavableDataLoader]:
    """Every rank's loader of a from_fn source whose function draws random numbers."""
    return [
        el.SavableDataLoader(
            el.BatchDataset(
                el.IndexedSource.from_fn(40, _noisy, seed_per_sample=seed_per_sample), 2
            ),
            num_partitions=4,
            worker_config=el.WorkerConfig(rank=rank, world_size=world_size, num_workers=0, seed=3),
        )
        for rank in range(world_size)
    ]


def _resized(seed_per_sample: bool) -> tuple[list[Any], el.SavableDataLoader]:
    """The job's batches after 3 steps of 2 ranks (what one rank must hand out next), and
    one rank restored from both ranks' states."""
    saving = _ranks(2, seed_per_sample)
    iterators = [iter(loader) for loader in saving]
    for _ in range(3):
        for iterator in iterators:
            next(iterator)
    states = [json.loads(json.dumps(loader.save_state_rank())) for loader in saving]
    following = [next(iterator) for _ in range(2) for iterator in iterators]
    (restoring,) = _ranks(1, seed_per_sample)
    restoring.restore_state_global(states)
    return following, restoring


def test_an_unseeded_from_fn_that_draws_names_it_as_your_code_and_the_fix() -> None:
    # Its draws are not re-made by the replay on one rank: it is user code, and the fix is
    # seed_per_sample=True (its states then restore on 1 rank as the 2 ranks went on).
    _, restoring = _resized(seed_per_sample=False)
    message = _refusal(lambda: next(iter(restoring)))
    function = "tests.test_mismatch_messages._noisy"
    assert (
        f"the stages that run your code (BatchDataset > IndexedSource.from_fn ({function}, "
        "seed_per_sample=False))" in message
    ), message
    assert f"IndexedSource.from_fn({function}) runs without per-sample seeds" in message
    assert (
        f"If it draws random numbers, build IndexedSource.from_fn({function}) with "
        "seed_per_sample=True" in message
    )
    following, restoring = _resized(seed_per_sample=True)
    iterator = iter(restoring)
    assert all(torch.equal(batch["noise"], next(iterator)["noise"]) for batch in following)


def test_another_partition_count_names_both_counts_and_the_fix() -> None:
    state, _ = saved_at(_loader(_pipeline()), 3)
    restoring = el.SavableDataLoader(_pipeline(), num_workers=0, num_partitions=2)
    message = _refusal(lambda: restoring.restore_state_rank(state))
    assert re.search(r"saved with num_partitions=1 \(on world_size=1 x num_workers=0\)", message)
    assert "this loader runs num_partitions=2" in message, message
    assert "Pass num_partitions=1 to the loader, or leave num_partitions unset" in message


def test_a_partition_count_no_rank_can_run_names_the_sizes_that_can(tmp_path: Path) -> None:
    el.save_state_rank_file(_loader(_pipeline()), tmp_path)
    restoring = _loader(_pipeline(), rank=0, world_size=2)
    message = _refusal(lambda: el.restore_state_rank_file(restoring, tmp_path))
    assert "saved with num_partitions=1, which world_size=2 cannot run" in message, message
    assert "restore it on a world size in [1]" in message


def test_an_incomplete_folder_names_it_the_missing_rank_and_the_way_out(tmp_path: Path) -> None:
    for rank in range(2):
        el.save_state_rank_file(_loader(_pipeline(), rank=rank, world_size=2), tmp_path)
    (tmp_path / "loader_rank_00001_of_00002.pt").unlink()
    restoring = _loader(_pipeline(), rank=0, world_size=1)
    message = _refusal(lambda: el.restore_state_rank_file(restoring, tmp_path))
    assert f"{tmp_path} holds state files of world size 2 but not those of ranks [1]" in message
    assert "copy the missing files back, or restore an earlier save" in message


def test_a_folder_of_two_saves_names_both_world_sizes_and_the_way_out(tmp_path: Path) -> None:
    el.save_state_rank_file(_loader(_pipeline()), tmp_path)
    el.save_state_rank_file(_loader(_pipeline(), rank=1, world_size=2), tmp_path)
    restoring = _loader(_pipeline(), rank=0, world_size=3)  # no file of its own: it lists them
    message = _refusal(lambda: el.restore_state_rank_file(restoring, tmp_path))
    assert f"{tmp_path} holds state files of several world sizes [1, 2]" in message, message
    assert "keep the files of each save in a directory of their own" in message


def test_a_gathered_list_of_mixed_saves_names_the_entry_both_sizes_and_the_fix() -> None:
    first = _loader(_pipeline(), rank=0, world_size=2).save_state_rank()
    other = _loader(_pipeline(), rank=1, world_size=3).save_state_rank()
    loader = _loader(_pipeline())
    message = _refusal(lambda: el.restore_state_global(loader, [first, other]))
    assert "states[1] was saved with world_size=3, states[0] with 2" in message, message
    assert "pass every rank's state of one save, in rank order" in message


def test_a_gathered_list_of_two_seeds_names_both_ranks_and_seeds() -> None:
    states = [
        _loader(_pipeline(), rank=rank, world_size=2, seed=1000 + rank).save_state_rank()
        for rank in range(2)
    ]
    message = _refusal(lambda: el.restore_state_global(_loader(_pipeline()), states))
    assert "rank 0 has seed=1000, rank 1 has seed=1001" in message, message
    assert "give every rank the same seed" in message


# -- drop-in loaders -------------------------------------------------------------------------


def _dropin(dataset: Dataset[Any], batch: int = 2, **options: Any) -> el.SavableDataLoader:
    return el.SavableDataLoader(dataset, batch_size=batch, num_workers=0, **options)


def _dropin_state(loader: el.SavableDataLoader, steps: int) -> dict[str, Any]:
    iterator = iter(loader)
    for _ in range(steps):
        next(iterator)
    return json.loads(json.dumps(loader.state_dict()))


def test_a_dropin_of_another_batch_size_names_the_field_both_values_and_the_fix() -> None:
    state = _dropin_state(_dropin(TensorDataset(torch.arange(12)), batch=2), 2)
    restoring = _dropin(TensorDataset(torch.arange(12)), batch=3)
    message = _refusal(lambda: restoring.load_state_dict(state))
    assert "batch_size: saved 2, now 3" in message, message
    assert "Build the loader with the dataset, sampler and batching that saved" in message


def test_a_dropin_dataset_edited_in_place_names_the_batch_both_digests_and_the_way_out() -> None:
    data = torch.arange(12, dtype=torch.float32)
    state = _dropin_state(_dropin(TensorDataset(data)), 2)
    saved = json.loads(state["rank_00000"])["proof"]["made"]
    data[2:4] += 100  # the last batch handed out (indices [2, 3]), edited in place
    restoring = _dropin(TensorDataset(data))
    restoring.load_state_dict(state)
    message = _refusal(lambda: iter(restoring))
    assert "batch 1 of epoch 0, indices [2, 3]) from the dataset TensorDataset" in message
    found = re.search(rf"values digest {saved} saved, ([0-9a-f]+) now", message)
    assert found is not None and found.group(1) != saved, message
    assert "verify_restore=False" in message


class _Counting(IterableDataset[int]):
    def __iter__(self):
        return iter(range(10))


def test_a_dropin_of_another_dataset_style_names_both_and_the_way_out() -> None:
    state = _dropin_state(_dropin(TensorDataset(torch.arange(12))), 1)
    message = _refusal(lambda: _dropin(_Counting()).load_state_dict(state))
    assert "over a map-style dataset; this one runs a iterable-style dataset" in message, message
    assert "restore it into a loader over the dataset that saved it" in message


def test_dropin_rank_files_of_another_world_size_name_both_sizes(tmp_path: Path) -> None:
    for rank in range(2):
        config = el.WorkerConfig(rank=rank, world_size=2, num_workers=0)
        loader = _dropin(TensorDataset(torch.arange(12)), worker_config=config)
        _dropin_state(loader, 1)
        el.save_state_rank_file(loader, tmp_path)
    restoring = _dropin(TensorDataset(torch.arange(12)))
    message = _refusal(lambda: el.restore_state_rank_file(restoring, tmp_path))
    assert "2 rank state(s) were saved, this job has world size 1" in message, message
    assert "unless its sampler is a DistributedSampler" in message
    assert "docs/migration.md" in message


def test_a_pipeline_state_into_a_dropin_names_both_kinds_and_the_way_out() -> None:
    state, _ = saved_at(_loader(_pipeline()), 3)
    message = _refusal(lambda: _dropin(TensorDataset(torch.arange(12))).load_state_dict(state))
    assert "saved by a loader over a savable pipeline" in message, message
    assert "this loader runs a plain dataset as a drop-in" in message
    assert "pass the same kind of dataset the state was saved with" in message
