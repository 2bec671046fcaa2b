"""Pipelines, a tiny model and run helpers for the Lightning tests."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset, DistributedSampler

import energy_loader as el
from energy_loader.integrations.lightning import SavableLoaderCallback
from energy_loader.loader.dropin.build import runs_dropin

SAMPLES = 24
BATCH = 2


def quiet_trainer(**options: Any) -> Any:
    """A CPU ``pl.Trainer`` without progress bar, model summary, logger or sanity steps,
    deterministic; ``options`` add to or override these."""
    return pl.Trainer(
        **{
            "accelerator": "cpu",
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": False,
            "num_sanity_val_steps": 0,
            "deterministic": True,
            **options,
        }
    )


def make_sample(index: int) -> dict[str, Any]:
    return {"index": index, "x": torch.tensor([float(index) / SAMPLES])}


def not_multiple_of_five(sample: dict[str, Any]) -> bool:
    return sample["index"] % 5 != 0


def build_endless_loader(num_workers: int) -> el.SavableDataLoader:
    """Batches of a source repeated forever: no ``len()``, for ``max_steps`` training."""
    source = el.IndexedSource.from_fn(SAMPLES, make_sample, shuffle=True, seed=3)
    pipeline = el.BatchDataset(el.RepeatDataset(source), batch_size=BATCH)
    return el.SavableDataLoader(pipeline, num_workers=num_workers)


def build_loader(
    *,
    sized: bool,
    num_workers: int,
    loader_class: type[el.SavableDataLoader] = el.SavableDataLoader,
) -> el.SavableDataLoader:
    """12 batches per epoch when sized; a filter (so no ``len()``, 10 batches) when not."""
    source: el.SavableDataset = el.IndexedSource.from_fn(SAMPLES, make_sample, shuffle=True, seed=3)
    if not sized:
        source = el.FilterDataset(source, not_multiple_of_five)
    return loader_class(el.BatchDataset(source, batch_size=BATCH), num_workers=num_workers)


class TinyModel(pl.LightningModule):
    """One weight trained by SGD with momentum: its final value depends on the batch order."""

    def __init__(self, read_estimated_steps: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1)
        self.read_estimated_steps = read_estimated_steps
        self.seen: list[tuple[int, list[int]]] = []
        self.estimated_steps: float | None = None

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, [int(i) for i in batch["index"]]))
        prediction = self.layer(batch["x"])
        return ((prediction - 3 * batch["x"] + 1) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.read_estimated_steps:
            # What a OneCycleLR schedule would do: Lightning's open bug, see the docs.
            self.estimated_steps = self.trainer.estimated_stepping_batches
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def run(
    loader: el.SavableDataLoader,
    *,
    max_epochs: int | None = 2,
    max_steps: int = -1,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int | None = None,
    ckpt_path: str | None = None,
    callback: SavableLoaderCallback | None = None,
    use_callback: bool = True,
    read_estimated_steps: bool = False,
) -> TinyModel:
    """Fit a fresh TinyModel on CPU and return it (its ``seen`` batches and weights)."""
    callbacks: list[pl.Callback] = []
    if use_callback:
        callbacks.append(callback or SavableLoaderCallback())
    if checkpoint_every is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=checkpoint_dir, every_n_train_steps=checkpoint_every, save_top_k=-1
            )
        )
    model = TinyModel(read_estimated_steps=read_estimated_steps)
    trainer = quiet_trainer(
        devices=1,
        max_epochs=max_epochs,
        max_steps=max_steps,
        callbacks=callbacks,
        enable_checkpointing=checkpoint_every is not None,
    )
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    model.global_step_at_end = trainer.global_step  # type: ignore[assignment]
    return model


def weights(model: TinyModel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- several ranks: Trainer(strategy="ddp") in processes started by tests/distributed_helpers -----

DDP_SAMPLES = 48  # 24 batches an epoch: 12 on each of 2 ranks


def jitter(sample: dict[str, Any]) -> dict[str, Any]:
    """An augmentation that draws from torch's global RNG (seeded per sample by the loader)."""
    return {**sample, "x": sample["x"] + 0.01 * torch.rand(1)}


def finite(sample: dict[str, Any]) -> bool:
    """Drops broken samples (none here): the filter leaves the loader without ``len()``, so
    Lightning fetches one batch ahead and holds it when it saves."""
    return bool(torch.isfinite(sample["x"]).all())


def build_ddp_loader(num_workers: int) -> el.SavableDataLoader:
    """Augmented, filtered batches of this rank: 12 a rank and epoch, no ``len()``."""
    source = el.IndexedSource.from_fn(DDP_SAMPLES, make_sample, shuffle=True, seed=3)
    pipeline = el.FilterDataset(el.MapDataset(source, jitter), finite)
    return el.SavableDataLoader(
        el.BatchDataset(pipeline, batch_size=BATCH),
        num_workers=num_workers,
        multiprocessing_context="fork",
    )


class RecordingModel(TinyModel):
    """Also records each batch's augmented inputs."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.seen[-1] = (*self.seen[-1], batch["x"].flatten().tolist())
        return loss


class Preemption(pl.Callback):
    """Writes what the model trained on so far, then SIGKILLs this process after ``step``."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            torch.save({"seen": pl_module.seen}, self.path)
            os.kill(os.getpid(), signal.SIGKILL)


