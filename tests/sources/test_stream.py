"""StreamSource against a real producer: a log server in a separate process, over TCP."""

from __future__ import annotations

import gc
import select
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import energy_loader as el
from energy_loader import StreamError, StreamSource
from energy_loader.errors import StateFormatError
from energy_loader.testing import check_resume
from energy_loader.worker import WorkerContext
from energy_loader.wrappers import UnbatchDataset

from .stream_producer import StreamClient


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """The port of a producer server running in its own process for this module."""
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.sources.stream_producer"],
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 30)
        line = process.stdout.readline() if ready else ""
        if not line.startswith("PORT "):
            pytest.fail(f"the producer server did not start (said {line!r})")
        yield int(line.split()[1])
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def new_stream(
    port: int, total: int, batch: int = 3, every: float = 0.0, **kw: Any
) -> StreamClient:
    client = StreamClient(port, uuid.uuid4().hex)
    client.create(total, batch, every, **kw)
    return client


def finite(client: StreamClient, **kw: Any) -> StreamSource:
    return StreamSource(client, is_exhausted=client.exhausted, poll_interval=0.005, **kw)


def cursors(items: list[Any]) -> list[int]:
    return [el.restore_key_of(item)[0] for item in items]


def test_reads_a_live_producer_in_order_polling_when_it_is_behind(port):
    client = new_stream(port, total=4, batch=2, every=0.15)
    got = list(finite(client))
    assert cursors(got) == list(range(4))
    assert torch.cat([b["index"] for b in got]).tolist() == list(range(8))
    counts = client.fetch_counts()
    assert counts[0] > 1  # batch 0 was asked for before it was produced: the source polled
    assert sorted(counts) == list(range(5))  # and cursor 4 before the end was declared


def test_next_epoch_continues_from_the_cursor(port):
    client = new_stream(port, total=4)
    source = finite(client)
    assert cursors(list(source)) == [0, 1, 2, 3]
    assert list(source) == []  # nothing new: an empty epoch
    client.extend(2)
    assert cursors(list(source)) == [4, 5]


def test_endless_by_default(port):
    client = new_stream(port, total=5)
    source = StreamSource(client, poll_interval=0.01)
    with pytest.raises(TypeError):
        len(source)
    assert cursors(list(el.LimitDataset(source, 5))) == [0, 1, 2, 3, 4]
    waiting = StreamSource(client, poll_interval=0.01, fetch_timeout=0.2)
    with pytest.raises(StreamError, match=r"no batch for cursor 5 .* within fetch_timeout=0\.2 s"):
        list(waiting)


def test_readers_take_interleaved_cursors_and_peers_get_identical_data(port):
    client = new_stream(port, total=9)

    def run(rank: int) -> list[Any]:
        config = el.WorkerConfig(rank=rank, world_size=2)
        return list(el.SavableDataLoader(finite(client), worker_config=config))

    first_peer, second_peer, other = run(1), run(1), run(0)
    assert cursors(first_peer) == cursors(second_peer) == [1, 3, 5, 7]
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(first_peer, second_peer))
    assert cursors(other) == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.timeout(120)
def test_resume_is_exact_with_workers(port, num_workers, no_leftover_processes):
    client = new_stream(port, total=10, every=0.002 if num_workers == 0 else 0.0)
    report = check_resume(
        lambda: finite(client),
        num_workers=num_workers,
        epochs=2,
        stop_points={0: None, 1: [5, 10], 2: [3, 11]}[num_workers],
    )
    assert report.state_bytes < 1000


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.timeout(120)
def test_micro_batches_resume_exactly(port, num_workers, no_leftover_processes):
    client = new_stream(port, total=5, batch=3)

    def build() -> el.SavableDataset:
        return UnbatchDataset(finite(client), micro_batch_size=2)

    pieces = [b["index"].tolist() for b in build()]
    assert pieces == [[0, 1], [2], [3, 4], [5], [6, 7], [8], [9, 10], [11], [12, 13], [14]]
    stops = None if num_workers == 0 else [4, 11]  # mid-epoch; right after the first end
    check_resume(build, num_workers=num_workers, epochs=2, stop_points=stops)


@settings(max_examples=8)
@given(
    total=st.integers(0, 12),
    batch=st.integers(1, 4),
    workers=st.integers(0, 2),
    micro=st.sampled_from([None, 1, 2]),
    data=st.data(),
)
@pytest.mark.timeout(300)
def test_resume_property(port, total, batch, workers, micro, data):
    client = new_stream(port, total=total, batch=batch)

    def build() -> el.SavableDataset:
        source = finite(client)
        return source if micro is None else UnbatchDataset(source, micro_batch_size=micro)

    events = len(list(build())) + 2 + (2 if workers == 2 else 0)
    stop = data.draw(st.integers(0, events - 1), label="stop")
    check_resume(build, num_workers=workers, epochs=2, stop_points=[stop])


