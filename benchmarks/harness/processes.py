"""What the processes of a bench run cost, read from ``/proc`` (Linux): which processes run
under the bench, their CPU seconds, peak RSS, context switches and page faults.

A loader's cost is not only the CPU of its workers: the main process competes with them for
the cores, and a transport that wakes a worker's threads (torch passes each shared-memory
tensor's file descriptor through a thread of the worker) costs context switches, which evict
the caches the per-sample work relies on. These counters are how docs/benchmarks.md says
where a real workload's time goes.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

__all__ = ["ProcessCounters", "counters", "cpu_seconds", "descendants", "peak_rss_kib"]


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 on), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # the process is gone
        return None


def _status(path: Path) -> dict[str, str]:
    """A ``/proc`` status file (a process's or a thread's) as ``{name: value}``; empty if the
    process or thread is gone."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def descendants(root: int) -> list[int]:
    """The pids of every live process under ``root`` (workers, their helpers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, pending = [], [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def peak_rss_kib(pids: list[int]) -> dict[int, int]:
    """The peak RSS (VmHWM) of each process that is still there, KiB."""
    peaks = {}
    for pid in pids:
        peak = _status(Path(f"/proc/{pid}/status")).get("VmHWM")
        if peak is not None:
            peaks[pid] = int(peak.split()[0])
    return peaks


def _cpu(fields: list[str]) -> float:
    """User + system CPU seconds (all threads) from a process's stat fields."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds so far of each process (all its threads)."""
    return {pid: _cpu(fields) for pid in pids if (fields := _stat_fields(pid)) is not None}


@attrs.frozen
class ProcessCounters:
    """One process's totals so far: CPU seconds, context switches (voluntary: it waited;
    involuntary: it was preempted), minor page faults and threads."""

    cpu_s: float
    voluntary_switches: int
    involuntary_switches: int
    minor_faults: int
    threads: int

    def __sub__(self, earlier: ProcessCounters) -> ProcessCounters:
        return ProcessCounters(
            self.cpu_s - earlier.cpu_s,
            self.voluntary_switches - earlier.voluntary_switches,
            self.involuntary_switches - earlier.involuntary_switches,
            self.minor_faults - earlier.minor_faults,
            self.threads,
        )


def counters(pids: list[int]) -> dict[int, ProcessCounters]:
    """:class:`ProcessCounters` of each process that is still there (threads summed)."""
    out = {}
    for pid in pids:
        fields, status = _stat_fields(pid), _status(Path(f"/proc/{pid}/status"))
        if fields is None or not status:
            continue
        out[pid] = ProcessCounters(
            cpu_s=_cpu(fields),
            voluntary_switches=_thread_sum(pid, "voluntary_ctxt_switches"),
            involuntary_switches=_thread_sum(pid, "nonvoluntary_ctxt_switches"),
            minor_faults=int(fields[7]),
            threads=int(status["Threads"]),
        )
    return out


def _thread_sum(pid: int, name: str) -> int:
    """``name`` of ``/proc/<pid>/status`` summed over the process's threads (the process's
    own line counts only its first thread)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # the process is gone
        return 0
    return sum(int(_status(task / "status").get(name, "0").split()[0]) for task in tasks)
