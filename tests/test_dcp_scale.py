"""energy_loader.dcp: DCP's save planning, loads of another partition count, shared metadata.

In-process: the save planner's global plan and metadata equal torch's for real loaders' state
dicts, the load planner's rewrite of nested templates. With real gloo ranks
(tests/dcp_scale_helpers.py): a checkpoint of another ``num_partitions`` is our
``StateMismatchError`` on every rank (or, without ``num_partitions``, adopted), and on 8 ranks
a load through ``SharedMetadataReader`` reads ``.metadata`` from storage on the coordinator
only and continues every rank's stream exactly.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections import ChainMap
from pathlib import Path
from typing import Any

import pytest
import torch

import energy_loader as el
from energy_loader.state.rank_state import rank_slots, slot_key
from energy_loader.testing.storage import CountingReader
from tests import distributed_helpers as dh
from tests.helpers import LazyModule, reference_pipeline

# torch.distributed.checkpoint (~45 MB) is imported by the first test that runs, not at
# collection (LazyModule says why).
dcp = LazyModule("torch.distributed.checkpoint")
dcp_api = LazyModule("torch.distributed.checkpoint.api")
default_planner = LazyModule("torch.distributed.checkpoint.default_planner")
dcp_metadata = LazyModule("torch.distributed.checkpoint.metadata")
dcp_planner = LazyModule("torch.distributed.checkpoint.planner")
helpers = LazyModule("tests.dcp_scale_helpers")


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _loader(rank: int, world_size: int, num_partitions: int | None) -> el.SavableDataLoader:
    config = el.WorkerConfig(rank=rank, world_size=world_size, num_workers=0, seed=3)
    return el.SavableDataLoader(
        reference_pipeline(length=240, buffer=8, batch=4),
        worker_config=config,
        num_partitions=num_partitions,
    )


# -- the save planner: torch's plan, in linear time ----------------------------------------------


def test_first_map_wins_is_chainmap_in_value_and_order() -> None:
    maps = [{"a": 1, "x": 10}, {"x": 20, "b": 2}, {"c": 3, "a": 30, "x": 30}]
    merged = el.dcp.first_map_wins(maps)
    assert merged == dict(ChainMap(*maps))
    assert list(merged) == list(dict(ChainMap(*maps)))


def _rank_plans(world_size: int, partitions: int) -> list[dcp_planner.SavePlan]:
    """Every rank's local save plan of a model replicated on all ranks, a step counter and a
    loader that took a few batches: what each rank sends DCP's coordinator."""
    plans = []
    for rank in range(world_size):
        loader = _loader(rank, world_size, partitions)
        iterator = iter(loader)
        for _ in range(2 + rank):
            next(iterator)
        state = {"model": {"w": torch.ones(3), "b": torch.zeros(1)}, "step": 7}
        state["loader"] = loader.state_dict()
        planner = default_planner.DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
        loader.close()
    return plans


def _global(
    planner: default_planner.DefaultSavePlanner, plans: list[dcp_planner.SavePlan]
) -> tuple[list[dcp_planner.SavePlan], dcp_metadata.Metadata]:
    planner.set_up_planner({}, storage_meta=None, is_coordinator=True)
    return planner.create_global_plan(plans)


def test_the_save_planner_plans_exactly_what_torch_plans() -> None:
    plans = _rank_plans(world_size=3, partitions=6)
    torch_plan, torch_metadata = _global(default_planner.DefaultSavePlanner(), plans)
    our_plan, our_metadata = _global(el.dcp.SavePlanner(), plans)
    assert our_plan == torch_plan
    assert our_metadata == torch_metadata
    assert list(our_metadata.planner_data) == list(torch_metadata.planner_data)
    # The replicated model was deduplicated (saved by one rank), the 6 slots kept apart.
    saved = [item.index.fqn for plan in our_plan for item in plan.items]
    assert sorted(saved) == sorted(
        ["model.w", "model.b", "step", *(f"loader.{slot_key(s)}" for s in range(6))]
    )


def test_with_plan_caching_an_unchanged_save_reuses_the_plan() -> None:
    plans = _rank_plans(world_size=2, partitions=4)
    planner = el.dcp.SavePlanner(enable_plan_caching=True)
    try:
        _, first = _global(planner, plans)
        unchanged = [dcp_planner.SavePlan([], usable=False)] * len(plans)
        delta, second = _global(el.dcp.SavePlanner(enable_plan_caching=True), unchanged)
        assert second is first  # the global step was skipped
        assert all(not plan.usable for plan in delta)
        assert first == _global(default_planner.DefaultSavePlanner(), plans)[1]
    finally:  # torch caches plans per planner class, in the class
        for cache in (
            dcp_planner.SavePlanner._cached_all_plans,
            dcp_planner.SavePlanner._cached_global_plan,
            dcp_planner.SavePlanner._cached_metadata,
            dcp_planner.SavePlanner._cached_save_plan,
            dcp_planner.SavePlanner._cached_final_save_plan,
        ):
            cache.pop(planner._cached_plans_key, None)


