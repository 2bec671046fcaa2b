"""The benchmarks' process accounting (``/proc``): it finds a loader's worker processes and counts
what they spend, so the CPU, RSS and context-switch figures of docs/benchmarks.md come from
the processes that did the work."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.harness import processes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")

BUSY = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"


def test_a_child_is_found_and_its_cpu_and_switches_are_counted() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", BUSY + "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert child.pid in processes.descendants(os.getpid())
            spent = processes.counters([child.pid])[child.pid]
            # Done spinning, and switched out at least once: on an idle machine a spinning
            # child may run unpreempted, but it blocks on stdin (a voluntary switch) right after.
            switched = spent.voluntary_switches + spent.involuntary_switches > 0
            if (spent.cpu_s >= 0.25 and switched) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert spent.cpu_s >= 0.25  # burned at least what it spun for
        assert spent.voluntary_switches + spent.involuntary_switches > 0
        assert spent.minor_faults > 0 and spent.threads >= 1
        assert processes.peak_rss_kib([child.pid])[child.pid] > 1024
    finally:
        child.communicate(b"", timeout=30)
    assert child.pid not in processes.counters([child.pid])  # gone: left out, no error


def test_differences_of_counters_are_what_happened_in_between() -> None:
    me = [os.getpid()]
    before = processes.counters(me)[os.getpid()]
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    time.sleep(0.01)  # a voluntary switch
    spent = processes.counters(me)[os.getpid()] - before
    assert 0.15 <= spent.cpu_s < 5
    assert spent.voluntary_switches >= 1
    assert spent.threads == before.threads
