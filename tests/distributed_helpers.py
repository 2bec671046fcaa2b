"""Multi-process harness for tests/test_distributed.py.

:func:`launch` starts ``world_size`` real processes (from a fork server, below), joins them
into a gloo process group on 127.0.0.1 (a free port per launch) and runs one *rank program*
(a module-level function of this module, so spawned processes can import it) on each. A rank
program writes what it saw to files in the work directory; the test reads them. Every launch
is bounded: processes still running at the deadline are killed and the test fails with what
each rank reported.

Rank processes start with the forkserver method by default: a clean server process (never the
pytest process) that has imported torch once forks each rank, so a launch does not pay
torch's import (2-3 s per process, ~10 s for four ranks on two cores). Set
``ENERGY_LOADER_TEST_START_METHOD=spawn`` to spawn every rank from scratch instead. Loaders
inside the ranks use the fork start method for their own workers, for the same reason.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import energy_loader as el
from energy_loader import distributed as eld
from energy_loader.testing.resume import END, compare_events, record_events
from energy_loader.torch_internals import worker_processes
from tests.helpers import indices, reference_pipeline, resealed

# A collective that waits longer than this raises in the rank instead of hanging the test.
PG_TIMEOUT = datetime.timedelta(seconds=45)
_END_MARK = "<END>"
START_METHOD = os.environ.get("ENERGY_LOADER_TEST_START_METHOD", "forkserver")
# What the fork server imports once for every rank it forks: torch and (1 s more of CPU per
# rank) DCP, this package and this module, so a launch costs ~1 s, not 2-3 s per rank.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "energy_loader",
    "tests.distributed_helpers",
]
# Rank programs of other modules that import a heavy library, preloaded as well once this
# session imported them (their tests import them at first use, tests.helpers.LazyModule): each
# rank would otherwise import pytorch_lightning or transformers itself (~2 s of CPU a rank; a
# default run starts 11 Lightning ranks). Accelerate's and datasets' rank programs import in
# 0.1-0.4 s, less than restarting the server would cost (_fork_server_preloading).
RANK_PROGRAM_MODULES = [
    "tests.integrations.lightning_helpers",
    "tests.integrations.trainer_helpers",
]


# -- the launcher (runs in the test process) ---------------------------------------------------


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    program: Callable[..., None],
    world_size: int,
    workdir: Path,
    *,
    timeout: float,
    exitcode: int = 0,
    torchrun_env: bool = False,
    preemptible: bool = False,
    **kwargs: Any,
) -> list[int | None]:
    """Run ``program(rank, world_size, workdir, **kwargs)`` on ``world_size`` gloo ranks and
    return every rank's exit code.

    ``program`` is a module-level function of an importable module (this one, or a test
    helper module). ``exitcode`` is how every rank must end: 0, or e.g. ``-signal.SIGKILL``
    for a program that kills its own process (a preemption). ``preemptible=True``: as soon as
    a rank is SIGKILLed, the others are SIGKILLed too, wherever they are (what torchrun's agent
    does when a rank dies); the job then counts as ended well, whatever the others' exit codes.
    Raises ``AssertionError`` with every failing rank's traceback if a rank ends otherwise, or
    if the ranks are not done within ``timeout`` seconds (they are killed then).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        imported = [name for name in RANK_PROGRAM_MODULES if name in sys.modules]
        _fork_server_preloading(FORKSERVER_PRELOAD + imported)
    port = free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(program.__module__, program.__name__, rank, world_size, port, str(workdir)),
            kwargs={"torchrun_env": torchrun_env, "program_kwargs": kwargs},
            name=f"rank-{rank}",
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        running = list(processes)
        while running and time.monotonic() < deadline:
            multiprocessing.connection.wait(
                [p.sentinel for p in running], max(0.0, deadline - time.monotonic())
            )
            running = [p for p in running if p.is_alive()]
            if preemptible and any(p.exitcode == -signal.SIGKILL for p in processes):
                for process in running:
                    process.kill()
                break
        preempted = preemptible and any(p.exitcode == -signal.SIGKILL for p in processes)
        hung = [] if preempted else [p.name for p in processes if p.is_alive()]
        failed = [
            f"{p.name} (exit code {p.exitcode})"
            for p in processes
            if not p.is_alive() and p.exitcode != exitcode and not preempted
        ]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(10)
    if hung or failed:
        reports = "\n".join(_error_report(workdir, rank) for rank in range(world_size))
        raise AssertionError(f"ranks hung past {timeout} s: {hung}; failed: {failed}\n{reports}")
    return [p.exitcode for p in processes]


