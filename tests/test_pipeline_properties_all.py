"""The resume property over random pipelines of every wrapper, core and extra, depth up to 6.

Pipelines come from :func:`energy_loader.testing.strategies.pipelines`: map, filter, shuffle
buffer, batch, gc, log, limit, repeat, epochize, concat, blend, packing, group batch and
unbatch, stacked in any order that fits the samples flowing through. Each example saves at
random stop points (and at the epoch edges in process) and a chain of restarts, restores on
a fresh loader, and compares the continuation with the uninterrupted run, with 0, 1 and 2
workers.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energy_loader import SavableDataLoader
from energy_loader.testing import END, check_resume, record_events
from energy_loader.testing.strategies import PipelineSpec, pipelines, restart_chains
from energy_loader.wrappers import __all__ as WRAPPERS

from .helpers import MODEL_EXAMPLES

# In process an example costs milliseconds: run more than the profile's default (500 nightly).
# With workers an example costs seconds: a quarter of the profile's count, at least 8 (8 in CI).
_PROFILE = settings().max_examples
IN_PROCESS = settings(max_examples=max(40, MODEL_EXAMPLES.max_examples))
WITH_WORKERS = settings(max_examples=max(8, _PROFILE // 4))

STAGE_NAMES = {
    "map",
    "filter",
    "shuffle_buffer",
    "batch",
    "gc",
    "log",
    "limit",
    "repeat",
    "epochize",
    "concat",
    "blend",
    "pack",
    "group_batch",
    "unbatch",
}


def test_the_generator_composes_every_wrapper_up_to_depth_six() -> None:
    seen_stages: set[str] = set()
    seen_types: set[str] = set()
    depths: set[int] = set()

    @settings(max_examples=150, derandomize=True, database=None)
    @given(spec=pipelines())
    def collect(spec: PipelineSpec) -> None:
        seen_stages.update(name for name, _ in spec.stages)
        depths.add(len(spec.stages))
        seen_types.update(type(dataset).__name__ for dataset in spec.build().walk())

    collect()
    assert seen_stages == STAGE_NAMES
    assert max(depths) == 6
    wrapper_types = {name for name in WRAPPERS if name.endswith("Dataset")}
    assert wrapper_types <= seen_types, wrapper_types - seen_types


@IN_PROCESS
@given(spec=pipelines(), data=st.data())
def test_resume_is_exact_in_process(spec: PipelineSpec, data: st.DataObject) -> None:
    report = check_resume(spec.build, num_workers=0, epochs=2)
    extra = data.draw(st.lists(st.integers(0, report.events), max_size=2, unique=True))
    events = record_events(SavableDataLoader(spec.build()), 2)[0]
    chain = data.draw(restart_chains(events, END), label="chain")
    check_resume(spec.build, num_workers=0, epochs=2, stop_points=[*sorted(extra), chain])


@pytest.mark.timeout(600)
@WITH_WORKERS
@given(
    spec=pipelines(max_length=40, max_shards=2),
    workers=st.integers(1, 2),
    data=st.data(),
)
def test_resume_is_exact_with_workers(
    spec: PipelineSpec, workers: int, data: st.DataObject
) -> None:
    kwargs = {"checkpoint_every_n_samples": data.draw(st.integers(1, 5), label="every_n")}
    loader = SavableDataLoader(spec.build(), num_workers=workers, **kwargs)
    events = record_events(loader, 2)[0]
    del loader
    stops = data.draw(st.lists(st.integers(0, len(events)), min_size=1, max_size=2, unique=True))
    chain = data.draw(restart_chains(events, END, max_restarts=2), label="chain")
    check_resume(
        spec.build,
        num_workers=workers,
        epochs=2,
        stop_points=[*sorted(stops), chain],
        loader_kwargs=kwargs,
    )
