"""check_resume and check_loader_resume must fail loudly, and say why, on a setup that does
not resume exactly, and pass one that does."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, Sampler, SequentialSampler

import energy_loader as el
from energy_loader.testing import (
    ResumeMismatch,
    check_loader_resume,
    check_resume,
    first_difference,
)
from energy_loader.testing.strategies import MakeSample

from .loader.dropin_helpers import Augmenting


class _CountCalls:
    """Numbers its calls: deterministic within one run, but restarts at 0 after a restore."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        return {**sample, "call": self.calls}


def _make(index: int) -> dict[str, Any]:
    return {"index": index}


def test_check_resume_reports_the_first_divergence() -> None:
    def build() -> el.SavableDataset:
        return el.MapDataset(el.IndexedSource.from_fn(10, _make), _CountCalls())

    with pytest.raises(
        ResumeMismatch,
        match=r"save after 3 batches \(in the loop\).*: batch 3 \(epoch 0, its batch 3\) differs "
        r"\(batch\['call'\]: 4 vs 2\); the same restore keys \(\(3,\)\) gave other samples",
    ):
        # A rolling checkpoint at every item: the restore replays one item only (the last one
        # handed out), so the counter is at 2, not 4, at the first resumed batch. Unchecked:
        # the restore's own check would refuse it first (below).
        check_resume(
            build,
            stop_points=[3],
            loader_kwargs={"checkpoint_every_n_samples": 1, "verify_restore": False},
        )
    with pytest.raises(
        ResumeMismatch,
        match=r"the restore refused to continue: .* with other values .*MapDataset\.fn",
    ):
        check_resume(build, stop_points=[3], loader_kwargs={"checkpoint_every_n_samples": 1})


def _noise(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "noise": torch.rand(2)}


def test_check_resume_names_seed_per_sample_false_when_restore_sample_differs() -> None:
    # Each worker's draws repeat from the worker's start (the run from the start is exact),
    # but restore_sample re-makes a sample in the main process without the per-sample seeds.
    def build() -> el.SavableDataset:
        return el.MapDataset(el.IndexedSource.from_fn(6, _make), _noise, seed_per_sample=False)

    with pytest.raises(
        ResumeMismatch,
        match=r"restore_sample\(\(0,\)\) differs from the sample: sample\['noise'\]: tensor "
        r"values differ; .*likely cause: MapDataset\(.*_noise\) draws random numbers with "
        r"seed_per_sample=False",
    ):
        check_resume(build, num_workers=2, stop_points=[0], epochs=1)


def _noisy_read(index: int) -> dict[str, Any]:
    return {"index": index, "noise": torch.rand(2)}


def test_check_resume_names_an_unseeded_from_fn_when_restore_sample_differs() -> None:
    # from_fn's function is user code, unseeded by default: named as a likely cause too.
    with pytest.raises(
        ResumeMismatch,
        match=r"likely cause: .*; or IndexedSource\.from_fn\(tests\.test_testing_harness\."
        r"_noisy_read\), which runs without per-sample seeds \(seed_per_sample=False, "
        r"from_fn's default\), draws random numbers: build it with seed_per_sample=True",
    ):
        check_resume(
            lambda: el.IndexedSource.from_fn(6, _noisy_read),
            num_workers=2,
            stop_points=[0],
            epochs=1,
        )


class _OwnGenerator:
    """Draws from a generator of its own, seeded once when built, never per sample."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        return {**sample, "noise": self.rng.random()}


def test_check_resume_names_a_generator_of_its_own_when_samples_differ() -> None:
    def build() -> el.SavableDataset:
        return el.MapDataset(el.IndexedSource.from_fn(6, _make), _OwnGenerator())

    with pytest.raises(
        ResumeMismatch,
        match=r"gave other samples after the restore: .*likely cause: a function \(a map, a "
        r"filter, __getitem__ or collate_fn\) draws from a generator of its own",
    ):
        check_resume(build, stop_points=[0], epochs=1)


def test_check_resume_rejects_what_is_not_a_pipeline() -> None:
    with pytest.raises(TypeError, match="build_fn must return a SavableDataset"):
        check_resume(lambda: [1, 2, 3])


def test_first_difference_names_the_path() -> None:
    import torch

    a = {"x": torch.tensor([1, 2]), "y": [1, {"z": 2}]}
    b = {"x": torch.tensor([1, 2]), "y": [1, {"z": 3}]}
    assert first_difference(a, b) == "sample['y'][1]['z']: 2 vs 3"
    assert first_difference(a, a) is None


class _Clocked(Dataset[Any]):
    """A ``__getitem__`` that reads the clock: no run repeats another."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "stamp": time.time_ns()}