def _fork_server_preloading(modules: list[str]) -> None:
    """Have multiprocessing's fork server preload ``modules`` for the ranks it forks next.

    The server reads its preload list once, when it starts: at this session's first launch,
    or at the first loader test with forkserver workers (which preloads nothing). A server
    running without one of ``modules`` is stopped here, between launches (no process it forked
    is left then), and the next rank's start starts it again with all of them: one import of
    Lightning, say, instead of one in each of its ranks."""
    server = multiprocessing.forkserver._forkserver  # the server every forkserver context uses
    running = getattr(server, "_forkserver_pid", None) is not None
    if running and set(modules) <= set(getattr(server, "_preload_modules", ())):
        return
    if running and hasattr(server, "_stop"):
        server._stop()
    server.set_forkserver_preload(modules)


def _error_report(workdir: Path, rank: int) -> str:
    path = workdir / f"error_rank{rank}.txt"
    return f"--- rank {rank} ---\n{path.read_text()}" if path.exists() else ""


def _rank_main(
    module: str,
    name: str,
    rank: int,
    world_size: int,
    port: int,
    workdir: str,
    *,
    torchrun_env: bool,
    program_kwargs: dict[str, Any],
) -> None:
    """Entry point of a spawned rank: join the group, run the program, report errors."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if torchrun_env:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    try:
        program = getattr(importlib.import_module(module), name)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=PG_TIMEOUT,
        )
        program(rank, world_size, Path(workdir), **program_kwargs)
        if dist.is_initialized():  # unless the program ended the group itself
            dist.destroy_process_group()
    except BaseException:
        (Path(workdir) / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        # Exit without waiting for peers or loader workers (they notice and stop).
        os._exit(1)


# -- helpers for rank programs -----------------------------------------------------------------


def make_loader(
    num_workers: int,
    *,
    length: int = 64,
    config: el.WorkerConfig | None = None,
    num_partitions: int | None = None,
) -> el.SavableDataLoader:
    """A small reference pipeline (map -> shuffle buffer -> batch) on this rank."""
    config = config or el.WorkerConfig.from_process_group(num_workers=num_workers, seed=3)
    return el.SavableDataLoader(
        reference_pipeline(length=length, buffer=8, batch=4),
        worker_config=config,
        multiprocessing_context="fork",
        checkpoint_every_n_samples=2,
        num_partitions=num_partitions,
    )


def encode_events(events: list[Any]) -> list[Any]:
    return [_END_MARK if event is END else event for event in events]


def decode_events(events: list[Any]) -> list[Any]:
    return [END if event == _END_MARK else event for event in events]


def epoch_indices(events: list[Any]) -> list[list[int]]:
    """The source indices of each epoch's samples, in order."""
    epochs: list[list[int]] = [[]]
    for event in events:
        if event is END:
            epochs.append([])
        else:
            epochs[-1].extend(indices(event))
    return epochs[:-1] if not epochs[-1] else epochs


def save_json(path: Path, value: Any) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


def outcome(call: Callable[[], Any]) -> list[str]:
    """``["ok", ""]`` or ``[exception class name, message]``."""
    try:
        call()
    except Exception as error:
        return [type(error).__name__, str(error)]
    return ["ok", ""]


# -- rank programs -----------------------------------------------------------------------------


def record_and_save(
    rank: int, world_size: int, workdir: Path, *, num_workers: int, stop: int, epochs: int
) -> None:
    """Uninterrupted run; then a run stopped after ``stop`` events whose states are saved.

    Rank 0 writes the gathered list to ``states.json``; every rank also writes its own
    per-rank file into ``rank_files/``.
    """
    loader = make_loader(num_workers)
    full, _ = record_events(loader, epochs)
    del loader
    loader = make_loader(num_workers)
    head, ended = record_events(loader, epochs, stop=stop)
    states = loader.save_state_global(0)
    if rank == 0:
        if states is None or len(states) != world_size:
            raise AssertionError(f"rank 0 gathered {states!r}")
        save_json(workdir / "states.json", states)
    elif states is not None:
        raise AssertionError("a rank other than dst_rank received the gathered states")
    (workdir / "rank_files").mkdir(exist_ok=True)
    eld.save_state_rank_file(loader, workdir / "rank_files")
    torch.save(
        {"full": encode_events(full), "head": encode_events(head), "ended": ended},
        workdir / f"run_rank{rank}.pt",
    )


