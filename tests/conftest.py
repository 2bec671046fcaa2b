"""Shared fixtures: deterministic hypothesis profiles and a check for leftover processes."""

from __future__ import annotations

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
