"""End to end: torchrun jobs train a DDP model with dropout through the loader, are killed with
SIGKILL and resumed, and are compared by final weights, steps per rank and samples.

Every job is tests/training_job.py under a real ``torchrun --standalone`` (gloo on 127.0.0.1,
CPU), started as a subprocess: the launcher, DCP, the process group's teardown and the loader's
workers are the user's, and a job must leave no process behind. A killed job dies after a
published checkpoint; its restart copies the checkpoint folder, as a restarted job finds it.
Jobs that do not depend on each other run at once, and a job several tests need runs once per
test session, also under xdist (:class:`Runs`).

What this module is not: the place for the loader's finer cases. tests/test_distributed.py
runs rank programs in forked processes, a launch costing ~1 s against ~6 s here; this module
checks that the promises hold in the program a user writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loader.dropin_helpers import dealt_rest, distributed_order

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "training_job.py"
TIMEOUT = 120.0  # seconds a round of jobs started together may take
EPOCHS = 2
SEED = 1234  # training_job's default --seed
# tests/training_job.py's LENGTH and BATCH_SIZE (not imported: it imports DCP, which this
# process does not need and the tests' forked workers would carry, tests/conftest.py)
SAMPLES = 384
BATCH_SIZE = 8
ENVIRONMENT = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "OMP_NUM_THREADS": "1",  # torchrun's default, set here so that it does not warn
    "GLOO_SOCKET_IFNAME": "lo",
}
RESULT = "result.json"  # in a job's folder once it ended
MARKER = "ENERGY_LOADER_TRAINING_JOB"  # in every process of a job: its working directory


# -- jobs and their runs -----------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One torchrun launch of tests/training_job.py; ``resume_from``: a killed job whose
    checkpoint folder this one starts from (a copy)."""

    kind: str
    nproc: int = 2
    num_workers: int = 0
    every: int = 5
    kill_at: int | None = None
    resume_from: Job | None = None

    @property
    def checkpoint_step(self) -> int:
        """The step of the newest checkpoint a killed job published."""
        assert self.kill_at is not None
        return self.kill_at // self.every * self.every

    def command(self, workdir: Path) -> list[str]:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={self.nproc}", str(JOB), f"--kind={self.kind}",
            f"--ckpt-dir={workdir / 'ckpt'}", f"--log-dir={workdir / 'logs'}",
            f"--weights={workdir / 'weights.pt'}", f"--num-workers={self.num_workers}",
            f"--epochs={EPOCHS}", f"--every={self.every}", f"--seed={SEED}",
        ]  # fmt: skip
        if self.kill_at is not None:
            command.append(f"--kill-at-step={self.kill_at}")
        return command

    @property
    def name(self) -> str:
        """A folder name for the job, the same in every process."""
        name = f"{self.kind}-{self.nproc}ranks-{self.num_workers}workers-every{self.every}"
        if self.kill_at is not None:
            name += f"-kill{self.kill_at}"
        if self.resume_from is not None:
            name += f"-from-{self.resume_from.name}"
        return name

    def describe(self) -> str:
        text = f"{self.kind} on {self.nproc} rank(s) x {self.num_workers} worker(s)"
        if self.kill_at is not None:
            text += f", killed after step {self.kill_at} (checkpoint {self.checkpoint_step})"
        if self.resume_from is not None:
            text += f", resumed from step {self.resume_from.checkpoint_step}"
        return text