def test_restore_sample_fetches_the_cursor_again(port):
    client = new_stream(port, total=3)
    source = finite(client)
    first = list(source)[1]
    again = source.restore_sample((1,))
    assert torch.equal(again["x"], first["x"])
    with pytest.raises(StreamError, match="serves a cursor again"):
        source.restore_sample((7,))
    for key in [(), (1, 2), ("1",), (-1,), (True,)]:
        with pytest.raises(ValueError, match=r"restore keys are \(cursor,\)"):
            source.restore_sample(key)


def test_state_of_another_reader_is_refused(port):
    source = finite(new_stream(port, total=3))
    source.bind(WorkerContext(partition=1, num_partitions=2))
    with pytest.raises(StateFormatError, match="cursor 4 does not belong to reader 1 of 2"):
        source.restore_state({"phase": "running", "epoch": 0, "cursor": 4})
    source.restore_state({"phase": "running", "epoch": 0, "cursor": 1})
    assert [key for key, _ in source.iter_keyed()] == [(1,)]


# -- bad input ---------------------------------------------------------------------------------


def test_a_failing_fetch_fn_is_a_clear_error(port):
    client = new_stream(port, total=6, fail_at=3)
    source = finite(client)
    with pytest.raises(
        StreamError, match="StreamClient raised at cursor 3: RuntimeError"
    ) as raised:
        list(source)
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert "the producer lost batch 3" in str(raised.value)


@pytest.mark.timeout(60)
def test_a_failing_fetch_fn_in_a_worker_is_a_worker_error(port, no_leftover_processes):
    client = new_stream(port, total=6, fail_at=3)

    def failure() -> str:
        # In a function, so the traceback (which holds the loader and its workers) is dropped.
        # One worker: shutting a loader down after a worker error costs ~5 s per worker.
        loader = el.SavableDataLoader(finite(client), num_workers=1)
        try:
            list(loader)
        except el.WorkerError as error:
            return str(error)
        return "no error"

    message = failure()
    gc.collect()
    assert "StreamError" in message and "raised at cursor 3" in message


def broken_exhausted(cursor: int) -> bool:
    raise ConnectionResetError("the broker went away")


def test_a_bad_is_exhausted_is_a_clear_error(port):
    client = new_stream(port, total=1)
    with pytest.raises(StreamError, match="broken_exhausted raised at cursor 1"):
        list(StreamSource(client, is_exhausted=broken_exhausted, poll_interval=0.01))
    with pytest.raises(StreamError, match="must return True or False"):
        list(StreamSource(client, is_exhausted=lambda cursor: "yes", poll_interval=0.01))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("not callable",), {}, TypeError, "`fetch_fn` must be callable"),
        ((print,), {"is_exhausted": 3}, TypeError, "`is_exhausted` must be callable"),
        ((print,), {"poll_interval": 0}, ValueError, "`poll_interval` must be a positive number"),
        ((print,), {"poll_interval": float("inf")}, ValueError, "`poll_interval` must be"),
        ((print,), {"poll_interval": "1"}, ValueError, "`poll_interval` must be"),
        ((print,), {"fetch_timeout": -1}, ValueError, "`fetch_timeout` must be a positive"),
    ],
)
def test_bad_arguments(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        StreamSource(*args, **kwargs)


class TensorDictBatches:
    """fetch_fn that hands out the producer's batches as TensorDicts (a nested one inside)."""

    def __init__(self, client: StreamClient) -> None:
        self.client = client

    def __call__(self, cursor: int) -> Any:
        tensordict = pytest.importorskip("tensordict")
        batch = self.client(cursor)
        if batch is None:
            return None
        rows = len(batch["index"])
        inner = tensordict.TensorDict({"x": batch["x"]}, batch_size=[rows])
        return tensordict.TensorDict({"index": batch["index"], "inner": inner}, batch_size=[rows])


def test_tensordict_batches_split_into_micro_batches_and_resume(port):
    pytest.importorskip("tensordict")
    client = new_stream(port, total=4, batch=3)

    def build() -> el.SavableDataset:
        fetch = TensorDictBatches(client)
        source = StreamSource(fetch, is_exhausted=client.exhausted, poll_interval=0.005)
        return UnbatchDataset(source, micro_batch_size=2)

    full = [piece["index"].tolist() for piece in build()]
    assert full == [[0, 1], [2], [3, 4], [5], [6, 7], [8], [9, 10], [11]]
    for stop in range(len(full) + 1):
        pipeline = build()
        iterator = iter(pipeline)
        head = [next(iterator)["index"].tolist() for _ in range(stop)]
        state = pipeline.save_state()
        restored = build()
        restored.restore_state(state)
        tail = [piece for piece in restored]
        assert head + [piece["index"].tolist() for piece in tail] == full, stop
        assert all(piece["inner", "x"].shape == (len(piece["index"]), 2) for piece in tail)
