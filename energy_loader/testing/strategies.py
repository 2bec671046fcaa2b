"""Hypothesis strategies for random pipelines and stop points.

:func:`pipelines` draws a :class:`PipelineSpec`: plain data describing an IndexedSource and a
stack of wrappers. ``spec.build()`` makes a fresh pipeline from it, so a property test can
build the same pipeline as often as it needs (uninterrupted, interrupted, restored). The user
functions in it are module-level callables (picklable under every start method) and the map
draws from python's, numpy's and torch's global RNGs, so per-sample seeding is exercised.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch
from hypothesis import strategies as st

from ..dataset import SavableDataset
from ..sources import IndexedSource
from ..wrappers import (
    BatchDataset,
    FilterDataset,
    GcDataset,
    LimitDataset,
    LogSampleDataset,
    MapDataset,
    RepeatDataset,
    ShuffleBufferDataset,
)

__all__ = ["AddNoise", "DropMultiples", "MakeSample", "PipelineSpec", "pipelines", "stop_points"]


@attrs.frozen
class MakeSample:
    """Sample ``i``: ``{"index": i, "x": tensor([i, i*i])}`` (a picklable source function)."""

    def __call__(self, index: int) -> dict[str, Any]:
        return {"index": index, "x": torch.tensor([index, index * index])}


@attrs.frozen
class AddNoise:
    """Adds ``noise``: one draw each from python, numpy and torch global RNGs."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        noise = random.random() + float(np.random.rand()) + float(torch.rand(()))
        return {**sample, "noise": noise}


@attrs.frozen
class DropMultiples:
    """Keeps samples whose index is not a multiple of ``k``."""

    k: int

    def __call__(self, sample: dict[str, Any]) -> bool:
        return sample["index"] % self.k != 0


_SAMPLE_STAGES: dict[str, Callable[[SavableDataset, Any], SavableDataset]] = {
    "map": lambda ds, _: MapDataset(ds, AddNoise()),
    "filter": lambda ds, k: FilterDataset(ds, DropMultiples(k)),
    "shuffle_buffer": lambda ds, size: ShuffleBufferDataset(ds, size),
    "gc": lambda ds, n: GcDataset(ds, every_n_iter=n, freeze=False),
    "log": lambda ds, _: LogSampleDataset(ds),
    "limit": lambda ds, n: LimitDataset(ds, n),
    "repeat": lambda ds, n: RepeatDataset(ds, n),
}


@attrs.frozen
class PipelineSpec:
    """A random pipeline as plain data; ``build()`` makes a fresh one."""

    length: int
    shuffle: bool
    seed: int
    stages: tuple[tuple[str, Any], ...]

    def build(self) -> SavableDataset:
        """A new pipeline: IndexedSource, then the stages in order."""
        dataset: SavableDataset = IndexedSource.from_fn(
            self.length, MakeSample(), shuffle=self.shuffle, seed=self.seed
        )
        for name, parameter in self.stages:
            if name == "batch":
                size, drop_last = parameter
                dataset = BatchDataset(dataset, size, drop_last=drop_last)
            else:
                dataset = _SAMPLE_STAGES[name](dataset, parameter)
        return dataset


def _sample_stage() -> st.SearchStrategy[tuple[str, Any]]:
    return st.one_of(
        st.tuples(st.just("map"), st.none()),
        st.tuples(st.just("filter"), st.integers(2, 5)),
        st.tuples(st.just("shuffle_buffer"), st.integers(1, 12)),
        st.tuples(st.just("gc"), st.integers(1, 7)),
        st.tuples(st.just("log"), st.none()),
        st.tuples(st.just("limit"), st.integers(1, 40)),
        st.tuples(st.just("repeat"), st.integers(1, 2)),
    )


def _batch_stage() -> st.SearchStrategy[tuple[str, Any]]:
    return st.tuples(st.just("batch"), st.tuples(st.integers(1, 5), st.booleans()))


@st.composite
def pipelines(draw: st.DrawFn, *, max_length: int = 60, max_depth: int = 5) -> PipelineSpec:
    """A random pipeline: source, up to ``max_depth`` stages, at most one batch stage.

    Stages after the batch stage see batches (shuffle buffers, limits, repeats, maps and
    logs of batches); filters only run on samples.
    """
    before = draw(st.lists(_sample_stage(), max_size=max_depth))
    stages = list(before)
    if draw(st.booleans()):
        stages.append(draw(_batch_stage()))
        after = draw(
            st.lists(
                _sample_stage().filter(lambda stage: stage[0] not in ("filter", "map")),
                max_size=max(0, max_depth - len(before)),
            )
        )
        stages.extend(after)
    return PipelineSpec(
        length=draw(st.integers(1, max_length)),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
        stages=tuple(stages[: max_depth + 1]),
    )


def stop_points(total_events: int) -> st.SearchStrategy[int]:
    """A stop point among ``0..total_events`` (weighted towards the edges by hypothesis)."""
    return st.integers(0, total_events)