def restore_and_continue(
    rank: int, world_size: int, workdir: Path, *, num_workers: int, epochs: int
) -> None:
    """Fresh loaders restore in three ways; each continuation must equal the full run."""
    run = torch.load(workdir / f"run_rank{rank}.pt", weights_only=False)
    full, head = decode_events(run["full"]), decode_events(run["head"])
    restores = {
        "full_list": lambda loader: loader.restore_state_global(
            json.loads((workdir / "states.json").read_text())
        ),
        "scatter": lambda loader: loader.restore_state_global(
            json.loads((workdir / "states.json").read_text()) if rank == 0 else None, src_rank=0
        ),
        "rank_file": lambda loader: eld.restore_state_rank_file(loader, workdir / "rank_files"),
    }
    report = {}
    for name, restore in restores.items():
        loader = make_loader(num_workers)
        restore(loader)
        tail, _ = record_events(loader, epochs - run["ended"])
        del loader
        report[name] = compare_events(full, head + tail)
    save_json(workdir / f"continuations_rank{rank}.json", report)
    save_json(workdir / f"epochs_rank{rank}.json", epoch_indices(full))


def data_parallel_replicas(rank: int, world_size: int, workdir: Path, *, stop: int) -> None:
    """World 4 as a 2 x 2 (dp, tp) DeviceMesh: tp peers share samples, dp groups gather."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = el.WorkerConfig.from_process_group(
        num_workers=1, seed=3, data_parallel_group=mesh["dp"]
    )
    checks = {
        "config": [config.rank, config.world_size],
        "ranks": eld.data_parallel_ranks(config),
        "two_dim_mesh": outcome(
            lambda: el.WorkerConfig.from_process_group(data_parallel_group=mesh)
        ),
    }
    not_member = dist.new_group([0, 2])  # every rank must call new_group
    checks["not_member"] = outcome(
        lambda: el.WorkerConfig.from_process_group(data_parallel_group=not_member)
    )
    checks["wrong_rank"] = outcome(
        lambda: el.WorkerConfig(
            rank=1 - config.rank, world_size=2, data_parallel_group=mesh["dp"].get_group()
        )
    )
    full, _ = record_events(make_loader(1, config=config), 1)
    loader = make_loader(1, config=config)
    head, _ = record_events(loader, 1, stop=stop)
    dst = eld.data_parallel_ranks(config)[0]
    checks["dst_outside_group"] = outcome(lambda: loader.save_state_global(1 - dst))
    states = loader.save_state_global(dst)
    checks["gathered"] = None if states is None else [s["rank"] for s in states]
    fresh = make_loader(1, config=config)
    fresh.restore_state_global(states, src_rank=dst)
    tail, _ = record_events(fresh, 1)
    checks["continuation"] = compare_events(full, head + tail)
    save_json(workdir / f"replica_rank{rank}.json", checks)
    torch.save(
        [b["__restore_key__"] for b in full if b is not END], workdir / f"keys_rank{rank}.pt"
    )


def _other_layout_states() -> list[dict[str, Any]]:
    """The states of the same job saved with 2 workers per rank instead of 1 (on every rank)."""
    loader = make_loader(2)
    iterator = iter(loader)
    next(iterator)
    gathered = loader.save_state_global(0)
    box = [gathered]
    dist.broadcast_object_list(box, src=0)
    del iterator, loader
    return box[0]


def bad_inputs(rank: int, world_size: int, workdir: Path) -> None:
    """Every bad input raises on every rank, leaves the loader usable, and nobody hangs."""
    reference, _ = record_events(make_loader(1), 1)
    loader = make_loader(1)
    head, _ = record_events(loader, 1, stop=3)
    box = [loader.save_state_global(0)]
    dist.broadcast_object_list(box, src=0)
    good: list[dict[str, Any]] = box[0]
    other_layout = _other_layout_states()
    one_bad = copy.deepcopy(good)
    one_bad[1]["config"]["inner"]["size"] = 99
    one_bad[1] = resealed(one_bad[1])  # rank 1's state of another pipeline, not an edited one
    target = make_loader(1)
    # Given its own num_partitions, a loader refuses states saved with another count (one
    # given none adopts it: "adopted" below).
    pinned = make_loader(1, num_partitions=world_size)

    def scatter(states: Any, src: int = 0, loader: Any = target) -> None:
        loader.restore_state_global(states if rank == src else None, src_rank=src)

    cases: dict[str, Callable[[], Any]] = {
        "full_list_too_long": lambda: target.restore_state_global(good + good[:1]),
        "scatter_too_short": lambda: scatter(good[:1]),
        "full_list_other_layout": lambda: pinned.restore_state_global(other_layout),
        "scatter_other_layout": lambda: scatter(other_layout, loader=pinned),
        "other_layout_adopted": lambda: make_loader(1).restore_state_global(other_layout),
        "full_list_swapped": lambda: target.restore_state_global(good[::-1]),
        "full_list_one_rank_bad": lambda: target.restore_state_global(one_bad),
        "scatter_one_rank_bad": lambda: scatter(one_bad, src=1),
        "scatter_not_a_list": lambda: scatter({"a": 1}),
        "src_outside_group": lambda: scatter(good, src=world_size),
        "dst_outside_group": lambda: loader.save_state_global(world_size + 3),
        "dst_negative": lambda: loader.save_state_global(-1),
        "dst_not_int": lambda: loader.save_state_global("0"),
    }
    report = {name: outcome(call) for name, call in cases.items()}
    # After all that, a good restore of the untouched loader still continues exactly.
    target.restore_state_global(good)
    tail, _ = record_events(target, 1)
    report["good_after_bad"] = [str(compare_events(reference, head + tail)), ""]
    report["dead_worker"] = outcome(lambda: _save_with_dead_worker(rank))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
    save_json(workdir / f"bad_rank{rank}.json", report)


def _save_with_dead_worker(rank: int) -> Any:
    """save_state_global while rank 1's worker is dead: no hang; the save needs no worker."""
    loader = make_loader(1)
    iterator = iter(loader)
    next(iterator)
    if rank == 1:
        worker = worker_processes(loader)[0]
        try:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
        except RuntimeError:
            pass  # torch's SIGCHLD handler reports the death here, asynchronously
    return loader.save_state_global(0)


