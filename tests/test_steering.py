"""Steering a run on purpose: ``loader.skip(n)`` and restores that declare ``changes``.

What each test checks against is made without this project's code where it can be: torch's
own DataLoader for the drop-in, and for a pipeline the plain count of which source ids a run
handed out (every id of the epoch once, nothing lost or repeated), and how often each source
was drawn. Where the reference is "the stream an uninterrupted run yields", it is the same
loader's stream, iterated without a break.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset

import energy_loader as el
from energy_loader.cli import inspect as inspect_cli
from energy_loader.cli import replay as replay_cli
from energy_loader.testing.resume import END, compare_events, record_events
from energy_loader.testing.strategies import PipelineSpec, pipelines

from . import distributed_helpers as dh
from .helpers import MODEL_EXAMPLES

LENGTH = 12_000  # ids of one source: BASE * source + 0 .. LENGTH - 1
BASE = 100_000
BATCH = 50
SEED = 11


def blend(weights: tuple[float, ...], *, buffer: int | None = None) -> el.SavableDataset:
    """A blend of ``len(weights)`` shuffled sources (``on_exhausted="drop"``: the epoch runs
    until every drawn source ended), optionally through a shuffle buffer, in batches."""
    sources = [
        el.IndexedSource([{"id": BASE * s + i} for i in range(LENGTH)], shuffle=True, seed=s)
        for s in range(len(weights))
    ]
    inner: el.SavableDataset = el.BlendDataset(*zip(sources, weights), on_exhausted="drop")
    if buffer is not None:
        inner = el.ShuffleBufferDataset(inner, buffer)
    return el.BatchDataset(inner, BATCH)


def loader_of(pipeline: el.SavableDataset, workers: int, **options: Any) -> el.SavableDataLoader:
    config = el.WorkerConfig(0, 1, workers, seed=SEED)
    return el.SavableDataLoader(pipeline, worker_config=config, num_partitions=2, **options)


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"]]


def take(loader: el.SavableDataLoader, batches: int) -> list[list[int]]:
    return [ids(batch) for _, batch in zip(range(batches), loader)]


def every_id(sources: int) -> list[int]:
    return [BASE * s + i for s in range(sources) for i in range(LENGTH)]


# -- skip --------------------------------------------------------------------------------------


class Squares(Dataset):
    def __len__(self) -> int:
        return 90

    def __getitem__(self, index: int) -> int:
        return index * index


class Counting(IterableDataset):
    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(first, 90, step))


def _torch_reference(kind: str, workers: int) -> list[list[int]]:
    """torch's own DataLoader over the same dataset: the uninterrupted stream."""
    if kind == "map":
        generator = torch.Generator().manual_seed(3)
        loader = DataLoader(
            Squares(), batch_size=4, shuffle=True, num_workers=workers, generator=generator
        )
    else:
        loader = DataLoader(Counting(), batch_size=4, num_workers=workers)
    return [batch.tolist() for batch in loader]


