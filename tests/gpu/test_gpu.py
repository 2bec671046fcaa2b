"""The GPU path: pinned batches, exact restores with ``pin_memory``, and a training loop that
moves batches with ``.to("cuda", non_blocking=True)``.

Skipped without CUDA (the default suite runs on CPU machines). Each check is written against
an oracle: torch's own DataLoader with the same arguments, or the uninterrupted run. The
helpers take the device and the pinning as arguments, so the same code also runs on a CPU
(``device="cpu"``, ``pin=False``) where that is all there is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import energy_loader as el
from tests.helpers import reference_pipeline
from tests.loader.dropin_helpers import Augmenting, assert_same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Images(Dataset[Any]):
    """uint8 images and labels made from the index (deterministic: torch's loader makes the
    same ones)."""

    def __init__(self, length: int, size: int = 16) -> None:
        self.length, self.size = length, size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = torch.arange(3 * self.size * self.size, dtype=torch.int64) * (index + 1) % 251
        return {
            "index": index,
            "image": image.to(torch.uint8).view(3, self.size, self.size),
            "label": torch.tensor(index % 10),
        }


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a batch (dicts, lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)


def pinned_pairs(workers: int, *, pin: bool) -> list[tuple[Any, Any]]:
    """(ours, torch's) batches of one shuffled epoch, the same arguments given to both."""

    def build(loader_class: Any) -> Any:
        return loader_class(
            Images(40),
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            pin_memory=pin,
            generator=torch.Generator().manual_seed(3),
        )

    ours, theirs = build(el.SavableDataLoader), build(DataLoader)
    pairs = list(zip(ours, theirs, strict=True))
    ours.close()
    return pairs


def pipeline_batches(*, pin: bool) -> list[Any]:
    """A savable pipeline's batches through 2 workers."""
    loader = el.SavableDataLoader(reference_pipeline(length=48), num_workers=2, pin_memory=pin)
    batches = list(loader)
    loader.close()
    return batches


def augmenting_loader(workers: int, *, pin: bool) -> el.SavableDataLoader:
    return el.SavableDataLoader(
        Augmenting(30), batch_size=4, shuffle=True, num_workers=workers, pin_memory=pin
    )


def restored_run(workers: int, stop: int, *, pin: bool) -> tuple[list[Any], list[Any]]:
    """The batches of two epochs uninterrupted, and of a run stopped after ``stop`` batches,
    its state saved, continued by a fresh loader (``load_state_dict``)."""
    torch.manual_seed(0)
    loader = augmenting_loader(workers, pin=pin)
    uninterrupted = [batch for _ in range(2) for batch in loader]
    loader.close()
    torch.manual_seed(0)
    loader = augmenting_loader(workers, pin=pin)
    resumed: list[Any] = []
    iterator = iter(loader)
    for _ in range(stop):
        resumed.append(next(iterator))
    state = loader.state_dict()
    loader.close()
    torch.manual_seed(1)  # the restarted program's RNG is elsewhere: the restore must not care
    fresh = augmenting_loader(workers, pin=pin)
    fresh.load_state_dict(state)
    for _ in range(2 - fresh.epoch):  # the rest of the saved epoch, then epoch 1
        resumed.extend(fresh)
    fresh.close()
    return uninterrupted, resumed


def train_steps(
    loader: Any, model: torch.nn.Module, optimizer: Any, device: str, steps: int | None
) -> list[torch.Tensor]:
    """Training as people write it: each batch to the device with ``non_blocking=True``, a
    forward and backward pass and an optimizer step; returns each step's device input (copied
    back after the step) and stops after ``steps`` steps (None: the epoch)."""
    seen = []
    for step, batch in enumerate(loader):
        inputs = batch["torch"].to(device, non_blocking=True)
        loss = model(inputs).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen.append(inputs.cpu())
        if steps is not None and step + 1 == steps:
            break
    return seen


def device_loop(device: str, workers: int, stop: int, *, pin: bool) -> None:
    """An epoch trained uninterrupted, and trained with a save after ``stop`` steps and a
    restore into a fresh loader and model: the same device inputs and the same weights."""

    def build() -> tuple[el.SavableDataLoader, torch.nn.Module, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 3).to(device)
        return augmenting_loader(workers, pin=pin), model, torch.optim.SGD(model.parameters(), 0.1)

    loader, model, optimizer = build()
    expected = train_steps(loader, model, optimizer, device, None)
    loader.close()
    expected_weights = [p.detach().cpu() for p in model.parameters()]
    loader, model, optimizer = build()
    got = train_steps(loader, model, optimizer, device, stop)
    saved = {"loader": loader.state_dict(), "model": model.state_dict(),
             "optimizer": optimizer.state_dict()}  # fmt: skip
    loader.close()
    fresh, model, optimizer = build()  # the restarted program
    fresh.load_state_dict(saved["loader"])
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    got += train_steps(fresh, model, optimizer, device, None)
    fresh.close()
    assert len(got) == len(expected) > stop
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"step {step}: the device input differs"
    for p, q in zip(model.parameters(), expected_weights):
        torch.testing.assert_close(p.detach().cpu(), q)


@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_equal_torchs_dataloader(workers: int) -> None:
    pairs = pinned_pairs(workers, pin=True)
    assert len(pairs) == 10
    for ours, theirs in pairs:
        assert all(t.is_pinned() for t in tensors(ours))
        assert all(t.is_pinned() for t in tensors(theirs))
        assert_same(ours, theirs)


def test_a_pipelines_batches_are_pinned() -> None:
    batches = pipeline_batches(pin=True)
    assert batches
    for batch in batches:
        found = list(tensors(batch))
        assert found and all(t.is_pinned() for t in found)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restore_with_pin_memory_is_exact(workers: int) -> None:
    uninterrupted, resumed = restored_run(workers, stop=3, pin=True)
    assert all(t.is_pinned() for batch in resumed for t in tensors(batch))
    assert_same(resumed, uninterrupted)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_non_blocking_cuda_loop_over_a_restored_loader_equals_the_uninterrupted_one(
    workers: int,
) -> None:
    device_loop("cuda", workers, stop=3, pin=True)
