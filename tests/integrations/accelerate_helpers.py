"""A training loop under Hugging Face Accelerate for the tests, on one process or on several
(rank programs started by tests/distributed_helpers.launch)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import Dataset, DistributedSampler

import energy_loader as el
from energy_loader.integrations.accelerate import prepare_loader
from energy_loader.testing.strategies import AddNoise, MakeSample
from tests.integrations.conftest import stop_workers

EPOCHS = 2


def pipeline(length: int = 45) -> el.SavableDataset:
    """map (augmentation from the global RNGs) -> shuffle buffer -> batches of 4."""
    source = el.IndexedSource.from_fn(length, MakeSample(), shuffle=True, seed=11)
    return el.BatchDataset(el.ShuffleBufferDataset(el.MapDataset(source, AddNoise()), 6), 4)


class Progress:
    """The training loop's own counters, saved beside the loader (as a user would)."""

    def __init__(self) -> None:
        self.step, self.epoch = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch = state["step"], state["epoch"]


class NoisySamples(Dataset[dict[str, Any]]):
    """The pipeline's samples as a plain torch Dataset (``__getitem__`` draws the noise)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return AddNoise()(MakeSample()(index))


def dropin_loader(length: int, workers: int, **loader_kwargs: Any) -> el.SavableDataLoader:
    """A drop-in loader over :class:`NoisySamples`, batches of 4, sharded by a
    ``DistributedSampler`` when torch.distributed runs (a user's own DataLoader setup)."""
    dataset = NoisySamples(length)
    sampler = DistributedSampler(dataset, seed=11) if dist.is_initialized() else None
    return el.SavableDataLoader(
        dataset, batch_size=4, shuffle=sampler is None, sampler=sampler, num_workers=workers,
        **loader_kwargs,
    )  # fmt: skip


def train(
    workers: int,
    checkpoint: Path | None = None,
    *,
    save_at: int = -1,
    stop_at: int = -1,
    length: int = 45,
    dropin: bool = False,
    **loader_kwargs: Any,
) -> tuple[list[Any], torch.Tensor]:
    """Train a linear model; save at ``save_at``, stop after ``stop_at``, resume if told.
    ``dropin=True``: over :func:`dropin_loader` instead of the pipeline."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    if dropin:
        savable = dropin_loader(length, workers, **loader_kwargs)
    else:
        savable = el.SavableDataLoader(pipeline(length), num_workers=workers, **loader_kwargs)
    try:
        return _loop(accelerator, savable, checkpoint, save_at=save_at, stop_at=stop_at)
    finally:
        stop_workers(savable)


def _loop(
    accelerator: Accelerator, savable: el.SavableDataLoader, checkpoint: Path | None, *,
    save_at: int, stop_at: int,
) -> tuple[list[Any], torch.Tensor]:  # fmt: skip
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = prepare_loader(accelerator, savable)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if checkpoint is not None and save_at < 0:
        accelerator.load_state(str(checkpoint))
    seen: list[Any] = []
    set_epoch = getattr(savable.sampler, "set_epoch", None)  # a DistributedSampler's
    while progress.epoch < EPOCHS:
        if set_epoch is not None:
            set_epoch(progress.epoch)
        for batch in loader:
            assert batch["x"].device.type == accelerator.device.type
            loss = model(batch["noise"].float().unsqueeze(1)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen.append((progress.epoch, batch["index"].tolist(), batch.get(el.RESTORE_KEY)))
            seen[-1] += (batch["noise"].tolist(),)
            progress.step += 1
            if progress.step - 1 == save_at:
                accelerator.save_state(str(checkpoint))
            if progress.step - 1 == stop_at:
                return seen, _weight(model)
        progress.epoch += 1
    return seen, _weight(model)


def _weight(model: torch.nn.Module) -> torch.Tensor:
    return getattr(model, "module", model).weight.detach().clone()


# -- rank programs ---------------------------------------------------------------------------------


def train_on_ranks(
    rank: int,
    world_size: int,
    workdir: Path,
    *,
    workers: int,
    save_at: int,
    kill_at: int,
    dropin: bool = False,
) -> None:
    """An uninterrupted run, then a run that saves at ``save_at`` and is SIGKILLed after
    ``kill_at`` (every rank at the same step); each writes what this rank trained on."""
    options: dict[str, Any] = {"length": 48, "dropin": dropin, "multiprocessing_context": "fork"}
    seen, weight = train(workers, **options)
    torch.save({"seen": seen, "weight": weight}, workdir / f"full_rank{rank}.pt")
    seen, _ = train(workers, workdir / "checkpoint", save_at=save_at, stop_at=kill_at, **options)
    torch.save({"seen": seen}, workdir / f"head_rank{rank}.pt")
    os.kill(os.getpid(), signal.SIGKILL)


def resume_on_ranks(
    rank: int, world_size: int, workdir: Path, *, workers: int, dropin: bool = False
) -> None:
    """A fresh process per rank resumes from the checkpoint and trains to the end."""
    seen, weight = train(
        workers, workdir / "checkpoint", length=48, dropin=dropin, multiprocessing_context="fork"
    )
    torch.save({"seen": seen, "weight": weight}, workdir / f"tail_rank{rank}.pt")
