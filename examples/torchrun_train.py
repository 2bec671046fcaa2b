"""Train a tiny DDP model under torchrun, checkpointing the loader with the model; resume.

    torchrun --nproc-per-node 2 examples/torchrun_train.py --ckpt-dir /tmp/run
    torchrun --nproc-per-node 2 examples/torchrun_train.py --ckpt-dir /tmp/run   # resumes

Every ``--every`` steps a checkpoint is written and published atomically; a restart resumes
from the newest published one, and the data continues exactly where that checkpoint stood.
Two ways to store the loader (see docs/distributed.md):

* default, gather/scatter (small jobs): ``loader.save_state_global(0)`` gathers every rank's
  state to rank 0, which writes one file ``step_000020.pt`` with model, optimizer and the
  list of loader states (temporary file, fsync, ``os.replace``). On resume every rank reads it
  and ``restore_state_global`` hands each rank its entry.
* ``--per-rank-files`` (the scalable path): every rank writes its own loader state
  (``loader_rank_00001_of_00002.pt``) into the step directory next to the model file; the
  directory is published by renaming it from ``step_000020.tmp``. No rank ever holds another
  rank's state.

``--fail-at-step N`` stops every rank at step N (a simulated preemption);
``--sample-log DIR`` appends each rank's consumed sample ids per step, to check exactness.
CPU and gloo only; a few seconds per run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import energy_loader as el
from energy_loader import distributed as eld
from energy_loader.state import fsync_directory, write_atomically

STEP_NAME = re.compile(r"^step_(\d{6})(\.pt)?$")


def make_sample(index: int) -> dict[str, Any]:
    """Sample ``index``: 8 features and a target, a pure function of the index."""
    generator = torch.Generator().manual_seed(index)
    x = torch.randn(8, generator=generator)
    return {"id": index, "x": x, "y": x.sum(dim=0, keepdim=True)}


def build_loader(num_workers: int, seed: int) -> el.SavableDataLoader:
    """shuffled source -> shuffle buffer -> batch, endless, sharded over the DDP ranks."""
    source = el.IndexedSource.from_fn(4096, make_sample, shuffle=True, seed=seed)
    pipeline = el.RepeatDataset(
        el.BatchDataset(el.ShuffleBufferDataset(source, size=64), batch_size=16)
    )
    config = el.WorkerConfig.from_process_group(num_workers=num_workers, seed=seed)
    return el.SavableDataLoader(pipeline, worker_config=config)


def build_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> float:
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


# -- checkpoint files --------------------------------------------------------------------------


def _save_atomically(value: Any, path: Path) -> None:
    """Temporary file in the same directory, fsync, rename, fsync the directory."""
    write_atomically(path, lambda stream: torch.save(value, stream))


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest published checkpoint (``step_NNNNNN.pt`` file or ``step_NNNNNN`` dir)."""
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_NAME.match(p.name))]
    return max(found)[1] if found else None


def agree_on_newest(ckpt_dir: Path) -> Path | None:
    """Rank 0 picks the newest checkpoint and tells everyone (no race with deletions)."""
    choice = [str(newest_checkpoint(ckpt_dir) or "") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def prune(ckpt_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` published checkpoints (rank 0 only)."""
    found = sorted(
        (int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_NAME.match(p.name))
    )
    for _, path in found[:-keep]:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def save_gathered(ckpt_dir: Path, step: int, model: Any, optimizer: Any, loader: Any) -> None:
    """One file for the job: model, optimizer and every rank's loader state (on rank 0)."""
    states = loader.save_state_global(0)
    if dist.get_rank() == 0:
        checkpoint = {
            "step": step,
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "loader_states": states,
        }
        _save_atomically(checkpoint, ckpt_dir / f"step_{step:06d}.pt")


def save_per_rank(ckpt_dir: Path, step: int, model: Any, optimizer: Any, loader: Any) -> None:
    """A step directory: model file from rank 0, one loader file per rank; then publish."""
    staging = ckpt_dir / f"step_{step:06d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    dist.barrier()
    eld.save_state_rank_file(loader, staging)
    if dist.get_rank() == 0:
        model_state = {"step": step, "model": model.module.state_dict()}
        _save_atomically({**model_state, "optimizer": optimizer.state_dict()}, staging / "model.pt")
    dist.barrier()  # every rank's file is in
    if dist.get_rank() == 0:
        os.replace(staging, ckpt_dir / f"step_{step:06d}")
        fsync_directory(ckpt_dir)


def restore(path: Path, model: Any, optimizer: Any, loader: Any) -> int:
    """Load a checkpoint of either kind into model, optimizer and loader; returns its step."""
    model_file = path / "model.pt" if path.is_dir() else path
    checkpoint = torch.load(model_file, weights_only=True)
    model.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if path.is_dir():
        eld.restore_state_rank_file(loader, path)
    else:
        loader.restore_state_global(checkpoint["loader_states"])
    return checkpoint["step"]


# -- the loop --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="where checkpoints go")
    parser.add_argument("--steps", type=int, default=60, help="train until this step")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every k steps")
    parser.add_argument("--keep", type=int, default=2, help="published checkpoints to keep")
    parser.add_argument("--num-workers", type=int, default=2, help="loader workers per rank")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--per-rank-files", action="store_true", help="the scalable path")
    parser.add_argument("--fail-at-step", type=int, default=None, help="simulate a preemption")
    parser.add_argument("--sample-log", type=Path, default=None, help="log sample ids per step")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.keep < 1:
        parser.error("--steps, --every and --keep must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank = dist.get_rank()
    if rank == 0:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model, optimizer = build_model()
    loader = build_loader(args.num_workers, args.seed)
    step = 0
    newest = agree_on_newest(args.ckpt_dir)
    if newest is not None:
        step = restore(newest, model, optimizer, loader)
        print(f"[rank {rank}] resumed from {newest.name} at step {step}", flush=True)
    save = save_per_rank if args.per_rank_files else save_gathered
    log = None
    if args.sample_log is not None:
        args.sample_log.mkdir(parents=True, exist_ok=True)
        log = open(args.sample_log / f"rank{rank}.jsonl", "a")  # noqa: SIM115
    batches = iter(loader)
    while step < args.steps:
        if step == args.fail_at_step:
            print(f"[rank {rank}] simulated preemption at step {step}", flush=True)
            return 3
        batch = next(batches)
        loss = train_step(model, optimizer, batch)
        step += 1
        if log is not None:
            log.write(json.dumps({"step": step, "ids": batch["id"].tolist()}) + "\n")
            log.flush()
        if step % args.every == 0:
            save(args.ckpt_dir, step, model, optimizer, loader)
            if rank == 0:
                prune(args.ckpt_dir, args.keep)
                print(f"[rank 0] step {step}: loss {loss:.4f}, checkpoint written", flush=True)
    del model  # DDP goes before the group, or the rank may hang at exit (docs/tutorial-torchrun.md)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
