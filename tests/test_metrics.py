"""loader.stats() and the stall warning, on real worker processes."""

from __future__ import annotations

import logging
import time

import pytest

import energy_loader as el
from energy_loader.loader.stall import StallWarner, diagnose
from energy_loader.metrics import StallPolicy, flatten, resolve_stall_policy, tqdm_postfix

from .observe_pipelines import make, sleep_20ms

FAST_WINDOW = StallPolicy(threshold=0.3, window_seconds=0.2, min_steps=5)


def _loader(slow: bool, workers: int = 2, length: int = 60, **options) -> el.SavableDataLoader:
    source = el.IndexedSource.from_fn(length, make)
    pipeline = el.MapDataset(source, sleep_20ms) if slow else source
    return el.SavableDataLoader(pipeline, num_workers=workers, **options)


@pytest.mark.parametrize("workers", [0, 2])
def test_stats_add_up_and_see_a_slow_map(workers: int) -> None:
    loader = _loader(slow=True, workers=workers, length=30, stall_warning=False)
    taken = sum(1 for _ in loader)
    loader.save_state_rank()
    stats = loader.stats()
    assert stats["since_last"]["items"] == taken == stats["total"]["items"] == 30
    assert stats["total"]["saves"] == 1 and stats["total"]["save_s_sum"] > 0
    # Each item costs 20 ms to make; 2 workers overlap, the main process waits the rest.
    assert stats["total"]["wait_s_p50"] > 0.004
    assert stats["total"]["wait_fraction"] > 0.5
    workers_seen = stats["total"]["workers"]
    assert len(workers_seen) == max(1, workers)
    assert sum(w["items"] for w in workers_seen) == 30
    assert all(w["busy_fraction"] > 0.3 for w in workers_seen)
    if workers:
        assert stats["total"]["transport_bytes"] > 0 and stats["total"]["decode_s"] > 0
    again = loader.stats()
    assert again["since_last"]["items"] == 0 and again["total"]["items"] == 30
    loader._shutdown_workers()


def test_fast_source_and_slow_training_loop_wait_about_nothing() -> None:
    loader = _loader(slow=False, stall_warning=False)
    iterator = iter(loader)
    next(iterator)  # worker start-up
    loader.stats()
    for _ in range(20):
        next(iterator)
        time.sleep(0.01)  # the training step
    stats = loader.stats()["since_last"]
    assert stats["items"] == 20
    # Generous bounds: the cores are shared with other jobs.
    assert stats["wait_s_p50"] < 0.005
    assert stats["wait_fraction"] < 0.3
    assert stats["busy_fraction_mean"] < 0.6
    assert set(stats) >= {"wait_s_p90", "wait_s_p99", "wait_s_mean", "items_per_s", "decode_s"}
    flat = flatten(loader.stats())
    assert "total/workers/1/busy_fraction" in flat and "queue_depth/0" in flat
    assert all(isinstance(v, (int, float)) for v in flat.values())
    assert set(tqdm_postfix(loader.stats())) == {"it/s", "wait", "p90", "busy"}
    loader._shutdown_workers()


def test_stall_warning_fires_once_for_a_slow_source(caplog) -> None:
    loader = _loader(slow=True, stall_warning=FAST_WINDOW)
    with caplog.at_level(logging.WARNING, logger="energy_loader"):
        for _ in loader:
            pass
    warnings = [r for r in caplog.records if "waited for data" in r.getMessage()]
    assert 1 <= len(warnings) <= 3, [r.getMessage() for r in warnings]
    # A sleeping map keeps the workers busy: saturated, unless load on the machine made one
    # worker lag (then the straggler diagnosis is as right). The first window may hold the
    # workers' start (busy less: "bursts"), so some window, not necessarily the first, says so.
    messages = [warning.getMessage() for warning in warnings]
    assert any("saturated" in m or "slow source" in m for m in messages), messages
    assert all("Likely cause" in m for m in messages), messages
    assert "stall_warning=False" in warnings[0].getMessage()
    loader._shutdown_workers()


def test_stall_warning_silent_when_fast_or_off(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="energy_loader"):
        fast = _loader(slow=False, stall_warning=FAST_WINDOW)
        for _ in fast:  # a step 3x what an item costs a worker on a machine loaded 4x
            time.sleep(0.03)
        fast._shutdown_workers()
        off = _loader(slow=True, workers=0, length=20, stall_warning=False)
        for _ in off:
            pass
    assert not [r for r in caplog.records if "waited for data" in r.getMessage()]


def test_warnings_back_off() -> None:
    warner = StallWarner(num_workers=2, threshold=0.3)
    window = {
        "wait_fraction": 0.9,
        "seconds": 1.0,
        "items": 10,
        "items_per_s": 10.0,
        "wait_s_mean": 0.1,
        "wait_s_sum": 1.0,
        "decode_s": 0.0,
        "transport_bytes": 0,
        "workers": [{"busy_fraction": 0.95}, {"busy_fraction": 0.9}],
    }
    for _ in range(10):
        warner(window)
    assert warner.warnings == 3  # windows 1, 3 and 6


def test_diagnosis_names_the_cause() -> None:
    base = {"items": 10, "transport_bytes": 10**7, "decode_s": 0.5, "wait_s_sum": 1.0}
    straggler = diagnose({**base, "workers": [{"busy_fraction": 0.95}, {"busy_fraction": 0.2}]}, 2)
    assert "worker 0" in straggler and "slow source" in straggler
    idle = diagnose({**base, "workers": [{"busy_fraction": 0.1}, {"busy_fraction": 0.1}]}, 2)
    assert "transport bound" in idle and "prefetch_factor" in idle
    assert "num_workers=0" in diagnose({**base, "workers": [{"busy_fraction": 1.0}]}, 0)


def test_arguments_are_checked() -> None:
    assert resolve_stall_policy(False) is None and resolve_stall_policy(None) is None
    assert resolve_stall_policy(0.5) == StallPolicy(threshold=0.5)
    with pytest.raises(TypeError, match="stall_warning"):
        _loader(slow=False, stall_warning="loud")
    with pytest.raises(ValueError, match="threshold"):
        StallPolicy(threshold=1.5)
    with pytest.raises(ValueError, match="window_seconds"):
        StallPolicy(window_seconds=0)
    with pytest.raises(ValueError, match="since_last"):
        tqdm_postfix({})
    with pytest.raises(TypeError):
        flatten([1])  # type: ignore[arg-type]
