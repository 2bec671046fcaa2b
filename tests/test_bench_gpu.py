"""benchmarks/bench_gpu.py, on a CPU (``--device cpu``) at tiny sizes: a loader's timed steps,
the CPU ceiling and the table in this process (default run); the whole script, each loader in
a process of its own, in the slow set. On a GPU machine run it as docs/benchmarks.md says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_gpu

ROOT = Path(__file__).resolve().parents[1]

TINY = ["--device", "cpu", "--batch", "4", "--image", "8", "--steps", "12", "--warmup", "2",
        "--workers", "0", "--work-ms", "0.1", "--repetitions", "1"]  # fmt: skip


def test_a_loaders_steps_the_ceiling_and_the_table_in_one_process() -> None:
    args = bench_gpu.parse_args(TINY)
    rows = {name: bench_gpu.run_loader(name, args) for name in bench_gpu.LOADERS[:2]}
    for row in rows.values():
        assert row["samples_per_s"] > 0 and row["pinned"] is None  # no pinning off CUDA
        assert row["samples_per_s"] == pytest.approx(4 * row["steps_per_s"])
    cost = bench_gpu.sample_cost(args, samples=20)["sample_s"]
    assert cost >= 0.1e-3  # at least the busy loop
    summary = {
        "machine": bench_gpu.machine("cpu"),
        "settings": {},
        "workers": 0,
        "sample_ms": cost * 1e3,
        "ceiling_samples_per_s": 1 / cost,
        "loaders": {
            **{name: {**row, "x_torch": [1.0]} for name, row in rows.items()},
            bench_gpu.LOADERS[2]: {"skipped": "torchdata is not installed"},
        },
    }
    table = bench_gpu.format_table(summary)
    assert "no GPU (device cpu)" in table and f"{torch.__version__}" in table
    assert "| torchdata StatefulDataLoader | not run: torchdata is not installed |" in table
    assert "| SavableDataLoader | " in table


def test_bad_arguments_are_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--device", "cpu", "--steps", "4", "--workers", "2"], "must exceed the batches"),
        (["--device", "cpu", "--batch", "0"], "--batch must be at least 1"),
    ):
        with pytest.raises(SystemExit) as exit_:
            bench_gpu.parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_script_runs_every_loader_in_its_own_process_on_a_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), *TINY[:-4],
         "--workers", "2", "--repetitions", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "machine: no GPU (device cpu)" in result.stdout
    assert "| torch DataLoader | " in result.stdout and "| SavableDataLoader | " in result.stdout
    assert "torchdata StatefulDataLoader" in result.stdout  # a row, or why there is none
    assert out.exists()
