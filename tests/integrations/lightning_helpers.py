"""Pipelines, a tiny model and run helpers for the Lightning tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

import energy_loader as el
from energy_loader.integrations.lightning import SavableLoaderCallback

SAMPLES = 24
BATCH = 2


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
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        max_steps=max_steps,
        callbacks=callbacks,
        enable_checkpointing=checkpoint_every is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    model.global_step_at_end = trainer.global_step  # type: ignore[assignment]
    return model


def weights(model: TinyModel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