def _dropin(kind: str, workers: int) -> el.SavableDataLoader:
    if kind == "map":
        generator = torch.Generator().manual_seed(3)
        return el.SavableDataLoader(
            Squares(), batch_size=4, shuffle=True, num_workers=workers, generator=generator
        )
    return el.SavableDataLoader(Counting(), batch_size=4, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_a_dropin_skips_exactly_the_next_batches_of_torchs_stream(kind: str, workers: int) -> None:
    """Skipped inside the loop, saved, restored: torch's stream less the skipped batches, and
    the skip on record."""
    expected = _torch_reference(kind, workers)
    loader, got = _dropin(kind, workers), []
    for step, batch in enumerate(loader):
        got.append(batch.tolist())
        if step == 4:
            assert loader.skip(3) == 3
            state = loader.state_dict()
            break
    restored = _dropin(kind, workers)
    restored.load_state_dict(state)
    got += [batch.tolist() for batch in restored]
    assert got == expected[:5] + expected[8:]
    history = restored.save_state_rank().get("history")
    if kind == "map":  # an iterable drop-in's state nests the pipeline state that records it
        assert history == [{"epoch": 0, "step": 5, "skip": 3}]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pipeline_skips_exactly_the_next_batches(workers: int) -> None:
    """The uninterrupted stream less the skipped batches, a save after the skip restoring the
    rest exactly; every id of the epoch is handed out once or skipped."""
    expected = take(loader_of(blend((1.0, 1.0)), workers), 10**6)
    loader = loader_of(blend((1.0, 1.0)), workers)
    got = take(loader, 7)
    assert loader.skip(4) == 4
    state = loader.state_dict()
    restored = loader_of(blend((1.0, 1.0)), workers)
    restored.load_state_dict(state)
    got += take(restored, 10**6)
    assert got == expected[:7] + expected[11:]
    skipped = [i for batch in expected[7:11] for i in batch]
    assert sorted([i for batch in got for i in batch] + skipped) == every_id(2)
    assert restored.save_state_rank()["history"] == [{"epoch": 0, "step": 7, "skip": 4}]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restore_from_an_older_checkpoint_leaves_out_a_range_of_steps(workers: int) -> None:
    """The loss-spike recipe: steps 0-29 ran and a checkpoint was saved at step 10; restored
    there, trained to step 14, ``skip(3)`` leaves out steps 14-16 and continues at step 17."""
    loader = loader_of(blend((1.0, 1.0)), workers)
    expected = take(loader, 10)
    checkpoint = loader.state_dict()
    expected += take(loader, 20)
    restored = loader_of(blend((1.0, 1.0)), workers)
    restored.load_state_dict(checkpoint)
    got = take(restored, 4)
    restored.skip(3)
    got += take(restored, 13)
    assert got == expected[10:14] + expected[17:30]


def test_a_skip_before_the_loop_is_the_loops_and_ends_with_the_epoch() -> None:
    reference = loader_of(blend((1.0, 1.0)), 0)
    expected, next_epoch = take(reference, 10**6), take(reference, 2)
    loader = loader_of(blend((1.0, 1.0)), 0)
    loader.load_state_dict(loader.state_dict())  # restored, no iterator yet
    assert loader.skip(2) == 2  # from the iterator the next iter(loader) returns
    assert take(loader, 3) == expected[2:5]
    assert loader.skip(10**6) == len(expected) - 5  # up to the epoch's end, not beyond
    assert take(loader, 2) == next_epoch


@MODEL_EXAMPLES
@given(spec=pipelines(max_length=40), data=st.data())
def test_skip_then_restore_is_the_uninterrupted_run_less_the_skipped_items(
    spec: PipelineSpec, data: st.DataObject
) -> None:
    """Random pipelines: stop after ``k`` items of the first epoch, skip ``n``, save, restore
    into a fresh loader: what follows is the uninterrupted run's epoch from item ``k + n``."""
    expected, _ = record_events(el.SavableDataLoader(spec.build()), 2)
    first_epoch = expected.index(END)
    assume(first_epoch >= 2)
    k = data.draw(st.integers(0, first_epoch - 2), label="stop")
    n = data.draw(st.integers(1, min(5, first_epoch - k - 1)), label="skip")
    loader = el.SavableDataLoader(spec.build())
    got, _ = record_events(loader, 1, stop=k)  # (its iterator made, also when k is 0)
    assert loader.skip(n) == n
    restored = el.SavableDataLoader(spec.build())
    restored.load_state_dict(loader.state_dict())
    rest, _ = record_events(restored, 2)
    report = compare_events(expected[:k] + expected[k + n :], got + rest)
    assert report is None, report


# -- changes -----------------------------------------------------------------------------------


def _saved_after(pipeline: el.SavableDataset, workers: int, batches: int) -> tuple[Any, list]:
    loader = loader_of(pipeline, workers)
    handed = take(loader, batches)
    return loader.state_dict(), handed


@pytest.mark.parametrize("workers", [0, 2])
def test_new_blend_weights_continue_every_source_and_follow_the_new_weights(workers: int) -> None:
    """Saved at 0.5 / 0.5 after 1,000 samples, restored at 0.8 / 0.2: undeclared it is refused
    as before; declared, the next 10,000 samples draw source 0 with 0.8 (within 2%), the epoch
    hands out every id of both sources once, and the state records the change."""
    state, before = _saved_after(blend((0.5, 0.5)), workers, 20)
    with pytest.raises(el.StateMismatchError, match=r"weights.*changes=") as refused:
        loader_of(blend((0.8, 0.2)), workers).load_state_dict(state)
    assert "saved 0.5, now 0.8" in str(refused.value)
    loader = loader_of(blend((0.8, 0.2)), workers, changes=["BlendDataset.weights"])
    loader.load_state_dict(state)
    after = take(loader, 10_000 // BATCH)
    drawn = Counter(i // BASE for batch in after for i in batch)
    assert abs(drawn[0] / 10_000 - 0.8) < 0.02, drawn
    history = loader.save_state_rank()["history"]
    after += take(loader, 10**6)
    assert sorted(i for batch in before + after for i in batch) == every_id(2)
    (entry,) = history
    assert (entry["epoch"], entry["step"]) == (0, 20)
    assert entry["changes"] == [
        {"stage": "BatchDataset > BlendDataset", "field": "weights",
         "before": [0.5, 0.5], "after": [0.8, 0.2]}
    ]  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_an_appended_source_starts_at_its_beginning(workers: int) -> None:
    """A third source appended at the restore: its first samples are the first of its order
    (as a run of it alone yields them) and the epoch hands out every id of all three once."""
    state, before = _saved_after(blend((1.0, 1.0)), workers, 20)
    loader = loader_of(blend((1.0, 1.0, 1.0)), workers, changes=["BlendDataset.sources"])
    loader.load_state_dict(state)
    after = take(loader, 10**6)
    assert sorted(i for batch in before + after for i in batch) == every_id(3)
    # The source drawn alone in the same place: its first batch in each of the 2 partitions
    # holds that partition's first 50 of its order; the first 8 drawn after the restore are
    # among them, whichever partitions drew them.
    alone = loader_of(blend((0.0, 0.0, 1.0)), workers)
    own_order = [i for batch in take(alone, 2) for i in batch]
    first_seen = [i for batch in after for i in batch if i >= 2 * BASE][:8]
    assert set(first_seen) <= set(own_order), (first_seen, own_order)
    entry = loader.save_state_rank()["history"][0]["changes"]
    assert {(c["field"], str(c["before"]), str(c["after"])) for c in entry} == {
        ("sources", "2", "3"), ("weights", "[1.0, 1.0]", "[1.0, 1.0, 1.0]")
    }  # fmt: skip


def test_weight_zero_takes_a_source_out_of_the_mix() -> None:
    state, before = _saved_after(blend((1.0, 1.0)), 0, 20)
    loader = loader_of(blend((1.0, 0.0)), 0, changes=["BlendDataset.weights"])
    loader.load_state_dict(state)
    after = [i for batch in take(loader, 10**6) for i in batch]
    assert all(i < BASE for i in after)
    assert sorted([i for batch in before for i in batch if i < BASE] + after) == every_id(1)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("size", [4, 400])
def test_a_shuffle_buffer_of_another_size_continues_and_restores_exactly(
    workers: int, size: int
) -> None:
    """Saved with a buffer of 40, restored with ``size``: a smaller one drains down to it, a
    larger one fills up; nothing is lost or repeated, and a save while it drains restores
    exactly (the rest of the run compared batch by batch)."""
    state, before = _saved_after(blend((1.0, 1.0), buffer=40), workers, 20)
    declared = ["ShuffleBufferDataset.size"]
    loader = loader_of(blend((1.0, 1.0), buffer=size), workers, changes=declared)
    loader.load_state_dict(state)
    after = take(loader, 1)  # 50 items: a buffer of 4 is still draining 40
    again = loader.state_dict()
    after += take(loader, 10**6)
    assert sorted(i for batch in before + after for i in batch) == every_id(2)
    restored = loader_of(blend((1.0, 1.0), buffer=size), workers)
    restored.load_state_dict(again)
    assert take(restored, 10**6) == after[1:]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_save_before_the_changed_pipeline_hands_anything_out_restores_the_same(
    workers: int,
) -> None:
    """Saved right after a restore with changes (each partition still at its old checkpoint):
    restoring that state gives the stream the changed restore gives."""
    state, _ = _saved_after(blend((0.5, 0.5)), workers, 20)
    changed = loader_of(blend((0.8, 0.2)), workers, changes=["BlendDataset.weights"])
    changed.load_state_dict(state)
    echo = changed.state_dict()
    expected = take(changed, 40)
    again = loader_of(blend((0.8, 0.2)), workers)  # nothing to declare: the config is saved
    again.load_state_dict(echo)
    assert take(again, 40) == expected


def _through(way: str, loader: el.SavableDataLoader, folder: Path) -> Any:
    """A restore of ``loader``'s state through a per-rank file or a DCP folder: the function
    that restores it into another loader."""
    import torch.distributed.checkpoint as dcp

    if way == "rank_file":
        el.save_state_rank_file(loader, folder)
        return lambda other: el.restore_state_rank_file(other, folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"loader": loader.state_dict()}, checkpoint_id=folder, no_dist=True)

    def load(other: el.SavableDataLoader) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({"loader": other}, checkpoint_id=folder, no_dist=True)

    return load


@pytest.mark.parametrize("way", ["rank_file", "dcp"])
def test_a_changed_restore_saved_again_restores_through_files_and_dcp(
    tmp_path: Path, way: str
) -> None:
    """A state with pending changes (2 workers, one has handed nothing out since the changed
    restore) and a history, written as a rank file or a DCP checkpoint: restored, it yields
    what the changed loader yields, to the end of the next epoch."""
    state, _ = _saved_after(blend((0.5, 0.5)), 2, 20)
    changed = loader_of(blend((0.8, 0.2)), 2, changes=["BlendDataset.weights"])
    changed.load_state_dict(state)
    changed.skip(1)  # one item, from worker 0
    restore = _through(way, changed, tmp_path / way)
    expected = take(changed, 10**6) + take(changed, 10**6)  # this epoch and the next
    again = loader_of(blend((0.8, 0.2)), 2)
    restore(again)
    assert take(again, 10**6) + take(again, 10**6) == expected
    history = again.save_state_rank()["history"]
    assert [("skip" in e, "changes" in e) for e in history] == [(False, True), (True, False)]


def test_a_declared_change_leaves_every_other_difference_refused() -> None:
    state, _ = _saved_after(blend((0.5, 0.5)), 0, 5)
    reseeded = [
        (el.IndexedSource([{"id": i} for i in range(LENGTH)], shuffle=True, seed=9), 0.8),
        (el.IndexedSource([{"id": BASE + i} for i in range(LENGTH)], shuffle=True, seed=1), 0.2),
    ]
    pipeline = el.BatchDataset(el.BlendDataset(*reseeded, on_exhausted="drop"), BATCH)
    loader = loader_of(pipeline, 0, changes=["BlendDataset.weights"])
    with pytest.raises(el.StateMismatchError, match=r"IndexedSource\.seed: saved 0, now 9"):
        loader.load_state_dict(state)
    same = loader_of(blend((0.5, 0.5)), 0, changes=["BlendDataset.weights"])
    same.load_state_dict(state)  # declared, nothing changed: restores as before
    assert "history" not in same.save_state_rank()


def test_a_change_of_what_a_counted_epoch_draws_on_several_ranks_warns() -> None:
    """Two ranks of a blend whose epoch is counted (equal steps): a source taken out mid-epoch
    leaves fewer items than the count, which the restore says; other weights do not."""

    def rank_loader(rank: int, weights: tuple[float, ...], **options: Any) -> Any:
        config = el.WorkerConfig(rank, 2, 0, seed=SEED)
        return el.SavableDataLoader(blend(weights), worker_config=config, **options)

    saving = rank_loader(0, (1.0, 1.0))
    take(saving, 5)
    state = saving.save_state_rank()
    declared = {"changes": ["BlendDataset.weights"]}
    with pytest.warns(UserWarning, match="ranks may take unequal steps"):
        rank_loader(0, (1.0, 0.0), **declared).restore_state_rank(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rank_loader(0, (1.0, 3.0), **declared).restore_state_rank(state)
    # A fixed epoch over an endless blend: its count holds whatever the blend draws.
    endless = [
        el.RepeatDataset(el.IndexedSource([{"id": 50 * s + i} for i in range(50)])) for s in (0, 1)
    ]

    def epochs(weights: tuple[float, ...], **options: Any) -> Any:
        mixed = el.BlendDataset(*zip(endless, weights))
        config = el.WorkerConfig(0, 2, 0, seed=SEED)
        pipeline = el.BatchDataset(el.EpochizeDataset(mixed, 400), 4)
        return el.SavableDataLoader(pipeline, worker_config=config, **options)

    saving = epochs((1.0, 1.0))
    take(saving, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        epochs((1.0, 0.0), **declared).restore_state_rank(saving.save_state_rank())


def test_changes_and_skip_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"BlendDataset\.weights, BlendDataset\.sources"):
        loader_of(blend((1.0, 1.0)), 0, changes=["BlendDataset.seed"])
    with pytest.raises(TypeError, match="a list of the changes"):
        loader_of(blend((1.0, 1.0)), 0, changes="BlendDataset.weights")
    with pytest.raises(ValueError, match="plain Squares"):
        el.SavableDataLoader(Squares(), changes=["BlendDataset.weights"])
    with pytest.raises(ValueError, match="items"):
        loader_of(blend((1.0, 1.0)), 0).skip(0)
    with pytest.raises(TypeError, match="no position to skip"):
        el.BasicDataLoader(blend((1.0, 1.0))).skip(1)


def test_an_edited_pending_change_or_history_is_refused() -> None:
    state, _ = _saved_after(blend((0.5, 0.5)), 0, 20)
    changed = loader_of(blend((0.8, 0.2)), 0, changes=["BlendDataset.weights"])
    changed.load_state_dict(state)
    rank_state = changed.save_state_rank()
    edited = json.loads(json.dumps(rank_state))
    edited["partitions"][0]["changes"][0]["before"] = [0.6, 0.4]
    with pytest.raises(el.StateFormatError, match="changes"):
        loader_of(blend((0.8, 0.2)), 0).restore_state_rank(edited)
    edited = json.loads(json.dumps(rank_state))
    edited["history"][0]["step"] = 3
    with pytest.raises(el.StateFormatError, match="history"):
        loader_of(blend((0.8, 0.2)), 0).restore_state_rank(edited)


# -- on record: inspect and replay -------------------------------------------------------------


def replay_pipeline() -> el.SavableDataLoader:
    """What ``replay --pipeline tests.test_steering:replay_pipeline`` builds."""
    return loader_of(blend((0.8, 0.2)), 0, changes=["BlendDataset.weights"])


def test_inspect_and_replay_show_the_history_and_replay_what_training_got(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, _ = _saved_after(blend((0.5, 0.5)), 0, 20)
    loader = replay_pipeline()
    loader.load_state_dict(state)
    take(loader, 3)
    loader.skip(2)
    take(loader, 1)
    path = tmp_path / "state.pt"
    torch.save(loader.save_state_rank(), path)
    trained = [batch["__restore_key__"] for _, batch in zip(range(4), loader)]
    assert inspect_cli.main([str(path)]) == 0
    shown = capsys.readouterr().out
    assert "epoch 0, step 20: restored with changes to BatchDataset > BlendDataset.weights" in shown
    assert "epoch 0, step 23: skipped 2 item(s)" in shown
    spec = "tests.test_steering:replay_pipeline"
    assert replay_cli.main(["--pipeline", spec, str(path), "--steps", "0:4", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["key"] for row in rows] == json.loads(json.dumps(trained))
    assert replay_cli.main(["--pipeline", spec, str(path), "--steps", "0:1"]) == 0
    assert "skipped 2 item(s)" in capsys.readouterr().out


# -- across a resize: 2 ranks -> 3 ----------------------------------------------------------

RESIZE_PARTITIONS = 6
RESIZE_LENGTH = 600  # ids of a source


def resize_loader(weights: tuple[float, ...], workers: int, **options: Any) -> Any:
    sources = [
        el.IndexedSource([{"id": BASE * s + i} for i in range(RESIZE_LENGTH)], shuffle=True, seed=s)
        for s in range(len(weights))
    ]
    pipeline = el.BatchDataset(el.BlendDataset(*zip(sources, weights), on_exhausted="drop"), 5)
    config = el.WorkerConfig.from_process_group(num_workers=workers, seed=SEED)
    return el.SavableDataLoader(
        pipeline, worker_config=config, num_partitions=RESIZE_PARTITIONS,
        multiprocessing_context="fork", **options,
    )  # fmt: skip


def resize_save(rank: int, world_size: int, workdir: Path) -> None:
    """2 ranks: 10 steps, skip 2, 5 steps, gather the states to rank 0."""
    loader = resize_loader((1.0, 1.0), 0)
    iterator = iter(loader)
    trained = [ids(next(iterator)) for _ in range(10)]
    assert loader.skip(2) == 2
    trained += [ids(next(iterator)) for _ in range(5)]
    states = loader.save_state_global()
    if rank == 0:
        dh.save_json(workdir / "states.json", states)
    dh.save_json(workdir / f"before{rank}.json", trained)


def resize_restore(rank: int, world_size: int, workdir: Path, *, workers: int) -> None:
    """3 ranks, with ``workers`` workers and weights 1 / 3: the rest of the epoch."""
    loader = resize_loader((1.0, 3.0), workers, changes=["BlendDataset.weights"])
    states = json.loads((workdir / "states.json").read_text())
    loader.restore_state_global(states if rank == 0 else None, src_rank=0)
    trained = [ids(batch) for batch in loader]
    dh.save_json(workdir / f"after{rank}.json", trained)
    dh.save_json(workdir / f"history{rank}.json", loader.save_state_rank()["history"])


@pytest.mark.parametrize("workers", [0, 2])
def test_skips_and_changes_carry_across_a_resize_from_two_ranks_to_three(
    tmp_path: Path, workers: int
) -> None:
    """Nothing lost or repeated over the epoch but the skipped items (2 steps of 2 ranks), the
    3 ranks take as many steps each, source 1 is drawn about 3 times as often after the
    restore, and every rank's state holds the skip and the change."""
    dh.launch(resize_save, 2, tmp_path, timeout=120)
    dh.launch(resize_restore, 3, tmp_path, timeout=120, workers=workers)

    def read(name: str, ranks: int) -> list[Any]:
        return [json.loads((tmp_path / f"{name}{r}.json").read_text()) for r in range(ranks)]

    before, after = read("before", 2), read("after", 3)
    handed = [i for run in before + after for batch in run for i in batch]
    assert len(handed) == len(set(handed))
    everything = {BASE * s + i for s in range(2) for i in range(RESIZE_LENGTH)}
    assert len(everything - set(handed)) == 2 * 2 * 5  # the skipped steps, nothing else
    assert len({len(run) for run in after}) == 1, [len(run) for run in after]
    drawn = Counter(i // BASE for run in after for batch in run[:20] for i in batch)
    assert drawn[1] > 2 * drawn[0], drawn
    for history in read("history", 3):
        assert [("skip" in e, "changes" in e) for e in history] == [(True, False), (False, True)]
