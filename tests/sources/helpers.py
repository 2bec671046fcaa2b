"""Helpers shared by the tests of the strided sources (sharded, WebDataset, Parquet and
the other formats)."""

from __future__ import annotations

import json
from typing import Any

from energy_loader.dataset import SavableDataset
from energy_loader.worker import WorkerContext


def keys_of(source: SavableDataset, context: WorkerContext | None = None) -> list[Any]:
    """The keys of one epoch of ``source`` (epoch 0), read as the given reader."""
    source.bind(context or WorkerContext())
    source.reset_state()
    return [key for key, _ in source.iter_keyed()]


def assert_readers_interleave(
    source: SavableDataset, expected: list[Any], layouts: list[tuple[int, int]]
) -> None:
    """For each ``(ranks, workers)``, the readers' keys interleaved give ``expected``."""
    for ranks, workers in layouts:
        readers = ranks * workers
        merged: list[Any] = [None] * len(expected)
        for rank in range(ranks):
            for worker in range(workers):
                reader = rank * workers + worker
                context = WorkerContext(partition=reader, num_partitions=readers)
                merged[reader::readers] = keys_of(source, context)
        assert merged == expected, (ranks, workers)


def _loaders(build: Any, world_size: int, workers: int, partitions: int) -> list[Any]:
    import energy_loader as el

    return [
        el.SavableDataLoader(
            build(),
            worker_config=el.WorkerConfig(rank=rank, world_size=world_size, num_workers=workers),
            num_partitions=partitions,
            batch_size=None,
        )
        for rank in range(world_size)
    ]


def _job_stream(iterators: list[Any], steps: int | None) -> list[Any]:
    """Samples of every rank interleaved rank by rank (``steps`` steps, or to the end)."""
    stream: list[Any] = []
    step = 0
    while steps is None or step < steps:
        got = [next(iterator, None) for iterator in iterators]
        if all(sample is None for sample in got):
            break
        stream.extend(sample for sample in got if sample is not None)
        step += 1
    return stream


def _close(loaders: list[Any]) -> None:
    for loader in loaders:
        loader.close()


def assert_elastic_resume(
    build: Any,
    same: Any,
    *,
    partitions: int = 4,
    saved: tuple[int, int] = (1, 2),
    restored: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (2, 0)),
    head_steps: int = 7,
) -> None:
    """One epoch of ``build()`` is the same job stream on 1 rank without workers and on the
    ``saved`` (ranks, workers) layout; a state saved there after ``head_steps`` steps restores
    onto each ``restored`` layout and continues that stream exactly. ``same(a, b)`` asserts
    two samples are equal."""
    reference = _loaders(build, 1, 0, partitions)
    expected = _job_stream([iter(loader) for loader in reference], None)
    _close(reference)
    ranks, workers = saved
    first = _loaders(build, ranks, workers, partitions)
    whole = _job_stream([iter(loader) for loader in first], None)
    _close(first)
    assert len(whole) == len(expected)
    for a, b in zip(expected, whole):
        same(a, b)
    first = _loaders(build, ranks, workers, partitions)
    head = _job_stream([iter(loader) for loader in first], head_steps)
    states = [json.loads(json.dumps(loader.save_state_rank())) for loader in first]
    _close(first)
    for a, b in zip(expected, head):
        same(a, b)
    for ranks, workers in restored:
        second = _loaders(build, ranks, workers, partitions)
        for loader in second:
            loader.restore_state_global(states)
        tail = _job_stream([iter(loader) for loader in second], None)
        _close(second)
        assert len(head) + len(tail) == len(expected), (ranks, workers)
        for a, b in zip(expected[len(head) :], tail):
            same(a, b)


def assert_matches_peer(value: Any, expected: Any, arrays: Any, where: str) -> None:
    """``value`` is what a peer's own reader returned, as tests/sources/fixtures/
    make_fixtures.py described it (type, and value or array in ``arrays``)."""
    import numpy as np

    kind = expected["type"]
    if kind == "PIL.Image":
        from PIL import Image

        assert isinstance(value, Image.Image), where
        assert value.mode == expected["mode"] and list(value.size) == expected["size"], where
        np.testing.assert_array_equal(np.asarray(value), arrays[expected["array"]], where)
        return
    if kind == "builtins.memoryview":
        # litdata hands out views of its memory map; LitDataSource gives the bytes (a view
        # cannot be sent from a worker process), as documented.
        assert isinstance(value, bytes) and value.hex() == expected["hex"], where
        return
    assert f"{type(value).__module__}.{type(value).__qualname__}" == kind, where
    if isinstance(expected.get("items"), dict):
        assert sorted(value) == sorted(expected["items"]), where
        for name, description in expected["items"].items():
            assert_matches_peer(value[name], description, arrays, f"{where}.{name}")
        return
    if "array" in expected:
        reference = arrays[expected["array"]]
        data = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
        assert str(data.dtype) == expected["dtype"].removeprefix("torch."), where
        assert data.dtype == reference.dtype and data.shape == reference.shape, where
        np.testing.assert_array_equal(data, reference, where)
    elif "hex" in expected:
        assert value.hex() == expected["hex"], where
    elif "items" in expected:
        assert len(value) == len(expected["items"]), where
        for i, (item, description) in enumerate(zip(value, expected["items"])):
            assert_matches_peer(item, description, arrays, f"{where}[{i}]")
    elif "str" in expected:
        assert str(value) == expected["str"], where
    else:
        # Through JSON: a tuple's description is a list (its type is checked above).
        assert json.dumps(value) == json.dumps(expected["value"]), where
