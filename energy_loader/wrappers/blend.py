"""BlendDataset: weighted random mixing of several inner datasets.

One :class:`~energy_loader.rng.CounterRng` draw a sample picks a running inner dataset by
weight; ``on_exhausted`` says what an ended one does. State: ``{"phase", "epoch", "counter",
"done", "inners"}``; restore key ``(i, inner_key)``. See docs/wrappers.md, "BlendDataset".
"""

from __future__ import annotations

import bisect
import itertools
import math
import numbers
from collections.abc import Iterator
from typing import Any

from ..dataset import EpochCursor, Key, SavableDataset
from ..rng import CounterRng, stable_hash
from ..state.plain import StateReader
from ._multi import MultiCursor, MultiWrapperDataset, read_flags

__all__ = ["BlendDataset"]

ON_EXHAUSTED = ("end", "drop")
_ENDED: Any = object()


class _BlendCursor(MultiCursor):
    dataset: BlendDataset

    def __init__(self, dataset: BlendDataset) -> None:
        super().__init__(dataset)
        self.counter = 0
        self.done = [False] * len(dataset.datasets)

    def begin_epoch(self) -> None:
        self.done = [False] * len(self.dataset.datasets)

    def _table(self) -> tuple[list[int], list[float]]:
        """The inner datasets that can still be drawn and their cumulative weights."""
        active = [i for i, w in enumerate(self.dataset.weights) if w > 0 and not self.done[i]]
        cumulative = list(itertools.accumulate(self.dataset.weights[i] for i in active))
        return active, cumulative

    def resume(self) -> Iterator[tuple[Key, Any]]:
        blend = self.dataset
        rng = CounterRng(blend.stream_seed(), self.counter)
        streams: dict[int, Iterator[tuple[Key, Any]]] = {}
        active, cumulative = self._table()
        weights = blend.weights
        while active:
            if blend.weights is not weights:  # changed after a restore's replay
                weights = blend.weights
                active, cumulative = self._table()
                if not active:
                    break
            point = rng.uniform() * cumulative[-1]
            index = active[min(bisect.bisect_right(cumulative, point), len(active) - 1)]
            self.counter = rng.counter
            stream = streams.get(index)
            if stream is None:
                stream = streams[index] = self.tagged(index)
            pair = next(stream, _ENDED)
            if pair is not _ENDED:
                yield pair
                continue
            self.done[index] = True
            if blend.on_exhausted == "end":
                self._end_inners()
                return
            active, cumulative = self._table()

    def _end_inners(self) -> None:
        for index, dataset in enumerate(self.dataset.datasets):
            if not self.done[index]:
                dataset.finish_epoch()
                self.done[index] = True

    def finish(self) -> None:
        if self.phase == "running":
            self._end_inners()
        super().finish()

    def fields(self) -> dict[str, Any]:
        return {"counter": self.counter, "done": list(self.done)}

    def load_fields(self, reader: StateReader) -> None:
        self.counter = reader.int("counter")
        self.done = read_flags(reader, "done", self.dataset)


def _weight(value: Any, position: int) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"BlendDataset: the weight of inner dataset {position} must be a number "
            f"(got {type(value).__name__}: {value!r})"
        )
    weight = float(value)
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(
            f"BlendDataset: the weight of inner dataset {position} must be a finite number "
            f">= 0 (got {value!r})"
        )
    return weight


class BlendDataset(MultiWrapperDataset):
    """Mix inner datasets at random, each drawn with probability proportional to its weight.

    Weights need not sum to 1 (finite, non-negative, not all zero). ``len()`` is known only with
    ``on_exhausted="drop"`` (the sum of the positive-weight inner lengths). Example::

        BlendDataset((RepeatDataset(books), 0.7), (RepeatDataset(code), 0.3))
    """

    def __init__(self, *weighted: tuple[SavableDataset, float], on_exhausted: str = "end") -> None:
        datasets: list[SavableDataset] = []
        weights: list[float] = []
        for position, pair in enumerate(weighted):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(
                    "BlendDataset takes (dataset, weight) pairs, e.g. "
                    f"BlendDataset((books, 0.7), (code, 0.3)); argument {position} is "
                    f"{type(pair).__name__}"
                )
            datasets.append(pair[0])
            weights.append(_weight(pair[1], position))
        super().__init__(datasets)
        if not any(w > 0 for w in weights):
            raise ValueError(f"BlendDataset: at least one weight must be > 0 (got {weights})")
        if on_exhausted not in ON_EXHAUSTED:
            raise ValueError(
                f"`on_exhausted` must be 'end' (an inner dataset that ends ends the blend's "
                f"epoch) or 'drop' (it drops out of the mix); got {on_exhausted!r}"
            )
        self.weights = tuple(weights)
        self.on_exhausted = on_exhausted

    def stream_seed(self) -> int:
        """The seed of this blend's random stream in the current worker."""
        return stable_hash(self.context.worker_seed, self.stream_salt())

    def _new_cursor(self) -> EpochCursor:
        return _BlendCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {"weights": list(self.weights), "on_exhausted": self.on_exhausted}

    def __len__(self) -> int:
        if self.on_exhausted != "drop":
            raise TypeError(
                "BlendDataset(on_exhausted='end') has no len(): where its epoch ends depends on "
                "the random draws (on_exhausted='drop' has one)"
            )
        lengths = (
            len(dataset)  # type: ignore[arg-type]
            for dataset, weight in zip(self.datasets, self.weights)
            if weight > 0
        )
        return sum(lengths)
