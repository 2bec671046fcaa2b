"""The core property: restore-then-continue equals the uninterrupted run, sample by sample.

Random pipelines (source, map with random draws, filter, shuffle buffers, batch, limit,
repeat, gc, log), random worker counts, prefetch depths and items per transfer, random stop
points (including the start, mid-epoch, right before and right after an epoch end, and inside
the second epoch) and chains of restarts (save, restore, save again, possibly right after the
load, restore, ...).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energy_loader import SavableDataLoader
from energy_loader.testing import END, check_resume, record_events
from energy_loader.testing.strategies import (
    PipelineSpec,
    edge_stop_points,
    pipelines,
    restart_chains,
)

from .helpers import MODEL_EXAMPLES


def _events(spec: PipelineSpec, workers: int, prefetch: int) -> list[Any]:
    loader = SavableDataLoader(spec.build(), num_workers=workers, prefetch_factor=prefetch)
    events, _ = record_events(loader, 2)
    return events


@MODEL_EXAMPLES
@given(spec=pipelines(), data=st.data())
def test_resume_is_exact_in_process(spec: PipelineSpec, data: st.DataObject) -> None:
    events = _events(spec, 0, 2)
    point = st.one_of(st.integers(0, len(events)), edge_stop_points(events, END))
    stops = data.draw(st.lists(point, min_size=1, max_size=4, unique=True))
    chain = data.draw(restart_chains(events, END), label="chain")
    check_resume(spec.build, num_workers=0, epochs=2, stop_points=[*sorted(stops), chain])


@pytest.mark.timeout(600)
@settings(max_examples=10)
@given(
    spec=pipelines(max_length=40),
    workers=st.integers(1, 3),
    prefetch=st.integers(1, 4),
    data=st.data(),
)
def test_resume_is_exact_with_workers(
    spec: PipelineSpec, workers: int, prefetch: int, data: st.DataObject
) -> None:
    kwargs = {
        "prefetch_factor": prefetch,
        "checkpoint_every_n_samples": data.draw(st.integers(1, 6)),
        "items_per_transfer": data.draw(st.sampled_from([1, 3, 16]), label="items_per_transfer"),
    }
    loader = SavableDataLoader(spec.build(), num_workers=workers, **kwargs)
    events = record_events(loader, 2)[0]
    del loader
    point = st.one_of(st.integers(0, len(events)), edge_stop_points(events, END))
    stop = data.draw(st.one_of(point.map(lambda k: (k,)), restart_chains(events, END)))
    check_resume(
        spec.build, num_workers=workers, epochs=2, stop_points=[stop], loader_kwargs=kwargs
    )


# 1 and 3 workers: slow. 0 and 2 run here, and test_resume_is_exact_with_workers draws 1-3
# workers with stop points at the epoch edges.
@pytest.mark.parametrize(
    "workers",
    [0, pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)],
)
def test_default_stop_points_cover_epoch_edges(workers: int) -> None:
    spec = PipelineSpec(
        length=45,
        shuffle=True,
        seed=11,
        stages=(("map", None), ("filter", 4), ("shuffle_buffer", 7), ("batch", (4, False))),
    )
    report = check_resume(spec.build, num_workers=workers, epochs=3)
    first_end = report.stop_points[3]
    assert report.stop_points[4] == first_end + 1
    assert report.state_bytes < 8192


def test_events_record_epoch_ends() -> None:
    spec = PipelineSpec(length=5, shuffle=False, seed=0, stages=())
    events, ended = record_events(SavableDataLoader(spec.build()), 2)
    assert ended == 2
    assert [e if e is END else e["index"] for e in events] == [0, 1, 2, 3, 4, END] * 2
