"""The map-style drop-in's proof of values: a restore re-makes the last batch the saving loader
handed out and refuses when the same indices give other values.

The datasets read real files (one ``.npy`` array per sample under ``tmp_path``); a file edited
in place between the save and the restore (the same number of files) is refused, and so is a
``__getitem__`` drawing from a generator of its own that nobody seeds. Legitimate restores
(another number of workers, shuffling, augmentations drawing from torch's global RNG, which
the loader seeds per sample, a batch the training step wrote into) continue exactly;
``verify_restore=False`` continues with the new values.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import energy_loader as el
from energy_loader.errors import StateFormatError, StateMismatchError

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

COUNT = 24
BATCH = 4


class NpyFiles(Dataset[dict[str, Any]]):
    """One ``.npy`` file per sample, read at every ``__getitem__``; with ``augment`` a crop
    offset and a noise drawn from torch's global RNG (which the loader seeds per sample)."""

    def __init__(self, folder: Path, augment: bool = False) -> None:
        self.folder = folder
        self.augment = augment

    def __len__(self) -> int:
        return COUNT

    def __getitem__(self, index: int) -> dict[str, Any]:
        x = torch.from_numpy(np.load(self.folder / f"{index}.npy"))
        if self.augment:
            x = torch.roll(x, int(torch.randint(0, 8, ()))) + torch.rand(())
        return {"index": index, "x": x}


class PrivateNoise(NpyFiles):
    """Adds noise from a generator of its own, seeded by nobody (another in every run)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.rng = np.random.default_rng()

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = super().__getitem__(index)
        sample["x"] = sample["x"] + float(self.rng.random())
        return sample


def _write(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    for index in range(COUNT):
        np.save(folder / f"{index}.npy", np.arange(8, dtype=np.float32) + 10 * index)
    return folder


def _edit(folder: Path, indices: list[int]) -> None:
    """Rewrite the files of ``indices`` in place (the same count of files)."""
    for index in indices:
        np.save(folder / f"{index}.npy", np.full(8, -1.0, dtype=np.float32))


def _loader(dataset: Dataset[Any], workers: int, **options: Any) -> el.SavableDataLoader:
    return el.SavableDataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        num_workers=workers,
        **options,
    )


def _saved(loader: el.SavableDataLoader, steps: int, mutate: bool = False) -> tuple[Any, Any]:
    """The state after ``steps`` batches (JSON round trip), and the last batch's indices."""
    iterator = iter(loader)
    batch: Any = None
    for _ in range(steps):
        batch = next(iterator)
        if mutate:  # the training step writes into the batch it was handed
            batch["x"].mul_(0).add_(123.0)
    state = json.loads(json.dumps(loader.save_state_rank()))
    loader.close()
    return state, batch["index"].tolist()


def _rest(loader: el.SavableDataLoader) -> list[list[int]]:
    out = [batch["index"].tolist() + batch["x"].flatten().tolist() for batch in loader]
    loader.close()
    return out


def _expected(dataset: Dataset[Any], steps: int) -> list[list[int]]:
    loader = _loader(dataset, 0)
    iterator = iter(loader)
    for _ in range(steps):
        next(iterator)
    out = [batch["index"].tolist() + batch["x"].flatten().tolist() for batch in iterator]
    loader.close()
    return out


@pytest.mark.parametrize(
    ("saving", "restoring"), [(2, 0), (0, 0), pytest.param(2, 2, marks=pytest.mark.slow)]
)
def test_a_data_file_edited_in_place_is_refused(
    tmp_path: Path, saving: int, restoring: int
) -> None:
    folder = _write(tmp_path / "data")
    state, last = _saved(_loader(NpyFiles(folder), saving), 3)
    _edit(folder, last[:1])
    restored = _loader(NpyFiles(folder), restoring)
    restored.restore_state_rank(state)
    with pytest.raises(StateMismatchError) as caught:
        iter(restored)
    message = str(caught.value)
    assert "dataset NpyFiles" in message
    assert f"indices {last}" in message
    assert "the same indices gave other values" in message
    assert "a data file edited" in message and "verify_restore=False" in message
    restored.close()


def test_an_edit_elsewhere_in_the_data_is_not_the_last_batch_s(tmp_path: Path) -> None:
    """The proof covers the last batch handed out: a file of a batch still to come, edited,
    continues (with the new values), as the uninterrupted run reading it then would."""
    folder = _write(tmp_path / "data")
    state, last = _saved(_loader(NpyFiles(folder), 0), 3)
    other = next(i for i in range(COUNT) if i not in last)
    _edit(folder, [other])
    restored = _loader(NpyFiles(folder), 0)
    restored.restore_state_rank(state)
    assert _rest(restored) == _expected(NpyFiles(folder), 3)


def test_a_private_unseeded_generator_is_refused(tmp_path: Path) -> None:
    folder = _write(tmp_path / "data")
    state, _ = _saved(_loader(PrivateNoise(folder), 0), 2)
    restored = _loader(PrivateNoise(folder), 0)
    restored.restore_state_rank(state)
    with pytest.raises(StateMismatchError, match=r"dataset PrivateNoise.*a random generator"):
        iter(restored)
    restored.close()


