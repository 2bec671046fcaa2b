"""Shared fixtures: deterministic hypothesis profiles, a check for leftover processes, and the
``slow`` marker (left out of the default run; ``--run-slow`` or ENERGY_LOADER_RUN_SLOW=1 runs
it, and naming a slow test on the command line runs that test)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time

import pytest
from hypothesis import HealthCheck, settings

# CI: few, deterministic examples. Nightly: ENERGY_LOADER_HYPOTHESIS=nightly for many more.
settings.register_profile(
    "ci",
    max_examples=12,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "nightly",
    max_examples=300,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("ENERGY_LOADER_HYPOTHESIS", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (CI runs them in a step of their own: "
        "--run-slow -m slow); ENERGY_LOADER_RUN_SLOW=1 does the same",
    )


def _runs_slow(config: pytest.Config) -> bool:
    return config.getoption("--run-slow") or os.environ.get("ENERGY_LOADER_RUN_SLOW") == "1"


# Test modules whose tests import heavy libraries (Lightning, Transformers, datasets, s3fs and
# moto, torch.distributed.checkpoint: 20-200 MB each) run last. An import stays for the rest of
# the session, and every worker process a later test starts is a fork of this process: its
# start copies the page tables of everything imported (a 2-worker loader starts in ~60 ms
# from a light process, ~80 ms from a heavy one). Their modules import them inside the tests
# (tests.helpers.LazyModule), not at collection.
RUN_LAST = (
    "tests/test_peek_replay.py",
    "tests/loader/test_dropin_cli.py",
    "tests/test_dcp_scale.py",
    "tests/sources/test_huggingface.py",
    "tests/sources/test_remote_s3.py",
    "tests/loader/test_dropin_huggingface.py",
    "tests/loader/test_dropin_lightning.py",
    "tests/test_bench_workloads.py",
    "tests/integrations/",
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection imported into the collector's permanent generation
    (``gc.freeze()``, as ``GcDataset`` does in a pipeline's process): the tests' own
    ``gc.collect()`` calls and the collector's full passes then skip ~200k objects that live as
    long as the session (~140 ms a pass), and forked workers leave their pages shared."""
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the :data:`RUN_LAST` modules last (the order of the others kept); deselect (and
    count as deselected) the slow tests unless asked for; a test named on the command line
    (``tests/x.py::test_y``, or one of its parameters) always runs."""
    items.sort(key=lambda item: item.nodeid.startswith(RUN_LAST))
    if _runs_slow(config):
        return
    named = [arg.split("::", 1)[1] for arg in config.args if "::" in arg]

    def is_named(item: pytest.Item) -> bool:
        test = item.nodeid.split("::", 1)[1]
        return any(test == n or test.startswith((f"{n}[", f"{n}::")) for n in named)

    keep, slow = [], []
    for item in items:
        if item.get_closest_marker("slow") is None or is_named(item):
            keep.append(item)
        else:
            slow.append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep


@pytest.fixture
def no_leftover_processes():
    """Fail the test if it leaves child processes running (workers must be cleaned up)."""
    before = {p.pid for p in multiprocessing.active_children()}
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [p for p in multiprocessing.active_children() if p.pid not in before]
        if not left:
            return
        time.sleep(0.05)
    pytest.fail(f"test left child processes running: {[p.pid for p in left]}")