def dcp_round_trip(rank: int, world_size: int, workdir: Path, *, steps: int, more: int) -> None:
    """DCP save of a DDP model + optimizer + loader (one key), load into fresh ones."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, el.SavableDataLoader]:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, optimizer, make_loader(2)

    def train(
        model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]
    ) -> None:
        loss = model(batch["x"].float() / 64).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    torch.manual_seed(0)
    model, optimizer, loader = build()
    iterator = iter(loader)
    for _ in range(steps):
        train(model, optimizer, next(iterator))
    model_state, optim_state = get_state_dict(model, optimizer)
    key = "loader"
    dcp.save(
        {"model": model_state, "optim": optim_state, key: loader}, checkpoint_id=workdir / "dcp"
    )
    expected = []
    for _ in range(more):
        batch = next(iterator)
        expected.append(batch)
        train(model, optimizer, batch)
    del iterator, loader

    torch.manual_seed(1 + rank)  # a different init: the checkpoint must overwrite it
    model2, optimizer2, loader2 = build()
    model_state, optim_state = get_state_dict(model2, optimizer2)
    state = {"model": model_state, "optim": optim_state, key: loader2}
    dcp.load(state, checkpoint_id=workdir / "dcp")
    set_state_dict(
        model2, optimizer2, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    iterator2 = iter(loader2)
    got = []
    for _ in range(more):
        batch = next(iterator2)
        got.append(batch)
        train(model2, optimizer2, batch)
    same_params = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    save_json(
        workdir / f"dcp_rank{rank}.json",
        {"key": key, "continuation": compare_events(expected, got), "same_params": same_params},
    )


def tutorial_teardown(rank: int, world_size: int, workdir: Path, *, steps: int, every: int) -> None:
    """docs/tutorial-torchrun.md's job, ended as the page ends it; the rank must then exit.

    A DDP model with dropout trains on a pipeline loader (2 workers, 12 partitions), saved
    with DCP (the package's planner) every ``every`` steps. ``train`` hands back the bare
    module, so no DDP wrapper outlives it: torch's gloo group can hang the exit of a rank
    whose DDP model is still alive when ``destroy_process_group()`` runs (the tutorial's
    "Ending the job"). The loader, its workers running, is alive at ``destroy_process_group()``
    (called here, so the launcher skips its own) and until the rank returns; its workers'
    pids go to ``workers_rank{rank}.json``, to check that none outlives the rank.
    """
    import torch.distributed.checkpoint as dcp

    loader = make_loader(2, num_partitions=12)

    def train() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(2, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1)
        )
        model = torch.nn.parallel.DistributedDataParallel(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"model": model, "optimizer": optimizer, "loader": loader}
        batches = iter(loader)
        for step in range(1, steps + 1):
            loss = model(next(batches)["x"].float() / 64).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % every == 0:
                dcp.save(state, checkpoint_id=workdir / "ckpt", planner=el.dcp.SavePlanner())
        return model.module

    train()
    pids = [worker.pid for worker in worker_processes(loader)]
    if len(pids) != 2:
        raise AssertionError(f"the loader's workers should still run; found {pids}")
    save_json(workdir / f"workers_rank{rank}.json", pids)
    dist.destroy_process_group()


# -- elastic resume: save on one layout, restore on another ----------------------------------------

ELASTIC_PARTITIONS = 6


def elastic_loader(num_workers: int) -> el.SavableDataLoader:
    """A pipeline with a shuffle buffer, split into 6 logical partitions."""
    config = el.WorkerConfig.from_process_group(num_workers=num_workers, seed=3)
    return el.SavableDataLoader(
        reference_pipeline(length=600, buffer=8, batch=4),
        worker_config=config,
        multiprocessing_context="fork",
        checkpoint_every_n_samples=2,
        num_partitions=ELASTIC_PARTITIONS,
    )


def elastic_save(rank: int, world_size: int, workdir: Path, *, steps: int, more: int) -> None:
    """Run ``steps`` steps, save per-rank files and a DCP checkpoint, then ``more`` steps."""
    import torch.distributed.checkpoint as dcp

    loader = elastic_loader(num_workers=1)
    iterator = iter(loader)
    stream = [next(iterator) for _ in range(steps)]
    eld.save_state_rank_file(loader, workdir / "files")
    dcp.save({"loader": loader}, checkpoint_id=workdir / "dcp")
    stream += [next(iterator) for _ in range(more)]
    torch.save([b["__restore_key__"] for b in stream], workdir / f"elastic_saved{rank}.pt")


def elastic_restore(rank: int, world_size: int, workdir: Path, *, steps: int, via: str) -> None:
    """Restore onto this layout from the files or the DCP checkpoint; record ``steps`` steps."""
    import torch.distributed.checkpoint as dcp

    loader = elastic_loader(num_workers=2)
    if via == "files":
        eld.restore_state_rank_file(loader, workdir / "files")
    else:
        state = {"loader": loader}
        dcp.load(state, checkpoint_id=workdir / "dcp")
    iterator = iter(loader)
    stream = [next(iterator)["__restore_key__"] for _ in range(steps)]
    torch.save(stream, workdir / f"elastic_{via}{rank}.pt")


# -- the drop-in loader: a torch Dataset under a DistributedSampler ------------------------------

DROPIN_LENGTH = 40  # 20 samples a rank and epoch on 2 ranks: 7 batches of 3 (the last of 2)
DROPIN_EPOCHS = 2
DROPIN_WAYS = ("full_list", "scatter", "rank_file", "dcp")


def dropin_loader(
    num_workers: int, *, batch_size: int = 3, length: int = DROPIN_LENGTH
) -> el.SavableDataLoader:
    """A drop-in loader over a map-style dataset whose ``__getitem__`` draws from the global
    RNGs (an augmentation), sharded by a ``DistributedSampler`` of this process group."""
    from torch.utils.data import DistributedSampler

    from tests.loader.dropin_helpers import Augmenting

    dataset = Augmenting(length)
    return el.SavableDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=DistributedSampler(dataset, shuffle=True, seed=5),
        num_workers=num_workers,
        multiprocessing_context="fork" if num_workers else None,
    )


def dropin_batches(loader: el.SavableDataLoader, *, stop: int | None = None) -> list[Any]:
    """(epoch, the batch as lists) until epoch DROPIN_EPOCHS or ``stop`` batches, calling
    ``sampler.set_epoch(epoch)`` before each epoch as torch asks; a restored loader continues
    its saved epoch (``loader.epoch``)."""
    seen: list[Any] = []
    for epoch in range(loader.epoch, DROPIN_EPOCHS):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            seen.append((epoch, {name: value.tolist() for name, value in batch.items()}))
            if len(seen) == stop:
                return seen
    return seen


def dropin_save(
    rank: int,
    world_size: int,
    workdir: Path,
    *,
    num_workers: int,
    stop: int,
    length: int = DROPIN_LENGTH,
) -> None:
    """An uninterrupted run; then a run stopped after ``stop`` batches that saves its state
    every way: gathered (rank 0 writes ``dropin_states.json``), per-rank files, DCP. Both
    runs start from the same global RNG state, as one script run twice does (the job's seed
    comes from it, as torch's base seeds do)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    loader = dropin_loader(num_workers, length=length)
    full = dropin_batches(loader)
    loader.close()
    torch.manual_seed(0)
    loader = dropin_loader(num_workers, length=length)
    head = dropin_batches(loader, stop=stop)
    states = loader.save_state_global(0)
    if rank == 0:
        save_json(workdir / "dropin_states.json", states)
    eld.save_state_rank_file(loader, workdir / "dropin_files")
    dcp.save({"loader": loader}, checkpoint_id=workdir / "dropin_dcp")
    loader.close()
    torch.save({"full": full, "head": head}, workdir / f"dropin_run_rank{rank}.pt")


def dropin_restore(
    rank: int,
    world_size: int,
    workdir: Path,
    *,
    num_workers: int,
    length: int = DROPIN_LENGTH,
    batch_size: int = 3,
) -> None:
    """Fresh loaders restore in every way and finish the run (``dropin_tails_rank<r>.pt``);
    ``world_size`` and ``batch_size`` may differ from the saving job's (a resized job).
    Also runs a fresh job of this layout from the saving job's seed, under ``"fresh"``: the
    epochs after the restored one must be its."""
    import torch.distributed.checkpoint as dcp

    def gathered() -> Any:
        return json.loads((workdir / "dropin_states.json").read_text())

    restores: dict[str, Callable[[el.SavableDataLoader], None]] = {
        "full_list": lambda loader: loader.restore_state_global(gathered()),
        "scatter": lambda loader: loader.restore_state_global(
            gathered() if rank == 0 else None, src_rank=0
        ),
        "rank_file": lambda loader: eld.restore_state_rank_file(loader, workdir / "dropin_files"),
        "dcp": lambda loader: dcp.load({"loader": loader}, checkpoint_id=workdir / "dropin_dcp"),
    }
    tails = {}
    for way in DROPIN_WAYS:
        torch.manual_seed(1)  # whatever the new process's RNG is, the restore must not care
        loader = dropin_loader(num_workers, batch_size=batch_size, length=length)
        restores[way](loader)
        tails[way] = dropin_batches(loader)
        loader.close()
    torch.manual_seed(0)  # the saving job's seed
    loader = dropin_loader(num_workers, batch_size=batch_size, length=length)
    tails["fresh"] = dropin_batches(loader)
    loader.close()
    torch.save(tails, workdir / f"dropin_tails_rank{rank}.pt")


# -- one job seed per job, whatever each rank's seeding (docs/distributed.md) -------------------

SEEDINGS = ("per_rank", "none")
SEEDED_WAYS = ("full_list", "rank_file", "dcp")


def _seed_as(seeding: str, rank: int) -> None:
    """Seed this rank's global RNGs as a script does: ``per_rank`` (``1000 + rank``, a common
    habit) or ``none`` (nothing of its own: each rank's generator from the OS)."""
    import random

    import numpy as np

    if seeding == "per_rank":
        torch.manual_seed(1000 + rank)
        random.seed(1000 + rank)
        np.random.seed(1000 + rank)
    else:
        torch.seed()


def _plain(batch: dict[str, Any]) -> dict[str, Any]:
    return {name: value.tolist() for name, value in batch.items()}


def dropin_seeded_save(
    rank: int, world_size: int, workdir: Path, *, stop: int, length: int
) -> None:
    """Per seeding (SEEDINGS), one uninterrupted job through DROPIN_EPOCHS that saves every way
    after ``stop`` batches without stopping (gathered ``states.json``, per-rank ``files``,
    ``dcp``) into ``workdir/<seeding>``, its batches in ``run_rank<r>.pt`` there. Then a second
    run of the per-rank-seeded job (the same script started again) saves its files at the
    same step into ``per_rank_again/files``: a rank file of another run of the same job."""
    import torch.distributed.checkpoint as dcp

    for seeding in (*SEEDINGS, "per_rank_again"):
        folder = workdir / seeding
        folder.mkdir(exist_ok=True)
        _seed_as(seeding.removesuffix("_again"), rank)
        loader = dropin_loader(0, length=length)
        seen: list[Any] = []
        for epoch in range(DROPIN_EPOCHS):
            loader.sampler.set_epoch(epoch)
            for batch in loader:
                seen.append((epoch, _plain(batch)))
                if len(seen) != stop:
                    continue
                eld.save_state_rank_file(loader, folder / "files")
                if seeding.endswith("_again"):
                    continue
                states = loader.save_state_global(0)
                if rank == 0:
                    save_json(folder / "states.json", states)
                dcp.save({"loader": loader}, checkpoint_id=folder / "dcp")
        loader.close()
        torch.save(seen, folder / f"run_rank{rank}.pt")
    # Each rank restores its own state, but rank 1 from the second run: refused at iter().
    from energy_loader.state.rank_file import read_rank_file

    run = "per_rank" if rank == 0 else "per_rank_again"
    loader = dropin_loader(0, length=length)
    loader.restore_state_rank(
        read_rank_file(workdir / run / "files" / f"loader_rank_0000{rank}_of_00002.pt")
    )
    save_json(workdir / f"mixed_iter_rank{rank}.json", outcome(lambda: iter(loader)))


def dropin_seeded_restore(rank: int, world_size: int, workdir: Path, *, length: int) -> None:
    """Fresh processes (seeded otherwise) restore each seeding's save every way and finish
    the job: ``workdir/<seeding>/tails_<world_size>_rank<r>.pt``."""
    import torch.distributed.checkpoint as dcp

    for seeding in SEEDINGS:
        folder = workdir / seeding
        tails = {}
        for way in SEEDED_WAYS:
            torch.manual_seed(77 + rank)
            loader = dropin_loader(0, length=length)
            if way == "full_list":
                loader.restore_state_global(json.loads((folder / "states.json").read_text()))
            elif way == "rank_file":
                eld.restore_state_rank_file(loader, folder / "files")
            else:
                dcp.load({"loader": loader}, checkpoint_id=folder / "dcp")
            tails[way] = dropin_batches(loader)
            loader.close()
        torch.save(tails, folder / f"tails_{world_size}_rank{rank}.pt")


# -- reads per rank at many ranks (tests/test_distributed.py, benchmarks/bench_ranks.py) ---------


def scale_loader(partitions: int, length: int) -> el.SavableDataLoader:
    """A tiny reference-like pipeline, no workers (many ranks share two cores), ``partitions``
    logical partitions."""
    config = el.WorkerConfig.from_process_group(num_workers=0, seed=3)
    return el.SavableDataLoader(
        reference_pipeline(length=length, buffer=8, batch=4),
        worker_config=config,
        num_partitions=partitions,
    )


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def scale_save(
    rank: int,
    world_size: int,
    workdir: Path,
    *,
    partitions: int,
    length: int,
    steps: int,
    more: int,
) -> None:
    """Take ``steps`` batches, save through per-rank files, the gather and DCP (counting the
    bytes each writes), then record the next ``more`` batches' keys (the stream to continue)."""
    import torch.distributed.checkpoint as dcp

    from energy_loader.testing.storage import CountingWriter

    loader = scale_loader(partitions, length)
    iterator = iter(loader)
    for _ in range(steps):
        next(iterator)
    report: dict[str, Any] = {}
    dist.barrier()
    began = time.perf_counter()
    path = eld.save_state_rank_file(loader, workdir / "files")
    report["files"] = {"seconds": time.perf_counter() - began, "written": path.stat().st_size}
    dist.barrier()
    began = time.perf_counter()
    states = loader.save_state_global(0)
    written = 0
    if states is not None:
        torch.save(states, workdir / "gathered.pt")
        written = (workdir / "gathered.pt").stat().st_size
    report["gather"] = {"seconds": time.perf_counter() - began, "written": written}
    dist.barrier()
    writer = CountingWriter(workdir / "dcp")
    began = time.perf_counter()
    dcp.save({"loader": loader}, storage_writer=writer)
    report["dcp"] = {
        "seconds": time.perf_counter() - began,
        "written": writer.bytes_written,
        "metadata": writer.metadata_bytes,  # the coordinator's .metadata file, 0 elsewhere
    }
    report["rss"] = peak_rss_bytes()
    save_json(workdir / f"scale_save_rank{rank}.json", report)
    keys = [next(iterator)["__restore_key__"] for _ in range(more)]
    torch.save(keys, workdir / f"scale_saved{rank}.pt")


def scale_restore(
    rank: int,
    world_size: int,
    workdir: Path,
    *,
    partitions: int,
    length: int,
    steps: int,
    ways: tuple[str, ...],
) -> None:
    """Restore a fresh loader through each of ``ways`` (files, full_list, scatter, dcp,
    dcp_shared), counting this rank's bytes read from storage, and record the next ``steps``
    batches' keys."""
    import torch.distributed.checkpoint as dcp

    from energy_loader.dcp import LoadPlanner, SharedMetadataReader
    from energy_loader.state.rank_file import ReadTally
    from energy_loader.testing.storage import CountingReader

    report: dict[str, Any] = {}
    for way in ways:
        loader = scale_loader(partitions, length)
        dist.barrier()
        began = time.perf_counter()
        extra: dict[str, int] = {}  # files read, or DCP's .metadata bytes
        if way == "files":
            tally = ReadTally()
            eld.restore_state_rank_file(loader, workdir / "files", tally=tally)
            seconds = time.perf_counter() - began
            read = tally.bytes
            extra = {"files": tally.files}
        elif way in ("dcp", "dcp_shared"):
            # dcp_shared: the .metadata read once, by rank 0, and broadcast to the others.
            reader = CountingReader(workdir / "dcp")
            if way == "dcp":
                dcp.load({"loader": loader}, storage_reader=reader)
            else:
                shared = SharedMetadataReader(reader)
                dcp.load({"loader": loader}, storage_reader=shared, planner=LoadPlanner())
            seconds = time.perf_counter() - began
            read = reader.bytes_read
            extra = {"metadata": reader.metadata_bytes}
        else:
            source = way == "full_list" or rank == 0
            states = torch.load(workdir / "gathered.pt", weights_only=True) if source else None
            read = (workdir / "gathered.pt").stat().st_size if source else 0
            loader.restore_state_global(states, src_rank=None if way == "full_list" else 0)
            seconds = time.perf_counter() - began
        iterator = iter(loader)
        keys = [next(iterator)["__restore_key__"] for _ in range(steps)]
        torch.save(keys, workdir / f"scale_{way}{rank}.pt")
        report[way] = {"seconds": seconds, "read": read, **extra}
        loader.close()
    report["rss"] = peak_rss_bytes()
    save_json(workdir / f"scale_restore_rank{rank}.json", report)


# -- a drop-in job SIGKILLed again and again, restarted on another number of ranks ------------

PREEMPTED_LENGTH = 13  # padded on 2 and 3 ranks
PREEMPTED_BATCH = 2
PREEMPTED_EPOCHS = 16
# Where in a step the chosen rank kills itself: after logging the step (its save is lost),
# after its own save (the step is not committed: a rank may not have saved), or after the
# commit (the step counts).
KILL_PHASES = ("logged", "saved", "committed")


def preemptible_dropin_job(
    rank: int,
    world_size: int,
    workdir: Path,
    *,
    job: int,
    via: str,
    kill_step: int | None,
    kill_phase: str,
    kill_rank: int,
) -> None:
    """Rank program: a training job that saves its loader every step and may be SIGKILLed.

    Restores from the last committed checkpoint (``commit.json``: its global step, its folder
    and how it was saved), then trains until epoch PREEMPTED_EPOCHS. Each step: an all-reduce
    (DDP's gradient sync: the ranks go in lockstep), the step's indices appended to this rank's
    log with fsync, the loader saved through per-rank files or DCP (``via``) into the step's
    own folder, a barrier, rank 0 commits the step (an atomic rename), another barrier. Rank
    ``kill_rank`` SIGKILLs itself at step ``kill_step`` after ``kill_phase`` (KILL_PHASES); the
    launcher kills the others. What was logged after the committed step is trained again.
    """
    import torch.distributed.checkpoint as dcp

    commit_path = workdir / "commit.json"
    loader = dropin_loader(0, batch_size=PREEMPTED_BATCH, length=PREEMPTED_LENGTH)
    step = 0
    if commit_path.exists():
        commit = json.loads(commit_path.read_text())
        step, folder = commit["step"], workdir / commit["folder"]
        if commit["via"] == "files":
            eld.restore_state_rank_file(loader, folder)
        else:
            dcp.load({"loader": loader}, checkpoint_id=folder)

    def phase_done(phase: str) -> None:
        if step == kill_step and rank == kill_rank and phase == kill_phase:
            os.kill(os.getpid(), signal.SIGKILL)

    with open(workdir / f"log_job{job:03d}_rank{rank}.jsonl", "a") as log:
        while loader.epoch < PREEMPTED_EPOCHS:
            epoch = loader.epoch
            loader.sampler.set_epoch(epoch)
            for batch in loader:
                step += 1
                dist.all_reduce(torch.ones(1))
                line = {"step": step, "epoch": epoch, "indices": batch["index"].tolist()}
                log.write(json.dumps(line) + "\n")
                log.flush()
                os.fsync(log.fileno())
                phase_done("logged")
                folder = f"step_{step:05d}"
                if via == "files":
                    eld.save_state_rank_file(loader, workdir / folder)
                else:
                    dcp.save({"loader": loader}, checkpoint_id=workdir / folder)
                phase_done("saved")
                dist.barrier()
                if rank == 0:
                    save_json(commit_path, {"step": step, "folder": folder, "via": via})
                dist.barrier()
                phase_done("committed")
    loader.close()
