"""ShuffleBufferDataset: a real shuffle, keys-only state, lazy rebuild, exact resume."""

from __future__ import annotations

import json

import pytest

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import AddNoise, MakeSample
from tests.helpers import WORKERS_0_AND_2


class CountingSample:
    """A source function that counts its calls (to see what a restore rebuilds)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, index: int) -> dict:
        self.calls += 1
        return {"index": index}


def _pipeline(size: int = 10, length: int = 60) -> el.ShuffleBufferDataset:
    source = el.IndexedSource.from_fn(length, MakeSample(), shuffle=False)
    return el.ShuffleBufferDataset(el.MapDataset(source, AddNoise()), size)


def test_it_shuffles_within_the_buffer_and_loses_nothing() -> None:
    out = [s["index"] for s in _pipeline(10, 60)]
    assert sorted(out) == list(range(60))
    assert out != list(range(60))
    # Reservoir property: a sample leaves the buffer no earlier than when the buffer filled.
    assert all(position >= index - 10 for position, index in enumerate(out) if index >= 10)


def test_state_holds_keys_and_a_counter_not_samples() -> None:
    pipeline = _pipeline(10, 60)
    iterator = iter(pipeline)
    for _ in range(5):
        next(iterator)
    state = pipeline.save_state()
    assert len(state["indices"]) == 10 and isinstance(state["counter"], int)
    assert "noise" not in json.dumps(state)


def test_restore_rebuilds_buffered_samples_lazily() -> None:
    counting = CountingSample()
    pipeline = el.ShuffleBufferDataset(el.IndexedSource.from_fn(100, counting), 50)
    iterator = iter(pipeline)
    for _ in range(3):
        next(iterator)
    state = pipeline.save_state()
    restored_fn = CountingSample()
    restored = el.ShuffleBufferDataset(el.IndexedSource.from_fn(100, restored_fn), 50)
    restored.restore_state(state)
    first = next(iter(restored))
    assert restored_fn.calls <= 2, "a restore must not rebuild the whole buffer up front"
    assert first["index"] == next(iterator)["index"]


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_exactly(workers: int) -> None:
    check_resume(lambda: _pipeline(7, 40), num_workers=workers, epochs=2)


def test_buffers_differ_per_worker_and_per_position() -> None:
    a = [s["index"] for s in _pipeline(10, 60)]
    nested = el.ShuffleBufferDataset(_pipeline(10, 60), 10)
    nested.bind(el.WorkerContext())
    assert a != [s["index"] for s in nested]


def test_constructor_rejects_bad_arguments() -> None:
    source = el.IndexedSource.from_fn(3, MakeSample())
    with pytest.raises(ValueError, match="`size` must be positive"):
        el.ShuffleBufferDataset(source, 0)
    with pytest.raises(TypeError, match="`size` must be an integer"):
        el.ShuffleBufferDataset(source, "10")