@dataclass
class Run:
    """What a job left: its exit code, torchrun's output, one log per rank, the weights."""

    job: Job
    workdir: Path
    returncode: int
    seconds: float
    logs: list[list[dict[str, Any]]] = field(default_factory=list)

    @classmethod
    def read(cls, job: Job, workdir: Path) -> Run:
        """The run whose result the process that ran it wrote (this one or another xdist
        worker); an ``AssertionError`` with its error if it hung or left processes."""
        result = json.loads((workdir / RESULT).read_text())
        assert not result["error"], result["error"]
        logs = []
        for rank in range(job.nproc):
            path = workdir / "logs" / f"rank{rank}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            logs.append([json.loads(line) for line in lines])
        return cls(job, workdir, result["returncode"], result["seconds"], logs)

    @property
    def output(self) -> str:
        return (self.workdir / "torchrun.out").read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        kept = [
            line
            for line in self.output.splitlines()
            if line.strip() and not line.lstrip().startswith(("File ", "^"))
        ]
        return f"{self.job.describe()}, exit code {self.returncode}:\n" + "\n".join(kept[-lines:])

    def first_error(self) -> str:
        """The first error a rank printed (``[rank1]: RuntimeError: ...``), else how torchrun
        saw its ranks end (a signal, an exit code), else the output's last lines."""
        lines = self.output.splitlines()
        for line in lines:
            if line.startswith("[rank") and "Error: " in line:
                return line
        ends = [line.strip() for line in lines if "exitcode" in line or "Signal" in line]
        return "; ".join(ends) or self.tail(8)

    def weights(self) -> dict[str, torch.Tensor]:
        return torch.load(self.workdir / "weights.pt", weights_only=True)


def _processes_of(marker: str) -> list[str]:
    """The live (not zombie) processes whose environment holds ``MARKER=marker`` (a job's
    torchrun, its ranks and their loader workers, also once orphaned): ``pid cmdline``.
    torchrun starts every rank in a session of its own, so a process group would miss them."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append(f"{entry.name} {cmdline.strip()}")
    return found


def _kill(processes: list[str]) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(int(process.split()[0]), signal.SIGKILL)


def run_jobs(launches: list[tuple[Job, Path]]) -> None:
    """Start every job at once, wait for all of them (``TIMEOUT`` seconds together), and write
    each one's result (exit code, seconds, error) to its folder. An error: the job was still
    running at the deadline, or it left a process running (a loader worker outliving its
    killed rank, say); what is left of it is killed."""
    started = []
    for job, workdir in launches:
        with open(workdir / "torchrun.out", "wb") as output:
            process = subprocess.Popen(
                job.command(workdir),
                cwd=workdir,
                # TMPDIR: torchrun's own log folders (torchelastic_*) go with the job's
                env={**ENVIRONMENT, MARKER: str(workdir), "TMPDIR": str(workdir)},
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        started.append((job, workdir, process, time.monotonic()))
    deadline = time.monotonic() + TIMEOUT
    for job, workdir, process, start in started:
        error = ""
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            error = f"{job.describe()} ({workdir}): still running after {TIMEOUT:.0f} s"
        seconds = time.monotonic() - start
        remaining = _processes_of(str(workdir))
        for _ in range(100):  # 10 s for what the job's end or its kill leaves to wind down
            if not remaining or error:
                break
            time.sleep(0.1)
            remaining = _processes_of(str(workdir))
        if remaining:
            _kill(remaining)
            process.wait()
            error = error or f"{job.describe()} ({workdir}) left {remaining}"
        if error:
            error += "\n" + (workdir / "torchrun.out").read_text(errors="replace")[-3000:]
        result = {"returncode": process.returncode, "seconds": seconds, "error": error}
        (workdir / RESULT).write_text(json.dumps(result))


# How torch's abort at exit shows in torchrun's output: the C++ runtime's line, or torchrun's
# report of a rank ended by SIGABRT (the line can be lost when the rank dies mid-write).
TORCH_EXIT_ABORT = ("terminate called without an active exception", "exitcode  : -6", "SIGABRT")


def _torch_abort(job: Job, workdir: Path) -> bool:
    """Whether a job that was not killed on purpose failed with torch's abort at exit."""
    result = json.loads((workdir / RESULT).read_text())
    output = (workdir / "torchrun.out").read_text(errors="replace")
    aborted = any(sign in output for sign in TORCH_EXIT_ABORT)
    return job.kill_at is None and result["returncode"] != 0 and aborted


