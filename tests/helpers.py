"""Small pipelines shared by the tests (module-level, so spawn can import them)."""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import io
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

import energy_loader as el
from energy_loader.testing.strategies import AddNoise, MakeSample

# The model-based properties' examples: the CI profile's 12 in the default run, 30 for the
# ones in CI's slow step, 500 with ENERGY_LOADER_HYPOTHESIS=nightly (tests/conftest.py has the
# profiles; this sets only the count).
_NIGHTLY = os.environ.get("ENERGY_LOADER_HYPOTHESIS") == "nightly"
MODEL_EXAMPLES = settings(max_examples=500 if _NIGHTLY else 12)
SLOW_MODEL_EXAMPLES = settings(max_examples=500 if _NIGHTLY else 30)
# A wrapper's own resume test without workers in the default run, and with two worker
# processes in the slow step (CI runs both): the default run's drawn pipelines of every
# wrapper already resume with 1-3 workers (test_pipeline_properties_all).
WORKERS_0_AND_2 = [0, pytest.param(2, marks=pytest.mark.slow)]


class LazyModule:
    """Module ``name``, imported at the first read of one of its names.

    For the test modules of the heavy integrations (Lightning, Transformers: 140-200 MB once
    imported): collection does not import them, and the tests that run before them fork their
    worker processes from a smaller process.
    """

    def __init__(self, name: str) -> None:
        self._lazy_name = name

    def __getattr__(self, attribute: str) -> Any:
        # pytest's collection probes every global of a test module (``__wrapped__``,
        # ``_mock_name``): those are answered without the import.
        if attribute.startswith("__") or attribute == "_mock_name":
            raise AttributeError(attribute)
        module = self.__dict__.get("_module")
        if module is None:
            module = self._module = importlib.import_module(self._lazy_name)
            # What the import made lives as long as the session: out of the collector's full
            # passes (tests/conftest.py's pytest_collection_finish says why).
            gc.freeze()
        return getattr(module, attribute)


def resealed(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a pipeline rank state with its digests recomputed after an edit, so that a
    test reaches the checks beneath them (a state edited and then re-checked by hand)."""
    from energy_loader.state.rank_state import PartitionState, RankState, WorkerSlots

    out = copy.deepcopy(state)
    for entry in out["partitions"]:
        fields = {name: entry[name] for name in ("partition", "checkpoint", "skip", "done", "last")}
        entry["check"] = PartitionState(**fields, made=entry.get("made")).check()
    header = {
        name: value
        for name, value in out.items()
        if name not in ("format", "version", "checks", "partitions")
    }
    header["workers"] = tuple(
        WorkerSlots(tuple(w["partitions"]), w["next"], w["done"]) for w in out["workers"]
    )
    resealed_header = RankState(**header, partitions=())
    out["checks"] = {
        "position": resealed_header.position_check(),
        "config": resealed_header.config_check(),
    }
    return out


def saved_at(loader: el.SavableDataLoader, steps: int) -> tuple[dict[str, Any], list[list[int]]]:
    """``loader``'s rank state after ``steps`` items, and the indices of every item after
    them in its epoch (what a restore of that state must hand out)."""
    iterator = iter(loader)
    for _ in range(steps):
        next(iterator)
    state = loader.save_state_rank()
    return state, [indices(batch) for batch in iterator]


def make_sample(index: int) -> dict[str, Any]:
    return {"index": index, "x": torch.tensor([index])}


def noisy(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "noise": random.random()}


def reference_pipeline(length: int = 200, buffer: int = 16, batch: int = 4) -> el.SavableDataset:
    """map -> shuffle buffer -> batch over a shuffled IndexedSource (the reference shape, small)."""
    source = el.IndexedSource.from_fn(length, MakeSample(), shuffle=True, seed=7)
    return el.BatchDataset(
        el.ShuffleBufferDataset(el.MapDataset(source, AddNoise()), size=buffer), batch_size=batch
    )


def indices(batch_or_sample: Any) -> list[int]:
    """The source indices in a sample or a batch."""
    value = batch_or_sample["index"]
    if isinstance(value, torch.Tensor):  # a batch collated by default_collate
        value = value.tolist()
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has exited; it only waits to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:  # reaped in between
        return False


ROOT = Path(__file__).resolve().parents[1]


def run_command(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m energy_loader ARGS`` from the repository root (the tests importable), with
    extra environment variables; two minutes at most."""
    return subprocess.run(
        [sys.executable, "-m", "energy_loader", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )


def run_commands(*commands: tuple[str, ...], **env: str) -> list[subprocess.CompletedProcess[str]]:
    """Each ``python -m energy_loader ARGS``'s exit code, stdout and stderr, as
    :func:`run_command` gives them, run in this process through the command line's ``main``
    (what ``-m`` calls) with ``env`` set meanwhile: a command costs no interpreter start (~2.5 s
    each on 2 cores, most of it importing torch). :func:`run_command` starts the real
    ``python -m energy_loader`` where the process is the point."""
    from energy_loader.__main__ import main

    results = []
    for command in commands:
        out, err = io.StringIO(), io.StringIO()
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(list(command))
                except SystemExit as exit:  # argparse's --help and usage errors
                    code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        results.append(
            subprocess.CompletedProcess(
                ["energy_loader", *command], code, out.getvalue(), err.getvalue()
            )
        )
    return results
