"""Elastic resume: train on 2 ranks x 2 workers, resume on 1 x 4 and on 4 x 1.

A job with ``num_partitions=8`` trains a small DDP model for ``--steps`` steps on 2 ranks with 2
loader workers each, writes a checkpoint (one loader state file per rank), and keeps going for
``--more`` steps to record what an uninterrupted job would have trained on. Then it resumes
from the checkpoint twice, on 1 rank with 4 workers and on 4 ranks with 1 worker, and checks
that the job's stream (step ``s`` of rank ``r`` is item ``s * world_size + r``) continues
exactly where it stood. Everything runs on this machine: gloo process groups on 127.0.0.1.

    python examples/elastic_resume.py [--steps 10] [--more 12] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import energy_loader as el
from energy_loader import distributed as eld

PARTITIONS = 8


def make_sample(index: int) -> dict[str, Any]:
    return {"index": index, "x": torch.randn(8, generator=torch.Generator().manual_seed(index))}


def augment(sample: dict[str, Any]) -> dict[str, Any]:
    # Draws from torch's global RNG: seeded per sample, so identical on every layout.
    return {**sample, "x": sample["x"] + 0.01 * torch.randn(8)}


def build_loader(num_workers: int) -> el.SavableDataLoader:
    source = el.IndexedSource.from_fn(4_000, make_sample, shuffle=True, seed=11)
    pipeline = source.map(augment).shuffle_buffer(64).batch(8)
    config = el.WorkerConfig.from_process_group(num_workers=num_workers, seed=5)
    return el.SavableDataLoader(pipeline, worker_config=config, num_partitions=PARTITIONS)


def batch_ids(batch: dict[str, Any]) -> list[int]:
    return [int(i) for i in batch["index"]]


def _rank(rank: int, world_size: int, port: int, role: str, workers: int, args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = None
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = build_loader(workers)
        workdir = Path(args.workdir)
        steps = args.steps + args.more if role == "original" else args.more
        if role != "original":
            eld.restore_state_rank_file(loader, workdir / "checkpoint")
        seen = []
        for step, batch in zip(range(steps), loader):
            loss = model(batch["x"]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append(batch_ids(batch))
            if role == "original" and step + 1 == args.steps:
                eld.save_state_rank_file(loader, workdir / "checkpoint")
        torch.save(seen, workdir / f"{role}-rank{rank}.pt")
    finally:
        model = None  # DDP goes before the group, or the rank may hang at exit (the tutorial)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(role: str, ranks: int, workers: int, args: Any) -> list[list[int]]:
    """Run the job on ``ranks`` x ``workers``; returns its stream, step by step, rank by rank."""
    mp.spawn(_rank, args=(ranks, _free_port(), role, workers, args), nprocs=ranks, join=True)
    streams = [
        torch.load(Path(args.workdir) / f"{role}-rank{r}.pt", weights_only=True)
        for r in range(ranks)
    ]
    return [stream[step] for step in range(len(streams[0])) for stream in streams]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps before the checkpoint")
    parser.add_argument("--more", type=int, default=12, help="steps after it")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: temp)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        args.workdir = args.workdir or temporary
        original = run("original", 2, 2, args)
        resumed_at = 2 * args.steps
        ok = True
        for role, ranks, workers in (("one-rank", 1, 4), ("four-ranks", 4, 1)):
            stream = run(role, ranks, workers, args)
            expected = original[resumed_at : resumed_at + len(stream)]
            same = stream[: len(expected)] == expected
            ok &= same
            print(
                f"resumed on {ranks} rank(s) x {workers} worker(s): {len(expected)} batches "
                f"{'match' if same else 'DIFFER from'} the 2 x 2 job's batches "
                f"{resumed_at}..{resumed_at + len(expected) - 1}"
            )
    print("VERDICT:", "IDENTICAL" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
