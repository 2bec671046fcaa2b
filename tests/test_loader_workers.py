"""SavableDataLoader with worker processes (docs/loader.md)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import statistics
import time

import pytest
import torch

import energy_loader as el
from energy_loader.state.positions import CheckpointRing
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import AddNoise, MakeSample
from tests.helpers import indices, reference_pipeline
from tests.loader_helpers import CountReads, fail_at_seven, slow_sample, where_am_i

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.timeout(60)
def test_saving_never_waits_for_a_slow_sample() -> None:
    source = el.IndexedSource.from_fn(200, slow_sample)
    loader = el.SavableDataLoader(el.MapDataset(source, AddNoise()), num_workers=2)
    iterator = iter(loader)
    durations = []
    for _ in range(12):
        next(iterator)
        start = time.perf_counter()
        loader.save_state_rank()
        durations.append(time.perf_counter() - start)
    del iterator, loader
    # Each sample takes 100 ms to make; a save that waited for one would take >= 50 ms.
    assert max(durations) < 0.05, durations
    assert statistics.median(durations) < 0.01, durations


@pytest.mark.timeout(60)
def test_a_killed_worker_raises_worker_error_not_a_hang() -> None:
    source = el.IndexedSource.from_fn(10_000, slow_sample)
    loader = el.SavableDataLoader(source, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    victim = loader._iterator._workers[1]
    os.kill(victim.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(el.WorkerError, match="worker"):
        for _ in range(10_000):
            next(iterator)
    assert time.monotonic() - start < 15
    with pytest.raises(el.WorkerError, match="worker 1"):
        loader.save_state_rank()
    loader.reset_state()


@pytest.mark.timeout(60)
def test_user_error_in_a_worker_carries_the_traceback_and_the_loader_restores_after() -> None:
    def build() -> el.SavableDataset:
        return el.MapDataset(el.IndexedSource.from_fn(20, MakeSample()), fail_at_seven)

    loader = el.SavableDataLoader(build(), num_workers=2)
    iterator = iter(loader)
    got = [next(iterator)["index"] for _ in range(4)]
    state = loader.save_state_rank()
    with pytest.raises(el.WorkerError) as info:
        list(iterator)
    assert "sample 7 is cursed" in info.value.original_traceback
    assert "fail_at_seven" in info.value.original_traceback
    loader.restore_state_rank(state)
    iterator = iter(loader)
    assert [next(iterator)["index"] for _ in range(2)] == [4, 5]
    assert got == [0, 1, 2, 3]
    loader.reset_state()


@pytest.mark.timeout(60)
def test_after_a_worker_error_workers_stop_at_once_and_saving_refuses() -> None:
    loader = el.SavableDataLoader(
        el.MapDataset(el.IndexedSource.from_fn(20, MakeSample()), fail_at_seven), num_workers=2
    )
    iterator = iter(loader)
    with pytest.raises(el.WorkerError):
        list(iterator)
    assert loader._iterator is None, "the workers must be stopped when the error is raised"
    with pytest.raises(el.WorkerError, match="restore it from the last saved state"):
        loader.save_state_rank()
    start = time.monotonic()
    del iterator, loader
    assert time.monotonic() - start < 2


def test_state_dict_is_a_json_leaf_per_partition_and_load_state_dict_takes_every_form() -> None:
    loader = el.SavableDataLoader(reference_pipeline(60, 8, 4), num_partitions=2)
    assert sorted(loader.state_dict()) == ["slot_00000", "slot_00001"]
    iterator = iter(loader)
    next(iterator)
    wrapped = loader.state_dict()
    # One item taken: the job stands at partition 1, which is slot 0 from there.
    assert sorted(wrapped) == ["slot_00000", "slot_00001"]
    assert '"partition":{"partition":1' in wrapped["slot_00000"]
    assert all(isinstance(leaf, str) for leaf in wrapped.values())
    rest = [indices(b) for b in iterator]
    for form in (wrapped, loader_state_after(wrapped)):
        restored = el.SavableDataLoader(reference_pipeline(60, 8, 4), num_partitions=2)
        restored.load_state_dict(form)
        assert [indices(b) for b in restored] == rest
    with pytest.raises(el.StateFormatError, match="not valid JSON"):
        loader.load_state_dict({**wrapped, "slot_00001": wrapped["slot_00001"][:-5]})
    swapped = {"slot_00000": wrapped["slot_00001"], "slot_00001": wrapped["slot_00000"]}
    with pytest.raises(el.StateFormatError, match="whose key is 'slot_00001'"):
        loader.load_state_dict(swapped)


def loader_state_after(wrapped: dict) -> dict:
    from energy_loader.state.rank_state import states_from_entries

    (state,) = states_from_entries(wrapped)
    return state.to_plain()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_restore_replays_at_most_one_checkpoint_interval_plus_in_flight(fraction: float) -> None:
    length, batch, workers, every = 2000, 4, 2, 8
    in_flight = 2 * workers + 1

    def build(counter) -> el.SavableDataset:
        return el.BatchDataset(el.IndexedSource.from_fn(length, CountReads(counter)), batch)

    kwargs = {
        "num_workers": workers,
        "checkpoint_every_n_samples": every,
        "checkpoint_every_sec": None,
    }
    first = el.SavableDataLoader(build(multiprocessing.Value("q", 0)), **kwargs)
    iterator = iter(first)
    consumed = [i for _ in range(int(length / batch * fraction)) for i in indices(next(iterator))]
    state = first.save_state_rank()
    del iterator, first
    in_flight += 2  # held-back saves
    assert all(p["skip"] < every + in_flight for p in state["partitions"])
    reads = multiprocessing.Value("q", 0)
    restored = el.SavableDataLoader(build(reads), **kwargs)
    restored.restore_state_rank(state)
    rest = [i for b in restored for i in indices(b)]
    assert sorted(consumed + rest) == list(range(length))
    replayed = reads.value - len(rest)
    assert 0 <= replayed <= workers * (every + in_flight) * batch, replayed


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    # spawn starts every worker of every epoch from a fresh interpreter (~40 s of imports on
    # 2 cores): slow. forkserver ships the same lambdas with dill to processes without the
    # parent's memory, and test_transport's [spawn] case runs spawned workers by default.
    "method",
    [pytest.param("spawn", marks=pytest.mark.slow), "forkserver"],
)
def test_spawn_and_forkserver_ship_lambdas_with_dill(method: str) -> None:
    def build() -> el.SavableDataset:
        offset = 1000
        source = el.IndexedSource.from_fn(30, lambda i: {"index": i}, shuffle=True, seed=1)
        return el.BatchDataset(
            el.MapDataset(source, lambda s: {**s, "shifted": s["index"] + offset}), 3
        )

    check_resume(
        build,
        num_workers=2,
        stop_points=[4, 11],
        loader_kwargs={"multiprocessing_context": method},
    )


def test_an_unserializable_pipeline_fails_at_construction_naming_the_object() -> None:
    generator = (i for i in range(3))
    pipeline = el.MapDataset(el.IndexedSource.from_fn(5, MakeSample()), lambda s: (s, generator))
    with pytest.raises(TypeError, match=r"MapDataset.fn .* cannot be serialized with dill"):
        el.SavableDataLoader(pipeline, num_workers=1, multiprocessing_context="spawn")


@pytest.mark.timeout(60)
def test_break_mid_epoch_then_iter_again_loses_nothing() -> None:
    loader = el.SavableDataLoader(reference_pipeline(120, 8, 4), num_workers=2)
    reference = [
        indices(b) for b in el.SavableDataLoader(reference_pipeline(120, 8, 4), num_workers=2)
    ]
    got = []
    for batch in loader:
        got.append(indices(batch))
        if len(got) == 5:
            break
    got += [indices(b) for b in loader]
    assert got == reference


@pytest.mark.timeout(60)
def test_restore_while_iterating_restarts_workers_and_invalidates_the_old_iterator() -> None:
    loader = el.SavableDataLoader(reference_pipeline(120, 8, 4), num_workers=2)
    iterator = iter(loader)
    head = [indices(next(iterator)) for _ in range(3)]
    state = loader.save_state_rank()
    [next(iterator) for _ in range(4)]
    loader.restore_state_rank(state)
    with pytest.raises(RuntimeError, match="call iter\\(loader\\) again"):
        next(iterator)
    reference = [
        indices(b) for b in el.SavableDataLoader(reference_pipeline(120, 8, 4), num_workers=2)
    ]
    assert head + [indices(b) for b in loader] == reference


def test_another_worker_count_restores_with_the_same_partitions() -> None:
    state = el.SavableDataLoader(reference_pipeline(50, 4, 4), num_workers=2).save_state_rank()
    # A loader pinned to another count refuses, and its advice works when followed.
    pinned = el.SavableDataLoader(reference_pipeline(50, 4, 4), num_workers=1, num_partitions=1)
    with pytest.raises(el.StateMismatchError, match="Pass num_partitions=2 to the loader"):
        pinned.restore_state_rank(state)
    twin = el.SavableDataLoader(reference_pipeline(50, 4, 4), num_workers=2)
    expected = [indices(b) for b in twin]
    for partitions in (2, None):  # as advised, or unset: the saved count is adopted
        loader = el.SavableDataLoader(
            reference_pipeline(50, 4, 4), num_workers=1, num_partitions=partitions
        )
        loader.restore_state_rank(state)
        assert loader.num_partitions == 2
        assert [indices(b) for b in loader] == expected


@pytest.mark.timeout(60)
def test_current_worker_tells_user_code_where_it_runs() -> None:
    pipeline = el.MapDataset(el.IndexedSource.from_fn(8, MakeSample()), where_am_i)
    samples = list(el.SavableDataLoader(pipeline, num_workers=2))
    assert {(s["index"] % 2, s["worker"]) for s in samples} == {(0, 0), (1, 1)}
    assert len({s["pid"] for s in samples}) == 2
    in_process = list(
        el.SavableDataLoader(el.MapDataset(el.IndexedSource.from_fn(3, MakeSample()), where_am_i))
    )
    assert {s["pid"] for s in in_process} == {os.getpid()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_basic_loader_yields_the_same_samples_and_saves_nothing(workers: int) -> None:
    basic = el.BasicDataLoader(reference_pipeline(60, 8, 4), num_workers=workers)
    savable = el.SavableDataLoader(reference_pipeline(60, 8, 4), num_workers=workers)
    assert [indices(b) for b in basic] == [indices(b) for b in savable]
    with pytest.raises(TypeError, match="does not save state"):
        basic.save_state_rank()


@pytest.mark.timeout(60)
def test_pin_memory_passes_through() -> None:
    with pytest.warns(UserWarning, match="pin_memory"):
        loader = el.SavableDataLoader(reference_pipeline(40, 4, 4), num_workers=1, pin_memory=True)
        assert len([indices(b) for b in loader]) == 10


def test_loader_arguments_are_validated() -> None:
    pipeline = reference_pipeline(20, 4, 4)
    with pytest.raises(ValueError, match="n_checkpoints=1 cannot cover the 7 items"):
        el.SavableDataLoader(pipeline, num_workers=2, n_checkpoints=1)
    with pytest.raises(ValueError, match="`checkpoint_every_n_samples` must be positive"):
        el.SavableDataLoader(pipeline, num_workers=2, checkpoint_every_n_samples=0)
    with pytest.raises(ValueError, match="`checkpoint_every_sec` must be a positive number"):
        el.SavableDataLoader(pipeline, num_workers=2, checkpoint_every_sec=-1)
    with pytest.raises(ValueError, match="`num_workers` must be >= 0"):
        el.SavableDataLoader(pipeline, num_workers=-1)
    with pytest.raises(ValueError, match=r"disagrees with worker_config\.num_workers=2"):
        el.SavableDataLoader(pipeline, num_workers=1, worker_config=el.WorkerConfig(num_workers=2))
    # Not a pipeline: a list is a map-style dataset, run as a drop-in for torch's DataLoader.
    assert [b.tolist() for b in el.SavableDataLoader([1, 2, 3], batch_size=2)] == [[1, 2], [3]]
    with pytest.raises(ValueError, match="`multiprocessing_context` must be"):
        el.SavableDataLoader(pipeline, num_workers=1, multiprocessing_context="threads")


def test_checkpoint_ring_keeps_what_the_main_process_can_still_ask_for() -> None:
    ring = CheckpointRing(capacity=3, in_flight=5)
    for index in range(-1, 40, 8):
        ring.add(index, {"at": index})
    # Newest at 39; the main process has received at least item 34.
    assert ring.find(34) == ({"at": 31}, 3)
    assert ring.find(39) == ({"at": 39}, 0)
    assert not ring.add(40, {"at": 40}, optional=True) or len(ring) <= 3
    with pytest.raises(RuntimeError, match="no checkpoint at or before item 2"):
        ring.find(2)


@pytest.mark.timeout(60)
def test_close_stops_the_workers_and_keeps_the_position(no_leftover_processes) -> None:
    reference = [
        indices(b) for b in el.SavableDataLoader(reference_pipeline(80, 4, 4), num_workers=2)
    ]
    with el.SavableDataLoader(reference_pipeline(80, 4, 4), num_workers=2) as loader:
        iterator = iter(loader)
        head = [indices(next(iterator)) for _ in range(5)]
        loader.close()
        assert loader._iterator is None
        rest = [indices(b) for b in loader]
    assert head + rest == reference


def _dropped_in_a_cycle(kind: str, steps: int | None) -> float:
    """Iterate a new loader with 3 workers (``steps`` items, or its whole epoch), leave it
    and its iterator in a reference cycle, drop them, and return how long collecting the
    cycle took."""
    if kind == "pipeline":
        loader = el.SavableDataLoader(reference_pipeline(200, 8, 4), num_workers=3)
    else:
        data = torch.utils.data.TensorDataset(torch.arange(64))
        loader = el.SavableDataLoader(data, batch_size=4, num_workers=3, persistent_workers=True)
    iterator = iter(loader)
    for _ in iterator if steps is None else range(steps):
        if steps is not None:
            next(iterator)
    cycle: dict = {"loader": loader, "iterator": iterator}
    cycle["self"] = cycle
    del loader, iterator, cycle
    began = time.monotonic()
    gc.collect()
    return time.monotonic() - began


@pytest.mark.timeout(120)
@pytest.mark.parametrize("steps", [3, None], ids=["mid-epoch", "epoch-end"])
@pytest.mark.parametrize("kind", ["pipeline", "drop-in"])
def test_a_loader_collected_in_a_reference_cycle_stops_its_workers_at_once(
    kind, steps, no_leftover_processes
) -> None:
    # Collected in a cycle (held by a stored exception's traceback, a closure), the index
    # queues' finalizers stopped their feeders before torch's __del__ asked the workers to
    # exit: torch then waited 5 s per worker (15 s here) at some later allocation. Unharmed,
    # it takes about 0.3 s; the bound only tells the two apart on a loaded machine.
    gc.collect()
    took = _dropped_in_a_cycle(kind, steps)
    assert took < 8.0, f"collecting the loader took {took:.1f} s (workers left waiting)"