@pytest.mark.parametrize(
    ("saving", "restoring", "augment", "mutate"),
    [
        (2, 0, True, False),
        (0, 0, True, True),
        pytest.param(0, 2, True, True, marks=pytest.mark.slow),
        pytest.param(2, 2, False, False, marks=pytest.mark.slow),
    ],
)
def test_legitimate_restores_continue_exactly(
    tmp_path: Path, saving: int, restoring: int, augment: bool, mutate: bool
) -> None:
    folder = _write(tmp_path / "data")
    expected = _expected(NpyFiles(folder, augment), 3)
    state, _ = _saved(_loader(NpyFiles(folder, augment), saving), 3, mutate=mutate)
    assert state["proof"]["made"]
    restored = _loader(NpyFiles(folder, augment), restoring)
    restored.restore_state_rank(state)
    assert _rest(restored) == expected


def test_a_state_saved_at_an_epoch_s_end_restores_and_proves(tmp_path: Path) -> None:
    """Saved after the epoch's last batch: the restore checks that batch, then runs the next
    epoch as the uninterrupted loader does; with that batch's file edited, it is refused."""
    folder = _write(tmp_path / "data")
    steps = COUNT // BATCH
    uninterrupted = _loader(NpyFiles(folder, True), 0)
    list(uninterrupted)
    expected = _rest(uninterrupted)
    state, last = _saved(_loader(NpyFiles(folder, True), 0), steps)
    restored = _loader(NpyFiles(folder, True), 0)
    restored.restore_state_rank(state)
    assert _rest(restored) == expected
    _edit(folder, last[-1:])
    refused = _loader(NpyFiles(folder, True), 0)
    refused.restore_state_rank(state)
    with pytest.raises(StateMismatchError, match=f"batch {steps - 1} of epoch 0"):
        iter(refused)


def _edited_restore_continues(folder: Path, workers: int = 0, **options: Any) -> None:
    """Save after 3 batches, edit the last batch's files in place, restore onto ``workers``
    with ``options``: the restore continues unchecked, with the new values."""
    # (the same worker_init_fn saves: one added at the restore is a change of code, which
    # skips the check on its own)
    same_code = {k: v for k, v in options.items() if k == "worker_init_fn"}
    state, last = _saved(_loader(NpyFiles(folder), 0, **same_code), 3)
    _edit(folder, last)
    restored = _loader(NpyFiles(folder), workers, **options)
    restored.restore_state_rank(state)
    assert _rest(restored) == _expected(NpyFiles(folder), 3)


def test_verify_restore_false_continues_with_the_new_values(tmp_path: Path) -> None:
    folder = _write(tmp_path / "data")
    _edited_restore_continues(folder, verify_restore=False)
    unproven, _ = _saved(_loader(NpyFiles(folder), 0, verify_restore=False), 2)
    assert unproven["proof"]["made"] == ""


def test_the_digest_of_values_is_covered_by_the_state_digest(tmp_path: Path) -> None:
    folder = _write(tmp_path / "data")
    state, _ = _saved(_loader(NpyFiles(folder), 0), 3)
    for made in ("0" * 16, "", "not a digest"):
        edited = copy.deepcopy(state)
        edited["proof"]["made"] = made
        with pytest.raises(StateFormatError, match="proof"):
            _loader(NpyFiles(folder), 0).restore_state_rank(edited)


def test_a_worker_init_fn_with_workers_skips_the_check(tmp_path: Path) -> None:
    """A loader with workers and a ``worker_init_fn`` (which the dataset may need) cannot
    re-make a batch in the main process as a worker makes it: it restores without the check."""
    _edited_restore_continues(_write(tmp_path / "data"), 2, worker_init_fn=_no_setup)


def _no_setup(worker_id: int) -> None:
    del worker_id


class LazyHandle(NpyFiles):
    """Opens a handle on its first ``__getitem__`` (as datasets over h5py or LMDB do, so that
    each worker process opens its own after the fork)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.handle: Any = None

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.handle is None:
            self.handle = (self.folder / "0.npy").open("rb")
        return super().__getitem__(index)


def test_the_re_make_leaves_the_loader_s_dataset_as_it_was(tmp_path: Path) -> None:
    """The restore re-makes the batch on a copy of the dataset: what ``__getitem__`` opens
    lazily is not opened on the dataset the worker processes are forked from."""
    folder = _write(tmp_path / "data")
    saving = LazyHandle(folder)
    state, _ = _saved(_loader(saving, 0), 3)
    saving.handle.close()
    dataset = LazyHandle(folder)
    restored = _loader(dataset, 0)
    restored.restore_state_rank(state)
    iterator = iter(restored)  # (the check runs here)
    assert dataset.handle is None
    next(iterator)
    restored.close()
    assert dataset.handle is not None
    dataset.handle.close()


@pytest.mark.parametrize("entry", ["state_dict", "rank_file"])
def test_an_edited_file_is_refused_through_every_entry_point(tmp_path: Path, entry: str) -> None:
    """Leaves or a rank file: the restore re-makes the last batch and compares the same."""
    folder = _write(tmp_path / "data")
    loader = _loader(NpyFiles(folder), 0)
    iterator = iter(loader)
    for _ in range(3):
        last = next(iterator)["index"].tolist()
    leaves = json.loads(json.dumps(loader.state_dict()))
    el.save_state_rank_file(loader, tmp_path / "states")
    loader.close()
    _edit(folder, last[:1])
    restored = _loader(NpyFiles(folder), 0)
    if entry == "state_dict":
        restored.load_state_dict(leaves)
    else:
        el.restore_state_rank_file(restored, tmp_path / "states")
    with pytest.raises(StateMismatchError, match="the same indices gave other values"):
        iter(restored)
    restored.close()