# -- the load planner: a template of the saved partition count -----------------------------------


def _metadata_of(path: Path) -> dcp_metadata.Metadata:
    with open(path / ".metadata", "rb") as file:
        return pickle.load(file)


def test_the_load_planner_fits_a_nested_template_and_leaves_the_rest(tmp_path: Path) -> None:
    saved = _loader(0, 1, 4)
    next(iter(saved))
    dcp.save(
        {"app": {"loader": saved.state_dict(), "step": 3}}, checkpoint_id=tmp_path, no_dist=True
    )
    saved.close()
    metadata = _metadata_of(tmp_path)
    fresh = _loader(0, 1, 2)
    template = fresh.state_dict()
    dropin = {"rank_any": "{}"}
    state = {"app": {"loader": template, "step": 0}, "other": dropin}
    el.dcp.LoadPlanner().set_up_planner(state, metadata, is_coordinator=True)
    assert state["app"]["loader"] is template
    assert sorted(template) == [slot_key(s) for s in range(4)]
    assert state["other"] == {"rank_any": "{}"} and state["app"]["step"] == 0
    # Torch's planner lists the loader's own two slots, both in the checkpoint: it loads
    # them, and the loader refuses leaves of num_partitions=4 (our error without our planner).
    fresh2 = _loader(0, 1, 2)
    state2 = {"app": {"loader": fresh2.state_dict(), "step": 0}}
    default_planner.DefaultLoadPlanner().set_up_planner(state2, metadata, is_coordinator=True)
    assert sorted(state2["app"]["loader"]) == [slot_key(0), slot_key(1)]
    fresh.close()
    fresh2.close()


def test_a_single_process_load_through_both_adopts_the_saved_count(tmp_path: Path) -> None:
    saved = _loader(0, 1, 4)
    iterator = iter(saved)
    for _ in range(3):
        next(iterator)
    dcp.save({"loader": saved}, checkpoint_id=tmp_path, no_dist=True)
    expected = [next(iterator)["__restore_key__"] for _ in range(4)]
    saved.close()
    fresh = _loader(0, 1, None)  # default: 1 partition
    counting = CountingReader(tmp_path)
    dcp.load(
        {"loader": fresh},
        storage_reader=el.dcp.SharedMetadataReader(counting),
        planner=el.dcp.LoadPlanner(),
        no_dist=True,
    )
    iterator = iter(fresh)
    assert [next(iterator)["__restore_key__"] for _ in range(4)] == expected
    assert counting.metadata_bytes == (tmp_path / ".metadata").stat().st_size  # read locally
    fresh.close()


def _saved_with(folder: Path, partitions: int) -> list[Any]:
    """A checkpoint of a loader of ``partitions`` after 3 batches (one process), and the
    restore keys of the 4 batches after them."""
    saved = _loader(0, 1, partitions)
    iterator = iter(saved)
    for _ in range(3):
        next(iterator)
    dcp.save({"loader": saved}, checkpoint_id=folder, no_dist=True)
    expected = [next(iterator)["__restore_key__"] for _ in range(4)]
    saved.close()
    return expected


