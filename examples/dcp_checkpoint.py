"""The torchrun example with torch.distributed.checkpoint: model + optimizer + loader in one save.

    torchrun --nproc-per-node 2 examples/dcp_checkpoint.py --ckpt-dir /tmp/run_dcp
    torchrun --nproc-per-node 2 examples/dcp_checkpoint.py --ckpt-dir /tmp/run_dcp  # resumes

The loader is a ``Stateful`` (``state_dict()``/``load_state_dict()``), so it goes straight into
the state dict that ``dcp.save``/``dcp.load`` take, next to the model and optimizer, under one
key on every rank: its state dict holds one leaf per logical partition under the key of the
partition's slot, which no two ranks share, so every rank writes its own part of the
checkpoint, nothing is gathered, and a fresh loader reads the leaves of the partitions it runs.
The save and load use ``energy_loader.dcp``'s planners and reader, which cost nothing here and
keep DCP's own work linear in the ranks at scale (docs/distributed.md, section 4): the
coordinator's save plan, one read of ``.metadata`` broadcast to the ranks, and a loader that
adopts the saved partition count. A checkpoint is written to ``step_NNNNNN.tmp`` and published
by renaming it once ``dcp.save`` has returned on every rank; a restart loads the newest
published one.

Same options as examples/torchrun_train.py (which this script reuses for the model, data and
loop pieces), except ``--per-rank-files``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchrun_train import (
    agree_on_newest,
    build_loader,
    build_model,
    parse_args,
    prune,
    train_step,
)

import energy_loader as el
from energy_loader.state import fsync_directory


class TrainingState:
    """Model and optimizer as one ``Stateful`` (DCP calls these on save and load)."""

    def __init__(self, model: Any, optimizer: Any, step: int = 0) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.step = state["step"]


def checkpoint_state(training: TrainingState, loader: Any) -> dict[str, Any]:
    """What goes into dcp.save/dcp.load: training state and the loader, one key each."""
    return {"training": training, "loader": loader}


def save(ckpt_dir: Path, training: TrainingState, loader: Any) -> None:
    staging = ckpt_dir / f"step_{training.step:06d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    dcp.save(
        checkpoint_state(training, loader),
        checkpoint_id=staging,
        planner=el.dcp.SavePlanner(enable_plan_caching=True),
    )
    dist.barrier()  # every rank's part is written
    if dist.get_rank() == 0:
        os.replace(staging, ckpt_dir / f"step_{training.step:06d}")
        fsync_directory(ckpt_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.per_rank_files:
        raise SystemExit("--per-rank-files does not apply: DCP already saves per rank")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model, optimizer = build_model()
    training = TrainingState(model, optimizer)
    loader = build_loader(args.num_workers, args.seed)
    newest = agree_on_newest(args.ckpt_dir)
    if newest is not None:
        dcp.load(
            checkpoint_state(training, loader),
            storage_reader=el.dcp.SharedMetadataReader(FileSystemReader(newest)),
            planner=el.dcp.LoadPlanner(),
        )
        print(f"[rank {rank}] resumed from {newest.name} at step {training.step}", flush=True)
    log = None
    if args.sample_log is not None:
        args.sample_log.mkdir(parents=True, exist_ok=True)
        log = open(args.sample_log / f"rank{rank}.jsonl", "a")  # noqa: SIM115
    batches = iter(loader)
    while training.step < args.steps:
        if training.step == args.fail_at_step:
            print(f"[rank {rank}] simulated preemption at step {training.step}", flush=True)
            return 3
        batch = next(batches)
        loss = train_step(model, optimizer, batch)
        training.step += 1
        if log is not None:
            log.write(json.dumps({"step": training.step, "ids": batch["id"].tolist()}) + "\n")
            log.flush()
        if training.step % args.every == 0:
            save(args.ckpt_dir, training, loader)
            if rank == 0:
                prune(args.ckpt_dir, args.keep)
                print(f"[rank 0] step {training.step}: loss {loss:.4f}, checkpoint written")
    del model, training  # DDP goes before the group, or the rank may hang at exit (the tutorial)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
