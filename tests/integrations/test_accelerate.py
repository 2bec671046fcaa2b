"""Hugging Face Accelerate: prepare_loader, save_state/load_state mid-epoch, clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

import energy_loader as el
from energy_loader.integrations.accelerate import AcceleratedLoader, prepare_loader
from energy_loader.testing.strategies import AddNoise, MakeSample
from tests.integrations.conftest import stop_workers

EPOCHS = 2


def _pipeline() -> el.SavableDataset:
    source = el.IndexedSource.from_fn(45, MakeSample(), shuffle=True, seed=11)
    return el.BatchDataset(el.ShuffleBufferDataset(el.MapDataset(source, AddNoise()), 6), 4)


class Progress:
    """The training loop's own counters, saved beside the loader (as a user would)."""

    def __init__(self) -> None:
        self.step, self.epoch = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch = state["step"], state["epoch"]


def _train(
    workers: int, checkpoint: Path | None = None, *, save_at: int = -1, stop_at: int = -1
) -> tuple[list[Any], torch.Tensor]:
    """Train a linear model; save at ``save_at``, crash after ``stop_at``, resume if told."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    savable = el.SavableDataLoader(_pipeline(), num_workers=workers)
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
    while progress.epoch < EPOCHS:
        for batch in loader:
            assert batch["x"].device == accelerator.device
            loss = model(batch["noise"].float().unsqueeze(1)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen.append((progress.epoch, batch["index"].tolist(), batch[el.RESTORE_KEY]))
            progress.step += 1
            if progress.step - 1 == save_at:
                accelerator.save_state(str(checkpoint))
            if progress.step - 1 == stop_at:
                return seen, model.weight.detach().clone()
        progress.epoch += 1
    return seen, model.weight.detach().clone()


@pytest.mark.parametrize("workers", [0, 2])
def test_save_state_mid_epoch_and_load_state_resume_exactly(tmp_path: Path, workers: int) -> None:
    reference, final_weight = _train(workers)
    assert len(reference) == 2 * len(el.SavableDataLoader(_pipeline(), num_workers=workers))
    save_at = len(reference) // 2 - 3  # mid-epoch of the first epoch, stop a few steps later
    head, _ = _train(workers, tmp_path, save_at=save_at, stop_at=save_at + 3)
    tail, resumed_weight = _train(workers, tmp_path)
    assert head[: save_at + 1] + tail == reference
    assert torch.equal(resumed_weight, final_weight)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_what_accelerator_prepare_made_of_the_loader_is_a_clear_error(
    workers: int,
) -> None:
    accelerator = Accelerator(cpu=True)
    loader = el.SavableDataLoader(_pipeline(), num_workers=workers)
    prepared = accelerator.prepare(loader)
    with pytest.raises(
        TypeError, match=r"use energy_loader\.integrations\.accelerate\.prepare_loader"
    ):
        next(iter(prepared))
    # The loader itself is untouched and still works.
    assert next(iter(loader)) is not None
    loader.close()


def test_prepare_loader_refuses_what_would_break_the_loader() -> None:
    accelerator = Accelerator(cpu=True)
    loader = el.SavableDataLoader(_pipeline())
    with pytest.raises(TypeError, match=r"what accelerator.prepare\(\) made of a Savable"):
        prepare_loader(accelerator, accelerator.prepare(loader))
    with pytest.raises(TypeError, match=r"`accelerator` must be an accelerate\.Accelerator"):
        prepare_loader("cpu", loader)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`loader` must be an energy_loader SavableDataLoader"):
        prepare_loader(accelerator, [1, 2])  # type: ignore[arg-type]
    prepared = prepare_loader(accelerator, loader, register_for_checkpointing=False)
    assert isinstance(prepared, AcceleratedLoader) and accelerator.prepare(prepared) is prepared
    with pytest.raises(TypeError, match="already prepared"):
        prepare_loader(accelerator, prepared)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="skip_first_batches\\(\\) is not needed"):
        accelerator.skip_first_batches(prepared, 2)
    with pytest.raises(el.StateFormatError, match="not an energy_loader Accelerate loader state"):
        prepared.load_state_dict({"rank_state_json": "{}"})