class _Counting(Dataset[Any]):
    """Counts its calls in the process that makes the samples: deterministic from a fresh
    start, other numbers after a restore (which starts counting anew)."""

    def __init__(self) -> None:
        self.calls = 0

    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.calls += 1
        return {"index": index, "call": self.calls}


def _shuffled(dataset: Any) -> Any:
    """A factory of shuffling loaders over a fresh ``dataset()`` each."""

    def make(workers: int) -> Any:
        generator = torch.Generator().manual_seed(3)
        return el.SavableDataLoader(
            dataset(), batch_size=2, shuffle=True, generator=generator, num_workers=workers
        )

    return make


def test_check_loader_resume_passes_a_good_drop_in_setup_on_other_worker_counts() -> None:
    report = check_loader_resume(
        lambda workers: el.SavableDataLoader(
            Augmenting(11), batch_size=3, sampler=SequentialSampler(range(11)), num_workers=workers
        ),
        num_workers=0,
        restore_workers=(2, 0),
        epochs=2,
        draws=1,
    )
    assert report.events == 2 * 4 + 2  # four batches and an end per epoch
    assert any(isinstance(points, tuple) for points in report.stop_points)  # a chain


def test_check_loader_resume_names_a_getitem_that_reads_the_clock() -> None:
    with pytest.raises(
        ResumeMismatch,
        match=r"the uninterrupted run itself is not reproducible: .*batch 0 \(epoch 0, its "
        r"batch 0\) differs .*the same dataset indices \(\[.*\]\) gave other samples: "
        r"__getitem__ \(or collate_fn\) depends on something besides the index",
    ):
        check_loader_resume(_shuffled(_Clocked), restore_workers=(0,), draws=0)


def test_check_loader_resume_names_a_builder_that_makes_another_loader_each_call() -> None:
    calls = itertools.count()

    def make(workers: int) -> Any:  # another shuffle seed at every call: a builder's counter
        source = el.IndexedSource.from_fn(12, MakeSample(), shuffle=True, seed=next(calls))
        return el.SavableDataLoader(el.BatchDataset(source, 2), num_workers=workers)

    with pytest.raises(
        ResumeMismatch,
        match=r"the restore refused to continue: the state belongs to a different pipeline: "
        r".*seed: saved \d, now \d.* \(the builder makes another loader on each call \(config",
    ):
        check_loader_resume(make, restore_workers=(0,), draws=0)


def test_check_loader_resume_tells_a_restore_that_went_elsewhere() -> None:
    with pytest.raises(
        ResumeMismatch,
        match=r"resume is not exact \(num_workers=0 -> save after 1 batch \(in the loop\), "
        r"restore on num_workers=0\): batch 1 \(epoch 0, its batch 1\) differs \(batch\['call'\]"
        r".*the same dataset indices \(\[.*\]\) gave other samples after the restore",
    ):
        check_loader_resume(_shuffled(_Counting), restore_workers=(0,), draws=0)


class _PythonShuffle(Sampler[int]):
    """Shuffles with python's global ``random``: a source the loader neither sees nor saves."""

    def __len__(self) -> int:
        return 9

    def __iter__(self) -> Any:
        order = list(range(9))
        random.shuffle(order)
        return iter(order)


def test_check_loader_resume_tells_a_sampler_the_restore_cannot_replay() -> None:
    with pytest.raises(
        ResumeMismatch,
        match=r"save after 1 batch \(in the loop\).*: the restore refused to continue: the "
        r"sampler BatchSampler\(_PythonShuffle\) draws its order from python's global `random`"
        r".*random.setstate",
    ):
        check_loader_resume(
            lambda workers: el.SavableDataLoader(
                Augmenting(9), batch_size=2, sampler=_PythonShuffle(), num_workers=workers
            ),
            restore_workers=(0,),
            draws=0,
        )


def test_check_resume_names_a_pipeline_stage_not_getitem_for_a_counter_in_a_map() -> None:
    """A pipeline's map that reads a counter: the report speaks of restore keys and a stage of
    the pipeline, not of dataset indices, __getitem__ or a sampler's generator= (which a
    pipeline refuses)."""
    counter = itertools.count()

    def stamp(sample: dict[str, Any]) -> dict[str, Any]:
        return {**sample, "stamp": next(counter)}

    def build() -> el.SavableDataset:
        return el.BatchDataset(el.MapDataset(el.IndexedSource.from_fn(24, _make), stamp), 4)

    with pytest.raises(ResumeMismatch) as caught:
        check_resume(build, num_workers=0)
    message = str(caught.value)
    assert "the same restore keys" in message and "a stage of the pipeline" in message
    assert "__getitem__" not in message and "generator=" not in message
