"""The command line: demo end to end, inspect on what the demo wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from energy_loader.state import RANK_STATE_VERSION
from tests.helpers import run_commands


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "energy_loader", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_HELP_COMMANDS = {
    "top": (),
    "demo": ("demo",),
    "bench": ("bench",),
    "inspect": ("inspect",),
    "replay": ("replay",),
    "index": ("index",),
}
_USAGE_COMMANDS = ((), ("frobnicate",))


@pytest.fixture(scope="module")
def cli_runs() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """The help of every command and the usage errors, keyed by the arguments."""
    commands = [(*c, "--help") for c in _HELP_COMMANDS.values()] + list(_USAGE_COMMANDS)
    return dict(zip(commands, run_commands(*commands), strict=True))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = _run(
        "demo", "--samples", "2000", "--seed", "3", "--save-every", "7", "--out", str(out)
    )
    return out, result


@pytest.mark.timeout(300)
def test_demo_kills_resumes_and_proves_identity(demo_run) -> None:
    _, result = demo_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert "killed itself with SIGKILL" in result.stdout
    assert "VERDICT: IDENTICAL" in result.stdout
    # It names what it timed: the whole state_dict(), not save_state_rank() alone.
    assert re.search(r"loader.state_dict\(\): median [\d.]+ ms over \d+ saves", result.stdout)
    assert "save_state_rank() alone" in result.stdout


# A third demo run (~20 s): slow. Without --out the demo's folder is a temporary one.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_removes_its_temporary_folder(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "energy_loader", "demo", "--samples", "500", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "VERDICT: IDENTICAL" in result.stdout
    assert f"in {tmp_path}" in result.stdout  # it did write there
    assert list(tmp_path.iterdir()) == []


# A second demo run (~20 s): slow. The demo's kill and resume run above; a state saved after an
# epoch's last item restoring to "epoch over" is test_epoch_boundaries' (0 and 2 workers).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_resumed_from_an_epochs_last_batch_runs_each_epoch_once(demo_run, tmp_path) -> None:
    # Checkpoints land on epoch 0's last step, and the kill comes just after it: the resumed
    # run must go on with epoch 1, not run a third epoch.
    _, first = demo_run
    total = int(re.search(r"uninterrupted run: (\d+)", first.stdout).group(1))
    per_epoch = total // 2
    result = _run(
        "demo", "--samples", "2000", "--seed", "3", "--save-every", str(per_epoch - 1),
        "--kill-step", str(per_epoch + 1), "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed from the checkpoint of step {per_epoch - 1}" in result.stdout
    assert "VERDICT: IDENTICAL" in result.stdout


@pytest.mark.timeout(120)
def test_inspect_reads_a_checkpoint_the_demo_wrote(demo_run) -> None:
    out, _ = demo_run
    checkpoint = sorted((out / "checkpoints").glob("*.pt"))[-1]
    (result,) = run_commands(("inspect", str(checkpoint)))
    assert result.returncode == 0, result.stderr
    assert f"format energy_loader.rank_state version {RANK_STATE_VERSION}" in result.stdout
    assert "rank 0 of 1, 2 workers, 2 logical partitions (1 per worker)" in result.stdout
    assert "items handed out by rank 0 in this epoch; global position" in result.stdout
    assert "\nseed: 0\n" in result.stdout  # the demo's loader runs with the default seed
    assert "a restore places each partition at its worker's rolling checkpoint" in result.stdout
    assert re.search(
        r"partition 1: rolling checkpoint at epoch \d+ \(\w+\).*source position \d+; then "
        r"replay \d+ items",
        result.stdout,
    ), result.stdout
    assert "ShuffleBufferDataset(size=500)" in result.stdout


@pytest.mark.timeout(60)
def test_inspect_refuses_garbage_with_one_line_and_exit_2(tmp_path) -> None:
    garbage = tmp_path / "x.pt"
    garbage.write_bytes(b"\x00not a checkpoint")
    result, missing = run_commands(
        ("inspect", str(garbage)), ("inspect", str(tmp_path / "missing.pt"))
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert missing.returncode == 2


@pytest.mark.timeout(60)
def test_usage(cli_runs) -> None:
    assert cli_runs[()].returncode == 2
    assert cli_runs[("frobnicate",)].returncode == 2
    help_text = cli_runs[("demo", "--help")].stdout
    assert "--kill-step" in help_text and "--workers" in help_text


@pytest.mark.slow  # a whole bench run, ~25 s: CI's slow step runs it
@pytest.mark.timeout(300)
def test_bench_at_tiny_sizes_writes_every_field(tmp_path) -> None:
    options = ["--samples", "2048", "--repetitions", "1", "--out", str(tmp_path)]
    result = _run("bench", *options, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "bench.json").read_text())
    # The installed bench runs the reference workload's plain DataLoader and energy_loader only
    # (benchmarks/bench_loader.py the other workloads, benchmarks/bench_peers.py the peers).
    assert list(summary["table"]) == ["plain", "energy_loader", "energy_loader+save50"]
    for row in summary["table"].values():
        assert set(row) >= {
            "samples_per_s", "ratio", "paired_ratio", "save_ms_median", "save_ms_p95",
            "repetitions",
        }  # fmt: skip
        assert row["samples_per_s"] > 0
    assert summary["table"]["plain"]["ratio"] == 1.0
    assert summary["table"]["energy_loader+save50"]["save_ms_median"] > 0
    restore = summary["restore"]["energy_loader"]
    assert set(restore["restore_ms_median"]) == {"0.1", "0.5", "0.9"}
    assert restore["state_bytes"] > 0 and restore["exact_resume"] is True
    assert summary["workload"]["samples"] == 2048
    assert summary["workload"]["workload"] == "reference"
    assert "identical" in result.stdout
    assert set(summary["restore"]) == {"energy_loader"} and summary["missing"] == {}


_MARKUP = ("``", ":func:", ":class:", ":meth:", ":mod:", ":data:")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("command", list(_HELP_COMMANDS.values()), ids=list(_HELP_COMMANDS))
def test_help_is_plain_text(cli_runs, command: tuple[str, ...]) -> None:
    result = cli_runs[(*command, "--help")]
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    found = [markup for markup in _MARKUP if markup in result.stdout]
    assert not found, f"help of {command} shows docstring markup {found}:\n{result.stdout}"


@pytest.mark.parametrize("script", ["bench_loader.py", "bench_peers.py"])
def test_benchmark_scripts_run_from_their_place_beside_the_package(cli_runs, script) -> None:
    """``benchmarks/bench_loader.py`` and ``bench_peers.py`` (scripts, not commands of the
    installed package) find the harness and the peers' adapters from where they live; their
    help is plain text too. The package's bench has none of their options."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    result = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert f"usage: python benchmarks/{script}" in result.stdout
    assert "--workload" in result.stdout and "--cache" in result.stdout
    assert ("--peer-venvs" in result.stdout) == (script == "bench_peers.py")
    found = [markup for markup in _MARKUP if markup in result.stdout]
    assert not found, f"help of {script} shows docstring markup {found}:\n{result.stdout}"
    bench_help = cli_runs[("bench", "--help")].stdout
    assert not [o for o in ("--peer-venvs", "--workload", "--cache") if o in bench_help]
    assert "--samples" in bench_help and "--repetitions" in bench_help