def test_more_partitions_than_saved_through_load_is_our_error_naming_both_fixes(
    tmp_path: Path,
) -> None:
    # Torch's default planner refuses the slots the checkpoint lacks during its own planning
    # (a CheckpointException, a BaseException); energy_loader.dcp.load says it in our words.
    _saved_with(tmp_path, 2)
    fresh = _loader(0, 1, 4)
    with pytest.raises(dcp_api.CheckpointException, match=r"Missing key .*loader\.slot_00002"):
        dcp.load({"loader": fresh}, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(el.StateMismatchError) as caught:
        el.dcp.load({"loader": fresh}, checkpoint_id=tmp_path, no_dist=True)
    message = str(caught.value)
    assert "the checkpoint holds 'loader' of num_partitions=2 (slot_00000 to slot_00001)" in (
        message
    ), message
    assert "this loader runs num_partitions=4 (on world_size=1 x num_workers=0)" in message
    assert "refused this rank's slot_00002, slot_00003, which the checkpoint lacks" in message
    fixes = (
        "Build the loader with num_partitions=2, or leave num_partitions unset and load with "
        "planner=energy_loader.dcp.LoadPlanner()"
    )
    assert fixes in message
    assert isinstance(caught.value.__cause__, dcp_api.CheckpointException)
    fresh.close()


def test_fewer_partitions_than_saved_with_torchs_planner_names_both_fixes(tmp_path: Path) -> None:
    # Torch loads the slots the loader lists (all saved): the loader refuses them itself.
    _saved_with(tmp_path, 4)
    for load in (dcp.load, el.dcp.load):
        fresh = _loader(0, 1, 2)
        with pytest.raises(el.StateMismatchError) as caught:
            load({"loader": fresh}, checkpoint_id=tmp_path, no_dist=True)
        message = str(caught.value)
        assert "saved with num_partitions=4" in message, message
        assert "this loader runs num_partitions=2" in message
        assert "Pass num_partitions=4 to the loader, or leave num_partitions unset" in message
        assert "with planner=energy_loader.dcp.LoadPlanner()" in message
        fresh.close()


def test_load_with_the_saved_count_or_our_planner_is_torchs_load(tmp_path: Path) -> None:
    expected = _saved_with(tmp_path, 2)
    for count, planner in ((2, None), (None, el.dcp.LoadPlanner())):
        fresh = _loader(0, 1, count)
        el.dcp.load({"loader": fresh}, checkpoint_id=tmp_path, no_dist=True, planner=planner)
        iterator = iter(fresh)
        assert [next(iterator)["__restore_key__"] for _ in range(4)] == expected
        fresh.close()


def test_per_rank_keys_on_another_world_size_are_refused_naming_the_one_key_recipe(
    tmp_path: Path,
) -> None:
    """What 2 ranks write under ``rank_state_key(loader)`` (a savable pipeline's and a drop-in
    loader's), loaded by rank 0 of 3: our error naming the recipe that resizes; the same keys
    on the saving world size still load."""
    from tests.loader.dropin_helpers import build_rank_loader

    def pipeline(rank: int, world_size: int) -> el.SavableDataLoader:
        return _loader(rank, world_size, 6)

    for make in (pipeline, build_rank_loader):
        folder = tmp_path / make.__name__
        saving = [make(rank, 2) for rank in range(2)]
        for loader in saving:
            iterator = iter(loader)
            next(iterator), next(iterator)
        layout = {
            el.rank_state_key(el.WorkerConfig(rank=r, world_size=2)): saving[r] for r in (0, 1)
        }
        dcp.save(
            {key: loader.state_dict() for key, loader in layout.items()},
            checkpoint_id=folder,
            no_dist=True,
        )
        fresh = make(0, 3)
        key = el.rank_state_key(el.WorkerConfig(rank=0, world_size=3))
        with pytest.raises(
            dcp_api.CheckpointException
        ) as caught:  # DCP's wrapper of a rank's error
            dcp.load({key: fresh}, checkpoint_id=folder, planner=el.dcp.LoadPlanner(), no_dist=True)
        message = str(caught.value)
        assert "stores 'loader' under per-rank keys of 2 rank(s)" in message
        assert "looks for 'loader_rank_00000_of_00003'" in message
        assert "dcp.save({'loader': loader, ...})" in message
        same = make(0, 2)  # the saving world size: loads as before
        dcp.load(
            {"loader_rank_00000_of_00002": same},
            checkpoint_id=folder,
            planner=el.dcp.LoadPlanner(),
            no_dist=True,
        )
        for loader in (*saving, fresh, same):
            loader.close()


@pytest.mark.parametrize(
    ("reader", "coordinator", "error", "message"),
    [
        ("not a reader", 0, TypeError, "wraps a torch.distributed.checkpoint StorageReader"),
        (None, -1, ValueError, "coordinator_rank must be a rank of the process group"),
        (None, True, TypeError, "coordinator_rank must be an int"),
    ],
)
def test_shared_metadata_reader_names_bad_arguments(
    tmp_path: Path, reader: Any, coordinator: Any, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        el.dcp.SharedMetadataReader(
            CountingReader(tmp_path) if reader is None else reader, coordinator_rank=coordinator
        )


# -- real gloo ranks -------------------------------------------------------------------------------

SAVED_PARTITIONS = 4
STEPS = 3


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks, num_partitions=4, saved after 5 batches with both save planners."""
    workdir = tmp_path_factory.mktemp("dcp_two_ranks")
    dh.launch(
        helpers.save_both_ways,
        2,
        workdir,
        timeout=90,
        partitions=SAVED_PARTITIONS,
        steps=5,
        more=STEPS,
    )
    return workdir


def test_both_save_planners_write_the_same_metadata(saved_on_two_ranks: Path) -> None:
    ours = _metadata_of(saved_on_two_ranks / "dcp")
    theirs = _metadata_of(saved_on_two_ranks / "dcp_default")
    for field in ("state_dict_metadata", "planner_data", "storage_data", "version"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert list(ours.planner_data) == list(theirs.planner_data)
    unique = {"checkpoint_id": None, "save_id": None}  # the folder and a fresh uuid per save
    assert dataclasses.replace(ours.storage_meta, **unique) == dataclasses.replace(
        theirs.storage_meta, **unique
    )


@pytest.mark.timeout(120)
def test_another_partition_count_is_our_error_on_every_rank_or_adopted(
    saved_on_two_ranks: Path, no_leftover_processes: None
) -> None:
    cases = [(8, False), (8, "load"), (8, True), (2, True), (None, True), (SAVED_PARTITIONS, True)]
    dh.launch(
        helpers.load_other_counts, 2, saved_on_two_ranks, timeout=90, cases=cases, steps=STEPS
    )
    for rank in range(2):
        report = _read(saved_on_two_ranks / f"other_counts_rank{rank}.json")
        expected = torch.load(saved_on_two_ranks / f"saved{rank}.pt", weights_only=True)
        # Torch's planner: its missing-key error, wrapped, before the loader is asked; through
        # energy_loader.dcp.load, ours on every rank.
        kind, message = report["8/False"]["outcome"]
        assert kind == "CheckpointException" and "Missing key" in message
        kind, message = report["8/load"]["outcome"]
        assert kind == "StateMismatchError", message
        assert f"of num_partitions={SAVED_PARTITIONS} " in message
        assert "this loader runs num_partitions=8 (on world_size=2" in message
        assert f"this rank's {slot_key(4 + rank)}, {slot_key(6 + rank)}," in message
        for count in (8, 2):  # ours: the loader's refusal, naming both counts and the fix
            kind, message = report[f"{count}/True"]["outcome"]
            assert kind == "StateMismatchError", message
            assert f"saved with num_partitions={SAVED_PARTITIONS}" in message
            assert f"this loader runs num_partitions={count}" in message
            assert f"Pass num_partitions={SAVED_PARTITIONS}" in message
        for count in ("None", SAVED_PARTITIONS):  # adopted, or the same count: exact
            assert report[f"{count}/True"]["outcome"] == ["ok", ""], report[f"{count}/True"]
            assert [tuple(map(tuple, k)) for k in report[f"{count}/True"]["keys"]] == expected
        kind, message = report["missing"]["outcome"]
        assert kind == "CheckpointException"
        assert "could not read the checkpoint's metadata" in message, message


@pytest.mark.timeout(120)
def test_a_count_this_world_size_cannot_run_is_refused_by_the_loader(
    saved_on_two_ranks: Path, no_leftover_processes: None
) -> None:
    cases = [(None, True), (6, True)]
    dh.launch(
        helpers.load_other_counts, 3, saved_on_two_ranks, timeout=90, cases=cases, steps=STEPS
    )
    for rank in range(3):
        report = _read(saved_on_two_ranks / f"other_counts_rank{rank}.json")
        for case in ("None/True", "6/True"):
            kind, message = report[case]["outcome"]
            assert kind == "StateMismatchError", message
            assert "num_partitions=4" in message and "world_size=3" in message, message


@pytest.mark.timeout(150)
def test_eight_ranks_read_metadata_once_from_storage_and_only_their_own_leaves(
    tmp_path: Path, no_leftover_processes: None
) -> None:
    partitions = 16
    dh.launch(
        helpers.save_both_ways, 8, tmp_path, timeout=90, partitions=partitions, steps=5, more=STEPS
    )
    dh.launch(
        helpers.load_sharing_metadata, 8, tmp_path, timeout=90, partitions=partitions, steps=STEPS
    )
    metadata = _metadata_of(tmp_path / "dcp")
    metadata_size = (tmp_path / "dcp" / ".metadata").stat().st_size
    for rank in range(8):
        report = _read(tmp_path / f"shared_rank{rank}.json")
        own = sum(
            metadata.storage_data[dcp_metadata.MetadataIndex(f"loader.{slot_key(s)}")].length
            for s in rank_slots(rank, 8, partitions)
        )
        assert report == {"metadata": metadata_size if rank == 0 else 0, "data": own}, rank
        got = torch.load(tmp_path / f"shared{rank}.pt", weights_only=True)
        assert got == torch.load(tmp_path / f"saved{rank}.pt", weights_only=True), rank
