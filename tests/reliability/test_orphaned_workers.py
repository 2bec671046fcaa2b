"""A main process killed mid-epoch: its workers exit on their own, none lingers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import process_alive

REPOSITORY = Path(__file__).resolve().parents[2]

# Batches of ~20 KB travel inline, 16 to a bundle: what a worker still has to send when the
# main process dies is several times a pipe's 64 KiB buffer.
TRAINER = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import energy_loader as el

    def sample(index):
        return {"x": np.full(2500, index, dtype=np.int64)}

    pipeline = el.IndexedSource.from_fn(20_000, sample).batch(1)
    loader = el.SavableDataLoader(pipeline, num_workers=2, prefetch_factor=4)
    for step, batch in enumerate(loader):
        if step == 40:
            pids = [str(w.pid) for w in loader._iterator._workers]
            with open(sys.argv[1], "w") as out:
                out.write(" ".join(pids))
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


# ~7 s, most of it waiting for torch's check on the parent (every 5 s): slow.
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_of_a_killed_main_process_exit(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    # Output to a file, not a pipe: a lingering worker would hold a pipe open.
    with open(tmp_path / "log", "w") as log:
        code = subprocess.run(
            [sys.executable, "-c", TRAINER, str(pids_file)],
            cwd=REPOSITORY,
            stdout=log,
            stderr=log,
            timeout=90,
        ).returncode
    assert code == -9, (tmp_path / "log").read_text()
    pids = [int(p) for p in pids_file.read_text().split()]
    # Torch's workers check on their parent every 5 s; give them 4x that.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(process_alive(p) for p in pids):
        time.sleep(0.1)
    lingering = [p for p in pids if process_alive(p)]
    for pid in lingering:
        os.kill(pid, 9)
    assert not lingering, f"worker processes {lingering} outlived their killed main process"