class Runs:
    """Each job run once per test session, in ``root`` (shared by the session's xdist
    workers): the jobs a call needs that no process has run run at once, the restarts after
    the jobs they restart from; a job another worker is running is waited for (a lock file
    per job) and read."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _prepare(self, job: Job, workdir: Path) -> None:
        """An empty folder for ``job`` (what a failed attempt left removed), holding the
        checkpoints of the job it restarts from."""
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir()
        if job.resume_from is not None:  # the restarted job finds the killed one's
            shutil.copytree(self.root / job.resume_from.name / "ckpt", workdir / "ckpt")

    def get(self, *jobs: Job) -> list[Run]:
        killed = [job.resume_from for job in jobs if job.resume_from is not None]
        for batch in (killed, jobs):
            self._run(list(dict.fromkeys(batch)))
        return [Run.read(job, self.root / job.name) for job in jobs]

    def _run(self, jobs: list[Job]) -> None:
        mine: list[tuple[Job, Path]] = []
        locks, others = [], []
        try:
            for job in jobs:
                workdir = self.root / job.name
                lock = open(self.root / f"{job.name}.lock", "w")  # noqa: SIM115
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another worker runs it
                    others.append(lock)
                    continue
                locks.append(lock)
                if (workdir / RESULT).exists():
                    continue
                self._prepare(job, workdir)
                mine.append((job, workdir))
            if mine:
                run_jobs(mine)
                # torch's gloo can abort a rank that finished at interpreter exit (a C++
                # thread destroyed unjoined: "terminate called without an active exception";
                # seen once in some 30 runs of the slow set, with no loader thread left).
                # Such a job runs once more; the test fails if it happens again.
                again = [(job, workdir) for job, workdir in mine if _torch_abort(job, workdir)]
                for job, workdir in again:
                    self._prepare(job, workdir)
                if again:
                    run_jobs(again)
        finally:
            for lock in locks:
                lock.close()  # releases it
        for lock in others:
            fcntl.flock(lock, fcntl.LOCK_EX)  # until the other worker wrote the result
            lock.close()


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.getbasetemp()
    # Under xdist every worker has a base folder of its own in the session's.
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "training_jobs"
    root.mkdir(exist_ok=True)
    return Runs(root)


# -- what the tests assert ---------------------------------------------------------------------


def assert_ended(run: Run) -> None:
    assert run.returncode == 0, run.tail()


def assert_preempted(run: Run) -> None:
    """torchrun failed because its ranks were SIGKILLed after the checkpoint step."""
    job = run.job
    assert run.returncode != 0 and "SIGKILL" in run.output, run.tail()
    published = run.workdir / "ckpt" / f"step_{job.checkpoint_step:06d}"
    assert published.is_dir(), f"{job.describe()}: no {published.name} published"
    steps = [[line["step"] for line in log] for log in run.logs]
    assert steps == [list(range(1, job.kill_at + 1))] * job.nproc, steps  # type: ignore[operator]


def first_difference(expected: list[Any], got: list[Any], what: str) -> str | None:
    for place, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return f"{what}, line {place}: expected {a}, got {b}"
    if len(expected) != len(got):
        return f"{what}: expected {len(expected)} lines, got {len(got)}"
    return None


def steps_per_epoch(logs: list[list[dict[str, Any]]]) -> dict[int, list[int]]:
    """``{epoch: [steps of rank 0, steps of rank 1, ...]}``."""
    counts = [Counter(line["epoch"] for line in log) for log in logs]
    epochs = sorted(set().union(*counts))
    return {epoch: [count[epoch] for count in counts] for epoch in epochs}


def ids_of(logs: list[list[dict[str, Any]]], epoch: int, up_to: float = float("inf")) -> list[int]:
    return [
        index
        for log in logs
        for line in log
        if line["epoch"] == epoch and line["step"] <= up_to
        for index in line["ids"]
    ]


# -- the same world size: the weights of an uninterrupted run ----------------------------------

slow = pytest.mark.slow

SAME_SIZE = [
    # (kind, workers, checkpoint every, killed after step): 24 steps an epoch on 2 ranks
    pytest.param("pipeline", 0, 5, 7, id="pipeline-0workers-step7"),
    pytest.param("pipeline", 2, 5, 7, id="pipeline-2workers-step7", marks=slow),
    pytest.param("dropin", 0, 5, 7, id="dropin-0workers-step7", marks=slow),
    pytest.param("dropin", 2, 5, 7, id="dropin-2workers-step7", marks=slow),
    # checkpoint at epoch 0's last batch (step 24, inside the loop), killed in epoch 1
    pytest.param("pipeline", 2, 8, 26, id="pipeline-2workers-step26", marks=slow),
    pytest.param("dropin", 0, 8, 26, id="dropin-0workers-step26", marks=slow),
    pytest.param("dropin", 2, 8, 26, id="dropin-2workers-step26", marks=slow),
]


@pytest.mark.parametrize(("kind", "workers", "every", "kill_at"), SAME_SIZE)
def test_a_killed_job_resumed_on_as_many_ranks_ends_with_the_uninterrupted_weights(
    runs: Runs, kind: str, workers: int, every: int, kill_at: int
) -> None:
    """Two ranks train two epochs uninterrupted; the same job SIGKILLed after step
    ``kill_at`` and restarted from its newest checkpoint trains the same batches on every
    rank, step for step, and ends with bit-identical weights (dropout masks included: each
    rank puts its RNG back from the checkpoint)."""
    full = Job(kind, num_workers=workers, every=every)
    killed = Job(kind, num_workers=workers, every=every, kill_at=kill_at)
    resumed = Job(kind, num_workers=workers, every=every, resume_from=killed)
    full_run, killed_run, resumed_run = runs.get(full, killed, resumed)
    assert_ended(full_run)
    assert_preempted(killed_run)
    assert_ended(resumed_run)
    for epoch in range(EPOCHS):  # what the uninterrupted job trains: each sample once
        assert sorted(ids_of(full_run.logs, epoch)) == list(range(SAMPLES)), f"epoch {epoch}"
    saved = killed.checkpoint_step
    differences = []
    for rank, log in enumerate(full_run.logs):
        differences += [
            first_difference(log[:kill_at], killed_run.logs[rank], f"killed job, rank {rank}"),
            first_difference(log[saved:], resumed_run.logs[rank], f"resumed job, rank {rank}"),
        ]
    assert not any(differences), [d for d in differences if d]
    expected, got = full_run.weights(), resumed_run.weights()
    assert expected.keys() == got.keys()
    differing = {
        name: float((expected[name] - got[name]).abs().max())
        for name in expected
        if not torch.equal(expected[name], got[name])
    }
    assert not differing, f"{resumed.describe()}: weights differ (max abs): {differing}"


# -- another world size: a savable pipeline ------------------------------------------------------

# A 2-rank job killed after step K (48 batches an epoch, 24 a rank): checkpoints at
# 5 (10 batches used, 38 left: 3, 4, 6 do not divide), 6 (12 used, 36 left: all divide) and
# 27 (epoch 1, 6 used, 42 left: 3 and 6 divide, 4 does not).
KILLED_PIPELINE = {
    5: Job("pipeline", every=5, kill_at=7),  # the job the default same-size case kills
    6: Job("pipeline", every=6, kill_at=6),
    27: Job("pipeline", every=27, kill_at=27),
}

RESIZES = [
    # (new world size, checkpoint step, new workers per rank)
    pytest.param(3, 5, 0, id="2to3-step5"),
    pytest.param(1, 5, 0, id="2to1-step5", marks=slow),
    pytest.param(4, 5, 0, id="2to4-step5", marks=slow),
    pytest.param(6, 5, 0, id="2to6-step5", marks=slow),
    pytest.param(1, 6, 0, id="2to1-step6", marks=slow),
    pytest.param(3, 6, 0, id="2to3-step6", marks=slow),
    pytest.param(4, 6, 0, id="2to4-step6", marks=slow),
    pytest.param(6, 6, 0, id="2to6-step6", marks=slow),
    pytest.param(3, 27, 0, id="2to3-step27", marks=slow),
    pytest.param(4, 27, 0, id="2to4-step27", marks=slow),
    pytest.param(4, 5, 2, id="2to4-step5-2workers", marks=slow),
]


@pytest.mark.parametrize(("nproc", "saved", "workers"), RESIZES)
def test_a_pipeline_job_resumed_on_another_world_size_trains_every_sample_once_in_lockstep(
    runs: Runs, nproc: int, saved: int, workers: int
) -> None:
    """A 2-rank pipeline job (``num_partitions=12``) killed after its checkpoint at step
    ``saved`` restarts on ``nproc`` ranks: the job ends well (exit code 0), every rank trains
    as many steps as every other in every epoch (DDP needs it), and every sample is trained
    exactly once per epoch over all ranks, the interrupted epoch counted from the killed job's
    steps up to the checkpoint and the restarted job's."""
    killed = KILLED_PIPELINE[saved]
    resumed = Job("pipeline", nproc=nproc, num_workers=workers, resume_from=killed)
    killed_run, resumed_run = runs.get(killed, resumed)
    assert_preempted(killed_run)
    steps = steps_per_epoch(resumed_run.logs)
    problems = []
    if resumed_run.returncode != 0:
        problems.append(f"exit code {resumed_run.returncode} ({resumed_run.first_error()})")
    unequal = {epoch: counts for epoch, counts in steps.items() if len(set(counts)) > 1}
    if unequal:
        problems.append(f"unequal steps per rank (epoch: [rank 0, rank 1, ...]): {unequal}")
    for epoch in range(EPOCHS):
        trained = Counter(ids_of(killed_run.logs, epoch, up_to=saved))
        trained.update(ids_of(resumed_run.logs, epoch))
        missing = sorted(set(range(SAMPLES)) - set(trained))
        repeated = sorted(index for index, times in trained.items() if times > 1)
        if missing or repeated:
            problems.append(
                f"epoch {epoch}: {len(missing)} sample(s) missing {missing[:8]}, "
                f"{len(repeated)} repeated {repeated[:8]}"
            )
    assert not problems, (
        f"{resumed.describe()} from the checkpoint of {killed.describe()}: "
        + "; ".join(problems)
        + f"\nsteps per epoch and rank: {steps}"
    )


