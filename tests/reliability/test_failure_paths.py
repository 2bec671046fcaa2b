"""A source file vanishing mid-epoch: a WorkerError naming it, no hang, restorable after."""

from __future__ import annotations

import shutil

import pytest
import torch

import energy_loader as el
from energy_loader.testing import first_difference

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _pipeline(folder) -> el.SavableDataset:
    return el.BatchDataset(el.ChunkedFolderSource(folder), 4)


@pytest.mark.timeout(120)
def test_a_chunk_file_vanishing_mid_epoch(tmp_path) -> None:
    folder = tmp_path / "data"
    samples = [{"i": torch.tensor(i), "x": torch.arange(4) + i} for i in range(400)]
    el.write_chunked_folder(folder, samples, samples_per_file=20)
    reference = [b["i"].tolist() for b in el.SavableDataLoader(_pipeline(folder), num_workers=2)]
    loader = el.SavableDataLoader(_pipeline(folder), num_workers=2, prefetch_factor=1)
    iterator = iter(loader)
    head = [next(iterator)["i"].tolist() for _ in range(3)]
    state = loader.save_state_rank()
    files = sorted(p for p in folder.iterdir() if p.suffix == ".pt")
    backup = tmp_path / "backup"
    backup.mkdir()
    for path in files:  # every chunk file vanishes; whatever is not loaded yet is gone
        shutil.move(path, backup / path.name)
    with pytest.raises(el.WorkerError) as raised:
        for _ in range(1000):
            next(iterator)
    message = str(raised.value)
    assert ".pt" in message and ("No such file" in message or "missing" in message.lower())
    del raised  # its traceback holds the loader's frames
    for path in backup.iterdir():
        shutil.move(path, folder / path.name)
    loader.restore_state_rank(state)
    rest = [b["i"].tolist() for b in loader]
    assert first_difference(reference, head + rest) is None
    loader.reset_state()  # stops the persistent workers now