def fit_two_epochs(
    loader: el.SavableDataLoader,
    workdir: Path,
    *,
    devices: int,
    save_at: int | None = None,
    kill: Preemption | None = None,
    max_steps: int = -1,
    resume: bool = False,
    callback: bool = True,
    checkpoints: str = "ckpt",
    strategy: str | None = None,
) -> RecordingModel:
    """Two epochs (or ``max_steps``) of DDP on ``devices`` ranks, with ``SavableLoaderCallback``
    unless ``callback=False``, checkpoints in ``workdir/<checkpoints>``. ``strategy`` defaults
    to ``"ddp"`` on several devices, ``"auto"`` on one (``"ddp"`` there gives a drop-in loader
    a 1-rank DistributedSampler)."""
    callbacks: list[pl.Callback] = [SavableLoaderCallback()] if callback else []
    if save_at is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=workdir / checkpoints, every_n_train_steps=save_at)
        )
    if kill is not None:
        callbacks.append(kill)
    checkpoint = str(next((workdir / checkpoints).glob("*.ckpt"))) if resume else None
    model = RecordingModel()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy or ("ddp" if devices > 1 else "auto"),
        max_epochs=2,
        max_steps=max_steps,
        callbacks=callbacks,
        enable_checkpointing=save_at is not None,
    )
    try:
        trainer.fit(model, train_dataloaders=loader, ckpt_path=checkpoint)
        trained_on = trainer.train_dataloader
        if not runs_dropin(loader):
            # Lightning left the self-sharding loader alone (use_distributed_sampler is on).
            assert trained_on is loader
        elif devices > 1:  # a drop-in loader: rebuilt with a DistributedSampler
            assert runs_dropin(trained_on), trained_on
            assert isinstance(trained_on.sampler, DistributedSampler)
    finally:
        loader.close()
        if isinstance(trainer.train_dataloader, el.SavableDataLoader):
            trainer.train_dataloader.close()
    return model


def train_then_preempt(
    rank: int, world_size: int, workdir: Path, *, num_workers: int, save_at: int, kill_at: int
) -> None:
    """Rank program: an uninterrupted fit (``full_rank<r>.pt``), then a fit that checkpoints
    after step ``save_at`` and is SIGKILLed after step ``kill_at`` (``head_rank<r>.pt``)."""
    full = fit_two_epochs(build_ddp_loader(num_workers), workdir, devices=world_size)
    torch.save({"seen": full.seen, "weights": weights(full)}, workdir / f"full_rank{rank}.pt")
    kill = Preemption(kill_at, workdir / f"head_rank{rank}.pt")
    loader = build_ddp_loader(num_workers)
    fit_two_epochs(loader, workdir, devices=world_size, save_at=save_at, kill=kill)


def resume_after_preemption(rank: int, world_size: int, workdir: Path, *, num_workers: int) -> None:
    """Rank program: a fresh process resumes with ``fit(ckpt_path=...)`` (``tail_rank<r>.pt``)."""
    model = fit_two_epochs(build_ddp_loader(num_workers), workdir, devices=world_size, resume=True)
    torch.save({"seen": model.seen, "weights": weights(model)}, workdir / f"tail_rank{rank}.pt")


# -- a drop-in loader (a plain torch Dataset) under DDP: Lightning gives it a DistributedSampler --

DROPIN_SAVE_AT, DROPIN_STOP_AT = 5, 7  # checkpoint after step 5 of epoch 0, stop after step 7


class JitteredSamples(Dataset[dict[str, Any]]):
    """DDP_SAMPLES samples whose ``__getitem__`` draws from torch's global RNG (``jitter``)."""

    def __len__(self) -> int:
        return DDP_SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        return jitter(make_sample(index))


def build_ddp_dropin_loader(num_workers: int) -> el.SavableDataLoader:
    """A shuffled drop-in loader: 12 batches a rank and epoch under Lightning's sampler."""
    return el.SavableDataLoader(
        JitteredSamples(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=num_workers,
        multiprocessing_context="fork" if num_workers else None,
    )


def dropin_train_then_stop(rank: int, world_size: int, workdir: Path, *, num_workers: int) -> None:
    """Rank program: an uninterrupted fit (``dropin_full_rank<r>.pt``), then, with and without
    the callback, a fit checkpointed after step DROPIN_SAVE_AT that stops after DROPIN_STOP_AT
    (``dropin_head_<callback>_rank<r>.pt``, checkpoints in ``ckpt_<callback>``)."""
    full = fit_two_epochs(build_ddp_dropin_loader(num_workers), workdir, devices=world_size)
    torch.save(
        {"seen": full.seen, "weights": weights(full)}, workdir / f"dropin_full_rank{rank}.pt"
    )
    for callback in (True, False):
        head = fit_two_epochs(
            build_ddp_dropin_loader(num_workers), workdir, devices=world_size,
            save_at=DROPIN_SAVE_AT, max_steps=DROPIN_STOP_AT, callback=callback,
            checkpoints=f"ckpt_{callback}",
        )  # fmt: skip
        torch.save({"seen": head.seen}, workdir / f"dropin_head_{callback}_rank{rank}.pt")


def dropin_resume(
    rank: int, world_size: int, workdir: Path, *, num_workers: int, callback: bool
) -> None:
    """Rank program: a fresh process resumes with ``fit(ckpt_path=...)`` on ``world_size``
    ranks, 2 as saved or any other number (``dropin_tail_<callback>_on<world_size>_rank<r>.pt``)."""
    model = fit_two_epochs(
        build_ddp_dropin_loader(num_workers), workdir, devices=world_size, resume=True,
        callback=callback, checkpoints=f"ckpt_{callback}", strategy="ddp",
    )  # fmt: skip
    torch.save(
        {"seen": model.seen, "weights": weights(model)},
        workdir / f"dropin_tail_{callback}_on{world_size}_rank{rank}.pt",
    )