# -- another world size: a drop-in under DistributedSampler ---------------------------------------


@slow
def test_a_dropin_job_resumed_from_two_ranks_on_three_trains_in_lockstep(runs: Runs) -> None:
    """A 2-rank drop-in job (map-style dataset, ``DistributedSampler(shuffle=True)``, batch 8)
    killed after step 7 restarts from its checkpoint of step 5 on 3 ranks. torch's rule, as
    the drop-in applies it to the rest of a resized epoch (docs/distributed.md, 2e): the old
    ranks used the permutation's first 2 x 5 x 8 = 80 positions; the 304 left are dealt as
    ``DistributedSampler`` deals, new rank r taking every 3rd from r, padded from the rest's
    start to 306 (2 samples twice, none lost): 102 samples, 13 steps on every rank. Epoch 1
    is ``DistributedSampler``'s own on 3 ranks: 128 samples, 16 steps a rank, each once. The
    job ends with exit code 0."""
    killed = Job("dropin", every=5, kill_at=7)
    resumed = Job("dropin", nproc=3, resume_from=killed)
    killed_run, resumed_run = runs.get(killed, resumed)
    assert_preempted(killed_run)
    saved = killed.checkpoint_step
    used = len(ids_of(killed_run.logs, 0, up_to=saved))
    expected: dict[int, list[list[int]]] = {}  # epoch -> each new rank's samples, in order
    for epoch in range(EPOCHS):
        order = distributed_order(SAMPLES, epoch, seed=SEED)
        done = used if epoch == 0 else 0
        expected[epoch] = [dealt_rest(order, done, 3, rank) for rank in range(3)]
    got = {epoch: [ids_of([log], epoch) for log in resumed_run.logs] for epoch in range(EPOCHS)}
    steps = steps_per_epoch(resumed_run.logs)
    expected_steps = {
        epoch: [-(-len(ranks[0]) // BATCH_SIZE)] * 3 for epoch, ranks in expected.items()
    }
    assert used == 80, used
    assert (resumed_run.returncode, steps) == (0, expected_steps), resumed_run.tail(15)
    assert got == expected
    # What it means: each sample once, but for DistributedSampler's padding of the rest.
    trained = Counter(ids_of(killed_run.logs, 0, up_to=saved) + ids_of(resumed_run.logs, 0))
    order = distributed_order(SAMPLES, 0, seed=SEED)
    assert set(trained) == set(range(SAMPLES))
    assert sorted(i for i, n in trained.items() if n == 2) == sorted(order[used : used + 2])
