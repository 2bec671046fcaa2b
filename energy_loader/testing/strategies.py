"""Hypothesis strategies for random pipelines and stop points: :func:`pipelines` draws a
:class:`PipelineSpec` (plain data; ``spec.build()`` makes a fresh pipeline) whose module-level
user functions draw from the global RNGs, so per-sample seeding is exercised.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch
from hypothesis import strategies as st

from .. import wrappers as w
from ..dataset import SavableDataset
from ..sources import IndexedSource

__all__ = [
    "AddNoise",
    "DropMultiples",
    "GroupOf",
    "MakeSample",
    "PipelineSpec",
    "RandomTokens",
    "edge_stop_points",
    "pipelines",
    "restart_chains",
    "stop_points",
]


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
        # int(): after batch -> unbatch the index is a 0-dim tensor (default_collate made it one)
        return int(sample["index"]) % self.k != 0


@attrs.frozen
class GroupOf:
    """Group key ``index % k`` (for GroupBatchDataset)."""

    k: int

    def __call__(self, sample: dict[str, Any]) -> int:
        return int(sample["index"]) % self.k  # a plain int: group keys go into the state


@attrs.frozen
class RandomTokens:
    """Token sequence of a random length in ``1..max_tokens`` (python's global RNG)."""

    max_tokens: int = 12

    def __call__(self, sample: dict[str, Any]) -> torch.Tensor:
        length = random.randint(1, self.max_tokens)
        return torch.arange(length, dtype=torch.long) + 1000 * sample["index"]


def _blend(ds: SavableDataset, parameter: Any) -> SavableDataset:
    weights, specs, on_exhausted = parameter
    inners = [(spec.build(), weight) for spec, weight in zip(specs, weights[1:])]
    return w.BlendDataset((ds, weights[0]), *inners, on_exhausted=on_exhausted)


def _pack(ds: SavableDataset, parameter: Any) -> SavableDataset:
    max_len, buffer_size, too_long, pad = parameter
    return w.PackingDataset(
        ds,
        max_len,
        buffer_size=buffer_size,
        too_long=too_long,
        encode_fn=RandomTokens(),
        pad_id=0 if pad else None,
    )


def _group_batch(ds: SavableDataset, parameter: Any) -> SavableDataset:
    k, size, per_key, leftovers = parameter
    return w.GroupBatchDataset(ds, GroupOf(k), size, batch_sizes=dict(per_key), leftovers=leftovers)


def _epochize(ds: SavableDataset, parameter: Any) -> SavableDataset:
    length, endless = parameter
    return w.EpochizeDataset(w.RepeatDataset(ds) if endless else ds, length)


_STAGES: dict[str, Callable[[SavableDataset, Any], SavableDataset]] = {
    "map": lambda ds, _: w.MapDataset(ds, AddNoise()),
    "filter": lambda ds, k: w.FilterDataset(ds, DropMultiples(k)),
    "shuffle_buffer": lambda ds, size: w.ShuffleBufferDataset(ds, size),
    "gc": lambda ds, n: w.GcDataset(ds, every_n_iter=n, freeze=False),
    "log": lambda ds, _: w.LogSampleDataset(ds),
    "limit": lambda ds, n: w.LimitDataset(ds, n),
    "repeat": lambda ds, n: w.RepeatDataset(ds, n),
    "batch": lambda ds, p: w.BatchDataset(ds, p[0], drop_last=p[1]),
    "epochize": _epochize,
    "concat": lambda ds, specs: w.ConcatDataset(ds, *(spec.build() for spec in specs)),
    "blend": _blend,
    "pack": _pack,
    "group_batch": _group_batch,
    "unbatch": lambda ds, m: w.UnbatchDataset(ds, m),
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
            dataset = _STAGES[name](dataset, parameter)
        return dataset


# What flows between stages: "item" (a source sample), "pack" (a token pack), or "batch:"
# followed by either. Stages that could leave a shard with no sample at all mark the flow
# "may be empty"; an EpochizeDataset over such a flow would (rightly) raise, so it is not drawn.

_ANY_KIND = ("shuffle_buffer", "gc", "log", "limit", "repeat", "epochize")


def _stage(name: str, parameter: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[str, Any]]:
    return st.tuples(st.just(name), parameter)


def _simple_stages(kind: str, may_be_empty: bool) -> list[st.SearchStrategy[tuple[str, Any]]]:
    options = {
        "shuffle_buffer": st.integers(1, 12),
        "gc": st.integers(128, 512),  # gc.collect() costs 10-30 ms with torch loaded
        "log": st.none(),
        "limit": st.integers(1, 40),
        "repeat": st.integers(1, 2),
        "epochize": st.tuples(st.integers(1, 30), st.booleans()),
    }
    out = [_stage(name, options[name]) for name in _ANY_KIND]
    if may_be_empty:
        out.pop()  # no epochize
    if not kind.startswith("batch"):
        out.append(_stage("map", st.none()))
        out.append(_stage("batch", st.tuples(st.integers(1, 5), st.booleans())))
    else:  # unbatching is the way back to samples: drawn as often as all the rest together
        out.extend([_stage("unbatch", st.one_of(st.none(), st.integers(1, 3)))] * len(out))
    if kind == "item":
        out.append(_stage("filter", st.integers(2, 5)))
        pack = st.tuples(
            st.integers(4, 10), st.integers(1, 4), st.sampled_from(("split", "drop")), st.booleans()
        )
        out.append(_stage("pack", pack))
        groups = st.tuples(
            st.integers(1, 3),
            st.integers(1, 4),
            st.lists(
                st.tuples(st.integers(0, 2), st.integers(1, 4)),
                max_size=2,
                unique_by=lambda p: p[0],
            ).map(tuple),
            st.sampled_from(("emit", "drop")),
        )
        out.append(_stage("group_batch", groups))
    return out


@st.composite
def _inner_specs(
    draw: st.DrawFn, count: int, noisy: bool, max_shards: int
) -> tuple[tuple[PipelineSpec, bool], ...]:
    """Small item pipelines for blends and concats, each with whether it may be empty; they end with
    a map exactly when the main flow had one (a batch after the blend collates them together).
    """
    out = []
    for _ in range(count):
        length = draw(st.integers(1, 20))
        stages = draw(
            st.lists(
                st.one_of(
                    _stage("filter", st.integers(2, 5)),
                    _stage("shuffle_buffer", st.integers(1, 6)),
                    _stage("limit", st.integers(1, 15)),
                ),
                max_size=2,
            )
        )
        if noisy:
            stages.append(("map", None))
        spec = PipelineSpec(length, draw(st.booleans()), draw(st.integers(0, 2**31)), tuple(stages))
        empty = length < max_shards or any(name == "filter" for name, _ in stages)
        out.append((spec, empty))
    return tuple(out)


def _can_empty(name: str, parameter: Any) -> bool:
    """Whether a stage can turn a non-empty shard into an empty one."""
    return (
        name == "filter"
        or (name == "pack" and parameter[2] == "drop")
        or (name == "batch" and parameter[1])
        or (name == "group_batch" and parameter[3] == "drop")
    )


@st.composite
def pipelines(
    draw: st.DrawFn, *, max_length: int = 60, max_depth: int = 6, max_shards: int = 4
) -> PipelineSpec:
    """A random pipeline: a source and up to ``max_depth`` stages of any wrapper, each drawn to fit
    what flows through it (items, packs, batches). ``max_shards`` (ranks x workers it will run
    on) keeps ``EpochizeDataset`` away from shards that might be empty, where it raises.
    """
    length = draw(st.integers(1, max_length))
    kind, may_be_empty, noisy = "item", length < max_shards, False
    stages: list[tuple[str, Any]] = []
    for _ in range(draw(st.sampled_from(range(max_depth + 1)))):  # uniform, not small-biased
        options = _simple_stages(kind, may_be_empty)
        if kind == "item":
            options.append(_stage("concat", st.none()))
            options.append(_stage("blend", st.none()))
        name, parameter = draw(st.one_of(options))
        if name in ("concat", "blend"):
            inners = draw(_inner_specs(draw(st.integers(1, 2)), noisy, max_shards))
            specs = tuple(spec for spec, _ in inners)
            if name == "concat":
                parameter = specs
                may_be_empty = may_be_empty and all(empty for _, empty in inners)
            else:
                weights = draw(
                    st.lists(st.integers(0, 3), min_size=len(specs) + 1, max_size=len(specs) + 1)
                    .filter(any)
                    .map(tuple)
                )
                on_exhausted = draw(st.sampled_from(("end", "drop")))
                parameter = (weights, specs, on_exhausted)
                empties = [may_be_empty] + [empty for _, empty in inners]
                used = [empty for empty, weight in zip(empties, weights) if weight > 0]
                may_be_empty = any(used) if on_exhausted == "end" else all(used)
        elif _can_empty(name, parameter):
            may_be_empty = True
        if name == "map":
            noisy = True
        if name == "pack":
            kind, noisy = "pack", False
        elif name in ("batch", "group_batch"):
            kind = f"batch:{kind}"
        elif name == "unbatch" and parameter is None:
            kind = kind.removeprefix("batch:")
        stages.append((name, parameter))
    return PipelineSpec(
        length=length,
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
        stages=tuple(stages),
    )


def stop_points(total_events: int) -> st.SearchStrategy[int]:
    """A stop point among ``0..total_events`` (weighted towards the edges by hypothesis)."""
    return st.integers(0, total_events)


def edge_stop_points(events: list[Any], end: Any) -> st.SearchStrategy[int]:
    """A stop point at an epoch's edge of a run recorded as ``events`` (``end`` after each
    epoch, as :func:`energy_loader.testing.record_events` records it): right before an end
    (a save at the epoch's last sample inside the loop) or right after it (after the loop)."""
    edges = sorted(
        {k + shift for k, event in enumerate(events) if event is end for shift in (0, 1)}
    )
    return st.sampled_from(edges) if edges else st.just(0)


def restart_chains(events: list[Any], end: Any, *, max_restarts: int = 3) -> st.SearchStrategy[Any]:
    """A chain of stop points for ``check_resume`` (a tuple, not decreasing): save, restore,
    save again, ... Points at the epoch edges, anywhere, and the previous point again (a save
    right after a load, before any ``iter()``) are drawn alike."""
    total = len(events)
    point = st.one_of(edge_stop_points(events, end), st.integers(0, total))
    return st.lists(point, min_size=2, max_size=max_restarts).flatmap(
        lambda points: st.lists(st.booleans(), min_size=len(points), max_size=len(points)).map(
            lambda again: _with_repeats(sorted(points), again)
        )
    )


def _with_repeats(points: list[int], again: list[bool]) -> tuple[int, ...]:
    """``points`` with each point after the first replaced by its predecessor where ``again``
    says so (a save right after the load of the previous one)."""
    out = [points[0]]
    for point, repeat in zip(points[1:], again[1:]):
        out.append(out[-1] if repeat else point)
    return tuple(out)
