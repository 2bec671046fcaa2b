"""Elastic resume: a job stream that depends only on the partitions, and restores across layouts.

Ranks are simulated in one process with explicit ``WorkerConfig`` s (the real multi-process
version is in tests/test_distributed.py). ``G`` is the job's stream: step ``s`` of rank ``r``
is ``G[s * world_size + r]``.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import energy_loader as el
from energy_loader import distributed as eld
from energy_loader.loader.partitions import PartitionLayout, next_worker, resolve_num_partitions
from energy_loader.testing.compare import first_difference
from energy_loader.testing.strategies import PipelineSpec, pipelines

SEED = 7


def _loaders(build, world_size: int, workers: int, partitions: int) -> list[el.SavableDataLoader]:
    return [
        el.SavableDataLoader(
            build(),
            worker_config=el.WorkerConfig(
                rank=rank, world_size=world_size, num_workers=workers, seed=SEED
            ),
            num_partitions=partitions,
        )
        for rank in range(world_size)
    ]


def _job_stream(loaders: list[el.SavableDataLoader], steps: int) -> list[Any]:
    """``steps`` steps of every rank, interleaved rank by rank: a prefix of ``G``."""
    iterators = [iter(loader) for loader in loaders]
    stream = []
    for _ in range(steps):
        for iterator in iterators:
            stream.append(next(iterator))
    return stream


def _same(expected: list[Any], got: list[Any]) -> None:
    assert len(expected) == len(got)
    for position, (a, b) in enumerate(zip(expected, got)):
        detail = first_difference(a, b)
        assert detail is None, f"G[{position}] differs: {detail}"


def _close(loaders: list[el.SavableDataLoader]) -> None:
    for loader in loaders:
        loader._shutdown_workers()


# -- the arithmetic --------------------------------------------------------------------------


@given(
    world_size=st.integers(1, 4),
    workers=st.integers(0, 5),
    per_rank=st.integers(1, 6),
    start=st.integers(0, 50),
)
def test_assignment_matches_the_job_stream(
    world_size: int, workers: int, per_rank: int, start: int
) -> None:
    # G[B + s*R + r] comes from partition (B + s*R + r) % P. A worker takes its partitions
    # round-robin; the main process takes each item from the worker next_worker names.
    partitions = world_size * per_rank
    layout = PartitionLayout(partitions, world_size, workers, start % partitions)
    for rank in range(world_size):
        owned = [layout.worker_partitions(rank, w) for w in range(max(1, workers))]
        assert sorted(p for w in owned for p in w) == sorted(layout.rank_partitions(rank))
        assert max(map(len, owned)) - min(map(len, owned)) <= 1  # as even as it gets
        turns = [0] * len(owned)
        worker = 0
        for step in range(3 * partitions):
            slot = turns[worker]
            assert owned[worker][slot] == (start + step * world_size + rank) % partitions
            turns[worker] = (slot + 1) % len(owned[worker])
            worker = next_worker(worker, slot, per_rank, workers)
    everyone = [p for r in range(world_size) for p in layout.rank_partitions(r)]
    assert sorted(everyone) == list(range(partitions))


def test_partitions_must_split_over_the_ranks_and_suit_any_worker_count() -> None:
    assert resolve_num_partitions(None, 2, 3) == 6
    assert resolve_num_partitions(12, 2, 5) == 12  # 6 a rank over 5 workers: uneven, allowed
    with pytest.raises(ValueError, match=r"world size in \[1, 2, 5, 10\]"):
        resolve_num_partitions(10, 3, 0)
    with pytest.raises(TypeError, match="positive integer or None"):
        resolve_num_partitions(2.0, 1, 0)
    source = el.IndexedSource.from_fn(10, lambda i: i)
    with pytest.warns(UserWarning, match="1 worker\\(s\\) per rank will idle"):
        el.SavableDataLoader(source, num_workers=3, num_partitions=2)


# -- lengths ------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1, 2, 4])
def test_limit_and_epochize_count_the_job_not_the_worker(workers: int) -> None:
    limited = el.LimitDataset(el.IndexedSource.from_fn(1000, lambda i: {"i": i}), 100)
    loader = el.SavableDataLoader(limited, num_workers=workers)
    assert len(loader) == 100
    assert len(list(loader)) == 100
    endless = el.RepeatDataset(el.IndexedSource.from_fn(7, lambda i: {"i": i}))
    epochs = el.SavableDataLoader(el.EpochizeDataset(endless, 30), num_workers=workers)
    assert len(epochs) == 30
    assert [len(list(epochs)) for _ in range(2)] == [30, 30]


def test_limit_over_ranks_adds_up_to_the_length() -> None:
    def build() -> el.SavableDataset:
        return el.LimitDataset(el.IndexedSource.from_fn(1000, lambda i: {"i": i}), 101)

    loaders = _loaders(build, 3, 0, 6)
    counts = [len(list(loader)) for loader in loaders]
    assert sum(counts) == 101 and [len(loader) for loader in loaders] == counts


# -- the job stream does not depend on the layout -----------------------------------------------


def _layouts(partitions: int) -> st.SearchStrategy[tuple[int, int]]:
    options = [
        (ranks, workers)
        for ranks in (1, 2, 3)
        for workers in (0, 1, 2, 3)
        if partitions % ranks == 0 and ranks * max(1, workers) <= 4
    ]
    return st.sampled_from(options)


def _endless(spec: PipelineSpec):
    def build() -> el.SavableDataset:
        return el.RepeatDataset(spec.build())

    return build


def _every_partition_yields(spec: PipelineSpec, partitions: int) -> bool:
    for partition in range(partitions):
        pipeline = spec.build()
        pipeline.bind(el.WorkerContext(partition=partition, num_partitions=partitions, seed=SEED))
        if next(pipeline.iter_keyed(), None) is None:
            return False
    return True


@settings(max_examples=6)
@given(data=st.data(), spec=pipelines(max_length=40, max_depth=4, max_shards=12))
def test_stream_and_restore_are_independent_of_the_layout(data: st.DataObject, spec) -> None:
    partitions = data.draw(st.sampled_from([2, 4, 6, 12]), label="num_partitions")
    assume(_every_partition_yields(spec, partitions))
    (r1, w1) = data.draw(_layouts(partitions), label="saved on (ranks, workers)")
    (r2, w2) = data.draw(_layouts(partitions), label="restored on (ranks, workers)")
    build = _endless(spec)
    steps = 12
    reference = _loaders(build, 1, 0, partitions)
    expected = _job_stream(reference, steps * 6)
    _close(reference)
    # (a) The same stream on another layout.
    first = _loaders(build, r1, w1, partitions)
    head_steps = data.draw(st.integers(0, steps), label="stop step")
    head = _job_stream(first, head_steps)
    _same(expected[: len(head)], head)
    # (b) Save every rank, restore on the other layout (from the list of every rank's states,
    # or from per-rank files, each rank reading only its slots), continue.
    via = data.draw(st.sampled_from(["list", "files"]), label="restored through")
    states = [json.loads(json.dumps(loader.save_state_rank())) for loader in first]
    second = _loaders(build, r2, w2, partitions)
    with tempfile.TemporaryDirectory() as folder:
        for loader in first:
            eld.save_state_rank_file(loader, folder)
        _close(first)
        for loader in second:
            if via == "files":
                eld.restore_state_rank_file(loader, folder)
            else:
                loader.restore_state_global(states)
    more = (len(expected) - len(head)) // r2 // 2
    tail = _job_stream(second, more)
    _close(second)
    _same(expected[len(head) : len(head) + len(tail)], tail)


def test_workers_change_restores_from_the_rank_state_alone() -> None:
    def build() -> el.SavableDataset:
        source = el.IndexedSource.from_fn(200, lambda i: {"i": i}, shuffle=True, seed=3)
        return el.BatchDataset(el.ShuffleBufferDataset(source, 8), 4)

    def ids(batch: dict[str, Any]) -> list[int]:
        return [int(i) for i in batch["i"]]

    full = [ids(b) for b in el.SavableDataLoader(build(), num_workers=2, num_partitions=4)]
    loader = el.SavableDataLoader(build(), num_workers=2, num_partitions=4)
    iterator = iter(loader)
    head = [ids(next(iterator)) for _ in range(7)]
    state = loader.save_state_rank()
    for workers in (0, 1, 4):
        other = el.SavableDataLoader(build(), num_workers=workers, num_partitions=4)
        other.restore_state_rank(state)
        rest = [ids(b) for b in other]
        assert sorted(i for batch in head + rest for i in batch) == list(range(200))
        assert head + rest[:12] == full[:19]


@pytest.mark.parametrize("workers", [1, 3, 4])
def test_a_default_partition_state_resumes_on_any_worker_count(workers: int) -> None:
    # Saved with the default num_partitions on 2 workers (P=2), restored by a loader that was
    # given no num_partitions: it adopts P=2 (3 and 4 workers: some idle, with a warning).
    def build() -> el.SavableDataset:
        source = el.IndexedSource.from_fn(90, lambda i: {"i": i}, shuffle=True, seed=3)
        return el.ShuffleBufferDataset(source.map(_noisy), 6).batch(3)

    def rows(batch: dict[str, Any]) -> list[tuple[int, float]]:
        return [(int(i), float(x)) for i, x in zip(batch["i"], batch["noise"])]

    full = [rows(b) for b in el.SavableDataLoader(build(), num_workers=2)]
    loader = el.SavableDataLoader(build(), num_workers=2)
    iterator = iter(loader)
    head = [rows(next(iterator)) for _ in range(5)]
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    other = el.SavableDataLoader(build(), num_workers=workers)
    if workers > 2:
        with pytest.warns(UserWarning, match="will idle"):
            other.load_state_dict(state)
    else:
        other.load_state_dict(state)
    assert other.num_partitions == 2 and len(other) == len(full)
    rest = [rows(b) for b in other]
    other.close()
    assert head + rest == full
    again = el.SavableDataLoader(build(), num_workers=workers, num_partitions=3)
    with pytest.raises(el.StateMismatchError, match="leave num_partitions unset"):
        again.load_state_dict(state)


def _noisy(sample: dict[str, Any]) -> dict[str, Any]:
    import random

    return {**sample, "noise": random.random()}


def test_refusals_say_what_differs() -> None:
    def build() -> el.SavableDataset:
        return el.IndexedSource.from_fn(40, lambda i: {"i": i})

    loaders = _loaders(build, 2, 0, 4)
    for loader in loaders:
        next(iter(loader))
    states = [loader.save_state_rank() for loader in loaders]
    other_p = _loaders(build, 2, 0, 2)[0]
    with pytest.raises(el.StateMismatchError, match="num_partitions=4"):
        other_p.restore_state_global(states)
    one_rank = _loaders(build, 1, 0, 4)[0]
    with pytest.raises(el.StateMismatchError, match="missing"):
        one_rank.restore_state_rank(states[1])
    with pytest.raises(el.StateMismatchError, match="holds 1 rank states"):
        one_rank.restore_state_global(states[:1])


# -- stateful: move the job between layouts again and again ---------------------------------------

_MACHINE_PIPELINE = PipelineSpec(
    length=48,
    shuffle=True,
    seed=11,
    stages=(
        ("map", None),
        ("filter", 5),
        ("shuffle_buffer", 5),
        ("pack", (6, 2, "split", False)),
        ("batch", (2, False)),
    ),
)
_MACHINE_PARTITIONS = 4


class ElasticJobMachine(RuleBasedStateMachine):
    """A job on one layout, saved and restored onto another layout at any step, repeatedly.

    The model is the job's stream ``G`` of an endless pipeline, computed on one rank in one
    process (60 steps: the source's epochs over and over); after every step of every rank the
    streams must have continued ``G`` exactly, whether the states went through
    restore_state_global, through the partition leaves of state_dict() (the
    torch.distributed.checkpoint form) or through per-rank files (each rank reading its slots).
    """

    @initialize(layout=st.sampled_from([(1, 0), (2, 0), (1, 2), (2, 2), (4, 0), (1, 3)]))
    def start(self, layout: tuple[int, int]) -> None:
        self.build = _endless(_MACHINE_PIPELINE)
        reference = _loaders(self.build, 1, 0, _MACHINE_PARTITIONS)
        self.expected = _job_stream(reference, 60)
        _close(reference)
        self.loaders = _loaders(self.build, *layout, _MACHINE_PARTITIONS)
        self.iterators = [iter(loader) for loader in self.loaders]
        self.position = 0

    @precondition(lambda self: self.position + 4 <= 60)
    @rule()
    def step(self) -> None:
        got = [next(iterator) for iterator in self.iterators]
        _same(self.expected[self.position : self.position + len(got)], got)
        self.position += len(got)

    @rule(
        layout=st.sampled_from([(1, 0), (2, 0), (1, 1), (2, 1), (4, 0), (1, 3), (2, 2)]),
        via=st.sampled_from(["list", "leaves", "files"]),
    )
    def move(self, layout: tuple[int, int], via: str) -> None:
        leaves: dict[str, str] = {}
        states = []
        with tempfile.TemporaryDirectory() as folder:
            for loader in self.loaders:
                if via == "leaves":
                    leaves.update(loader.state_dict())
                elif via == "files":
                    eld.save_state_rank_file(loader, folder)
                else:
                    states.append(json.loads(json.dumps(loader.save_state_rank())))
            _close(self.loaders)
            self.loaders = _loaders(self.build, *layout, _MACHINE_PARTITIONS)
            for loader in self.loaders:
                if via == "leaves":
                    loader.load_state_dict(leaves)
                elif via == "files":
                    eld.restore_state_rank_file(loader, folder)
                else:
                    loader.restore_state_global(states)
        self.iterators = [iter(loader) for loader in self.loaders]

    def teardown(self) -> None:
        _close(getattr(self, "loaders", []))


ElasticJobMachine.TestCase.settings = settings(
    max_examples=8, stateful_step_count=12, deadline=None
)
TestElasticJobMachine = ElasticJobMachine.TestCase
