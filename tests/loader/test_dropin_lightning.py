"""Lightning rebuilds a drop-in loader with a DistributedSampler (use_distributed_sampler)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import energy_loader as el
from energy_loader.loader.dropin.build import runs_dropin

from .dropin_helpers import assert_same

DATA = TensorDataset(torch.arange(20))


@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_injects_a_distributed_sampler_into_a_drop_in_loader(workers: int) -> None:
    """What Lightning's trainer does with ``use_distributed_sampler=True`` under DDP."""
    # Imported here: Lightning is a heavy import the other modules' tests need not pay for.
    from pytorch_lightning.utilities.data import _update_dataloader

    def rebuilt(loader: DataLoader) -> DataLoader:
        sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=3)
        return _update_dataloader(loader, sampler, mode=None)

    ours = rebuilt(el.SavableDataLoader(DATA, batch_size=3, shuffle=True, num_workers=workers))
    theirs = rebuilt(DataLoader(DATA, batch_size=3, shuffle=True, num_workers=workers))
    assert type(ours) is el.SavableDataLoader and runs_dropin(ours)
    assert isinstance(ours.sampler, DistributedSampler)
    assert ours.num_workers == workers and ours.batch_size == 3
    assert_same(list(ours), list(theirs))
    iterator = iter(ours)
    next(iterator)
    state = ours.state_dict()
    again = rebuilt(el.SavableDataLoader(DATA, batch_size=3, shuffle=True, num_workers=workers))
    again.load_state_dict(state)
    assert_same(list(again), list(iterator))
    ours.close()
