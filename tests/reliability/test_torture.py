"""Preemption torture: SIGKILL a training job again and again; nothing lost, nothing repeated.

A real training-like loop (2 workers, map with random draws, shuffle buffer, batch) runs in
a subprocess of its own session; it is killed with its workers at random steps and in the
middle of checkpoint writes, ENERGY_LOADER_TORTURE_KILLS times (20 by default), and restarted
each time from the newest intact checkpoint. Every step any run logged must equal the
uninterrupted run's step, and together the runs must cover every step exactly once.

The 20-kill run is marked slow (CI runs it in its own step); the default run kills the same
job twice, once in a checkpoint write and once at a step, with the same checks.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
SAVE_EVERY = 4


def _run(directory: Path, log: Path, *extra: str) -> int:
    command = [
        sys.executable, "-m", "tests.reliability.torture_trainer",
        "--dir", str(directory), "--log", str(log), "--save-every", str(SAVE_EVERY), *extra,
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPOSITORY, start_new_session=True)
    try:
        return process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _records(log: Path) -> tuple[list[dict], dict]:
    steps, header = [], {}
    for line in log.read_text().splitlines():
        if not line.endswith("}"):
            continue  # a line torn by the kill
        record = json.loads(line)
        if "step" in record:
            steps.append(record)
        else:
            header.update(record)
    return steps, header


def _torture(tmp_path: Path, kills_wanted: int, kinds: tuple[str, ...] = ()) -> tuple[int, int]:
    """Kill the job ``kills_wanted`` times, then check every run against the uninterrupted one.
    ``kinds`` ("save" or "step") fixes what each kill is; past its end the kind is random.
    Returns the kills and how many of them came during checkpoint writes."""
    assert _run(tmp_path / "reference-ckpt", tmp_path / "reference.jsonl") == 0
    reference, _ = _records(tmp_path / "reference.jsonl")
    total = len(reference)
    rng = random.Random(2026)
    directory = tmp_path / "checkpoints"
    kills = restarts = write_kills = 0
    logs = []
    resume_step = -1
    while True:
        log = tmp_path / f"run-{len(logs):03d}.jsonl"
        logs.append(log)
        plan: list[str] = []
        if kills < kills_wanted:
            kind = kinds[kills] if kills < len(kinds) else None
            if kind == "save" or (kind is None and rng.random() < 0.5):
                plan = ["--kill-save", str(rng.randint(1, 4)), "--seed", str(rng.randrange(10**6))]
            else:
                low = max(0, resume_step + 1)
                plan = ["--kill-step", str(rng.randint(low, min(total - 1, low + 6 * SAVE_EVERY)))]
        code = _run(directory, log, *plan)
        if code == 0:
            break
        assert code == -signal.SIGKILL, f"run {log.name} failed with exit code {code}"
        kills += 1
        write_kills += plan[0] == "--kill-save"
        restarts += 1
        steps, header = _records(log)
        saved = [s["step"] for s in steps if s["step"] % SAVE_EVERY == 0]
        resume_step = saved[-1] if saved else header.get("resumed_from", -1)
    # Every step logged by any run equals the uninterrupted run's step ...
    covered: dict[int, dict] = {}
    checked = 0
    for log in logs:
        steps, header = _records(log)
        first = header["resumed_from"] + 1
        for record in steps:
            assert record == reference[record["step"]], f"{log.name}: step {record['step']} differs"
            checked += len(record["indices"])
        if steps:
            assert steps[0]["step"] == first, f"{log.name} did not continue after its checkpoint"
        covered.update({record["step"]: record for record in steps})
    # ... and together they cover the whole run: nothing lost, nothing repeated.
    assert sorted(covered) == list(range(total))
    final = [i for step in range(total) for i in covered[step]["indices"]]
    expected = [i for record in reference for i in record["indices"]]
    assert final == expected
    assert sorted(final) == sorted(expected) and len(set(final)) * 2 == len(final)
    print(
        f"torture: {kills} kills ({write_kills} during checkpoint writes), {restarts} restarts, "
        f"{checked} samples checked, {len(final)} in the final stream, 0 lost, 0 duplicated"
    )
    assert kills >= kills_wanted
    assert not list(directory.glob(".*.tmp")), "stale temporary checkpoint files were left"
    return kills, write_kills


# ~12 s (four runs of the job): slow. The default run's real SIGKILL and resume is the demo's
# (tests/test_cli.py); a failed checkpoint write is tests/state/test_checkpoint.py's.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_sigkills_in_a_write_and_at_a_step_lose_and_repeat_nothing(tmp_path) -> None:
    assert _torture(tmp_path, 2, kinds=("save", "step")) == (2, 1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_repeated_sigkills_lose_and_repeat_nothing(tmp_path) -> None:
    _torture(tmp_path, int(os.environ.get("ENERGY_LOADER_TORTURE_KILLS", "20")))
