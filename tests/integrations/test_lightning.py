"""SavableDataLoader under a real Lightning Trainer: epochs, exact resume, held-back batches.

Each resume test runs an uninterrupted reference, a run stopped right after a checkpoint
(``max_steps``), and a fresh Trainer + fresh loader resumed with ``fit(ckpt_path=...)``; the
batches the two runs trained on must concatenate to the reference's, and the final weights
must be bit-identical.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

import energy_loader as el
from tests import distributed_helpers as dh
from tests.helpers import LazyModule
from tests.loader.dropin_helpers import dealt_rest, distributed_order

# Lightning is imported by the first test that runs, not at collection (LazyModule says why).
lh = LazyModule("tests.integrations.lightning_helpers")
integration = LazyModule("energy_loader.integrations.lightning")

# Lightning's advice for real runs (num_workers, logging) and its own deprecations.
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning",
    "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning",
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
)

# Batches per epoch of the two pipelines (the unsized one filters 4 of 24 samples out).
PER_EPOCH = {True: 12, False: 10}


@pytest.fixture(scope="module")
def reference() -> dict[tuple[bool, int], lh.TinyModel]:
    """Uninterrupted two-epoch runs, built once per (sized, num_workers)."""
    return {}


def uninterrupted(
    cache: dict[tuple[bool, int], lh.TinyModel], sized: bool, workers: int
) -> lh.TinyModel:
    if (sized, workers) not in cache:
        cache[(sized, workers)] = lh.run(lh.build_loader(sized=sized, num_workers=workers))
    return cache[(sized, workers)]


def checkpoint_at(tmp_path: Path, step: int, **kwargs: Any) -> tuple[lh.TinyModel, str]:
    """Train ``step`` steps, checkpointing at the last; return the model and the file."""
    first = lh.run(max_steps=step, checkpoint_dir=tmp_path, checkpoint_every=step, **kwargs)
    (checkpoint,) = tmp_path.glob("*.ckpt")
    return first, str(checkpoint)


def assert_same_training(first: lh.TinyModel, second: lh.TinyModel, full: lh.TinyModel) -> None:
    assert first.seen + second.seen == full.seen
    for mine, theirs in zip(lh.weights(second), lh.weights(full), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("workers", [0, 2])
def test_two_epochs_train_every_batch_twice(reference, workers: int) -> None:
    assert len(lh.build_loader(sized=True, num_workers=workers)) == 12
    model = uninterrupted(reference, True, workers)
    assert model.global_step_at_end == 24
    assert [epoch for epoch, _ in model.seen] == [0] * 12 + [1] * 12
    for epoch in (0, 1):
        samples = sorted(i for e, batch in model.seen if e == epoch for i in batch)
        assert samples == list(range(24))


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["mid_epoch", "epoch_end"])
def test_resume_trains_the_same_batches_and_weights(
    tmp_path: Path, reference, sized: bool, workers: int, where: str
) -> None:
    full = uninterrupted(reference, sized, workers)
    step = 5 if where == "mid_epoch" else PER_EPOCH[sized]
    first, checkpoint = checkpoint_at(
        tmp_path, step, loader=lh.build_loader(sized=sized, num_workers=workers)
    )
    second = lh.run(lh.build_loader(sized=sized, num_workers=workers), ckpt_path=checkpoint)
    assert_same_training(first, second, full)


@pytest.mark.parametrize("workers", [0, 2])
def test_endless_pipeline_with_max_steps_resumes_exactly(tmp_path: Path, workers: int) -> None:
    """RepeatDataset + max_steps (max_epochs unset): also the estimated_stepping_batches
    workaround, since Lightning then answers max_steps without building the loader."""
    steps = dict(max_epochs=None, max_steps=16, read_estimated_steps=True)
    full = lh.run(lh.build_endless_loader(workers), **steps)
    assert full.estimated_steps == 16
    assert len(full.seen) == 16
    first = lh.run(
        lh.build_endless_loader(workers),
        max_epochs=None,
        max_steps=5,
        checkpoint_dir=tmp_path,
        checkpoint_every=5,
        read_estimated_steps=True,
    )
    (checkpoint,) = tmp_path.glob("*.ckpt")
    second = lh.run(lh.build_endless_loader(workers), ckpt_path=str(checkpoint), **steps)
    assert_same_training(first, second, full)


def test_without_the_callback_an_unsized_resume_skips_the_prefetched_batch(
    tmp_path: Path, reference
) -> None:
    """The symptom the callback fixes: Lightning saved while holding batch 6 untrained."""
    full = uninterrupted(reference, False, 0)
    first, checkpoint = checkpoint_at(
        tmp_path, 5, loader=lh.build_loader(sized=False, num_workers=0), use_callback=False
    )
    second = lh.run(
        lh.build_loader(sized=False, num_workers=0), ckpt_path=checkpoint, use_callback=False
    )
    assert first.seen == full.seen[:5]
    assert second.seen == full.seen[6:]


class CountingLoader(el.SavableDataLoader):
    """A SavableDataLoader that counts Lightning's calls of load_state_dict."""

    loads = 0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        CountingLoader.loads += 1
        super().load_state_dict(state_dict)


def resume_reading_estimated_steps(
    tmp_path: Path, callback: integration.SavableLoaderCallback | None = None
) -> tuple[lh.TinyModel, lh.TinyModel]:
    """Checkpoint at step 5 and resume, reading estimated_stepping_batches in both runs."""
    CountingLoader.loads = 0
    first, checkpoint = checkpoint_at(
        tmp_path, 5, loader=lh.build_loader(sized=True, num_workers=0), read_estimated_steps=True
    )
    loader = lh.build_loader(sized=True, num_workers=0, loader_class=CountingLoader)
    second = lh.run(loader, ckpt_path=checkpoint, read_estimated_steps=True, callback=callback)
    return first, second


def test_estimated_stepping_batches_keeps_lightning_from_loading_the_state(
    tmp_path: Path, reference
) -> None:
    """Lightning's bug, not the loader's: it never calls load_state_dict. Without our check
    the resumed run restarts the epoch from its first batch."""
    full = uninterrupted(reference, True, 0)
    _, second = resume_reading_estimated_steps(
        tmp_path, integration.SavableLoaderCallback(check_resume=False)
    )
    assert second.estimated_steps == 24
    assert CountingLoader.loads == 0
    assert second.seen[0] == full.seen[0]


def test_the_callback_refuses_a_resume_that_did_not_load_the_state(tmp_path: Path) -> None:
    with pytest.raises(integration.LoaderStateNotLoadedError, match="estimated_stepping_batches"):
        resume_reading_estimated_steps(tmp_path)
    assert CountingLoader.loads == 0


def test_the_same_resume_works_when_configure_optimizers_does_not_read_it(
    tmp_path: Path, reference
) -> None:
    """The workaround: the total steps computed without Lightning's estimate."""
    CountingLoader.loads = 0
    full = uninterrupted(reference, True, 0)
    first, checkpoint = checkpoint_at(
        tmp_path, 5, loader=lh.build_loader(sized=True, num_workers=0)
    )
    loader = lh.build_loader(sized=True, num_workers=0, loader_class=CountingLoader)
    second = lh.run(loader, ckpt_path=checkpoint)
    assert CountingLoader.loads == 1
    assert_same_training(first, second, full)


def test_state_dict_saves_with_the_held_back_source() -> None:
    """What the callback relies on: state_dict() with no arguments asks held_back_source."""
    loader = lh.build_loader(sized=True, num_workers=0)
    iterator = iter(loader)
    handed_out = [next(iterator)["index"].tolist() for _ in range(3)]
    loader.held_back_source = lambda: 1
    states = {"source": loader.state_dict(), "explicit": loader.state_dict(held_back=1)}
    states["overridden"] = loader.state_dict(held_back=0)
    after = {}
    for name, state in states.items():
        resumed = lh.build_loader(sized=True, num_workers=0)
        resumed.load_state_dict(state)
        after[name] = next(iter(resumed))["index"].tolist()
    assert after == {
        "source": handed_out[2],
        "explicit": handed_out[2],
        "overridden": after["overridden"],
    }
    assert after["overridden"] not in handed_out


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="check_resume"):
        integration.SavableLoaderCallback(check_resume="yes")  # type: ignore[arg-type]


# -- several ranks: Trainer(strategy="ddp") on two gloo ranks ----------------------------------

DDP_SAVE_AT, DDP_KILL_AT = 5, 7


def _read(workdir: Path, name: str, rank: int) -> dict[str, Any]:
    return torch.load(workdir / f"{name}_rank{rank}.pt", weights_only=False)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks with a worker each: an uninterrupted run; a run checkpointed after step 5
    (Lightning holds the prefetched batch 6 then) and SIGKILLed after step 7; a fresh
    resume. The directory holds what each rank trained on and the checkpoint."""
    workdir = tmp_path_factory.mktemp("lightning_ddp")
    launch = dict(timeout=150, torchrun_env=True, num_workers=1)
    dh.launch(
        lh.train_then_preempt, 2, workdir, exitcode=-signal.SIGKILL, save_at=DDP_SAVE_AT,
        kill_at=DDP_KILL_AT, **launch,
    )  # fmt: skip
    dh.launch(lh.resume_after_preemption, 2, workdir, **launch)
    return workdir


@pytest.mark.timeout(300)
def test_ddp_ranks_killed_mid_epoch_resume_exactly(ddp_run: Path) -> None:
    """Every rank: the batches (indices and augmented inputs) before the checkpoint plus the
    resumed run's are the uninterrupted run's, across the epoch boundary; same weights."""
    for rank in range(2):
        full, head, tail = (_read(ddp_run, name, rank) for name in ("full", "head", "tail"))
        assert [epoch for epoch, *_ in full["seen"]] == [0] * 12 + [1] * 12
        assert len(head["seen"]) == DDP_KILL_AT
        assert head["seen"][:DDP_SAVE_AT] + tail["seen"] == full["seen"]
        for mine, theirs in zip(tail["weights"], full["weights"], strict=True):
            assert torch.equal(mine, theirs)
    epoch = [i for r in range(2) for _, batch, _ in _read(ddp_run, "full", r)["seen"][:12]
             for i in batch]  # fmt: skip
    assert sorted(epoch) == list(range(lh.DDP_SAMPLES))  # each rank read its own half


@pytest.mark.timeout(300)
def test_a_ddp_checkpoint_resumes_on_one_device(ddp_run: Path) -> None:
    """2 ranks x 1 worker and 1 rank x 2 workers run the same 2 partitions: one device
    continues the job's stream (rank 0's and rank 1's batches, step by step)."""
    full = [_read(ddp_run, "full", r)["seen"] for r in range(2)]
    stream = [step for pair in zip(*full, strict=True) for step in pair]
    model = lh.fit_two_epochs(lh.build_ddp_loader(2), ddp_run, devices=1, resume=True)
    assert model.seen == stream[2 * DDP_SAVE_AT :]


@pytest.fixture(scope="module")
def dropin_ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks of DDP with a drop-in loader (one worker each, Lightning's DistributedSampler):
    an uninterrupted run, and runs checkpointed mid-epoch 0 with and without the callback."""
    workdir = tmp_path_factory.mktemp("lightning_dropin_ddp")
    dh.launch(lh.dropin_train_then_stop, 2, workdir, timeout=150, torchrun_env=True, num_workers=1)
    return workdir


@pytest.mark.timeout(300)
@pytest.mark.parametrize("callback", [True, False])
def test_ddp_dropin_loader_resumes_exactly(dropin_ddp_run: Path, callback: bool) -> None:
    """With the callback every rank restores its own gathered state; without it Lightning
    hands rank 0's to both, which a DistributedSampler's state allows. Either way each rank
    trains, after the resume, on the batches (indices and augmented inputs) of the
    uninterrupted run through 2 epochs, and ends with the same weights."""
    dh.launch(
        lh.dropin_resume, 2, dropin_ddp_run, timeout=150, torchrun_env=True, num_workers=1,
        callback=callback,
    )  # fmt: skip
    (checkpoint,) = (dropin_ddp_run / f"ckpt_{callback}").glob("*.ckpt")
    assert f"step={lh.DROPIN_SAVE_AT}" in checkpoint.name
    halves = []
    for rank in range(2):
        full, head, tail = (
            _read(dropin_ddp_run, name, rank)
            for name in ("dropin_full", f"dropin_head_{callback}", f"dropin_tail_{callback}_on2")
        )
        assert [epoch for epoch, *_ in full["seen"]] == [0] * 12 + [1] * 12
        assert len(head["seen"]) == lh.DROPIN_STOP_AT
        assert head["seen"][: lh.DROPIN_SAVE_AT] + tail["seen"] == full["seen"]
        for mine, theirs in zip(tail["weights"], full["weights"], strict=True):
            assert torch.equal(mine, theirs)
        halves.append({i for _, batch, _ in full["seen"][:12] for i in batch})
    assert not halves[0] & halves[1] and len(halves[0] | halves[1]) == lh.DDP_SAMPLES


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    # The default run keeps the callback's per-rank states on fewer devices (1-True; 2 devices:
    # test above); Lightning's count on more devices, refused or counted by the callback, is
    # test_a_larger_batch_size_under_ddp_is_counted_by_the_callback_or_refused's, in one process.
    ("devices", "callback"),
    [
        (1, True),
        pytest.param(1, False, marks=pytest.mark.slow),
        pytest.param(3, True, marks=pytest.mark.slow),
        pytest.param(3, False, marks=pytest.mark.slow),
    ],
    ids=["1-True", "1-False", "3-True", "3-False"],
)
def test_ddp_dropin_checkpoint_resumes_on_another_number_of_devices(
    dropin_ddp_run: Path, devices: int, callback: bool
) -> None:
    """The 2-device checkpoint taken after step 5 of epoch 0, resumed by ``fit(ckpt_path=...)``
    on 1 or 3 devices: each rank trains the rule's indices for the rest of epoch 0 (the rest
    of the permutation dealt as DistributedSampler deals), then DistributedSampler's own
    epoch 1 for its layout; every sample is augmented as in the uninterrupted 2-device run,
    and each epoch trains every sample once but for the padding.

    Except on more devices without the callback: Lightning would end the resumed epoch
    after ``len(loader)`` batches counted from the checkpoint's 5 and skip the last batches
    the new dealing gave each rank (docs/integrations-lightning.md), so ``fit`` refuses before
    the first batch, naming the callback (which makes Lightning count the epoch as the loader
    deals it)."""
    refused = devices > 2 and not callback
    dh.launch(
        lh.dropin_resume, devices, dropin_ddp_run, timeout=150, torchrun_env=True, num_workers=1,
        callback=callback, exitcode=1 if refused else 0,
    )  # fmt: skip
    if refused:
        for rank in range(devices):
            error = (dropin_ddp_run / f"error_rank{rank}.txt").read_text()
            assert "StateMismatchError" in error and "SavableLoaderCallback()" in error, error
            assert "5 batches of the resumed epoch left" in error, error
            assert not (dropin_ddp_run / f"dropin_tail_False_on{devices}_rank{rank}.pt").exists()
        return
    augmented = {  # (epoch, index) -> the augmented input the uninterrupted run trained on
        (epoch, index): x
        for rank in range(2)
        for epoch, batch, xs in _read(dropin_ddp_run, "dropin_full", rank)["seen"]
        for index, x in zip(batch, xs, strict=True)
    }
    head = [
        index
        for rank in range(2)
        for _, batch, _ in _read(dropin_ddp_run, f"dropin_head_{callback}", rank)["seen"][
            : lh.DROPIN_SAVE_AT
        ]
        for index in batch
    ]
    order = distributed_order(lh.DDP_SAMPLES, 0, seed=0)  # Lightning's sampler seed: 0
    assert sorted(head) == sorted(order[: len(head)])
    rest: list[int] = []
    for rank in range(devices):
        seen = _read(dropin_ddp_run, f"dropin_tail_{callback}_on{devices}", rank)["seen"]
        for epoch, batch, xs in seen:
            assert xs == [augmented[epoch, index] for index in batch], (rank, epoch)
        by_epoch = [[i for e, batch, _ in seen if e == epoch for i in batch] for epoch in (0, 1)]
        assert by_epoch[0] == dealt_rest(order, len(head), devices, rank), rank
        sampler = DistributedSampler(range(lh.DDP_SAMPLES), num_replicas=devices, rank=rank, seed=0)
        sampler.set_epoch(1)
        assert by_epoch[1] == list(sampler), rank
        rest += by_epoch[0]
    assert sorted(set(head + rest)) == list(range(lh.DDP_SAMPLES))
    assert len(head) + len(rest) - lh.DDP_SAMPLES < devices  # DistributedSampler's padding


@pytest.fixture
def ddp_in_this_process() -> Iterator[None]:
    """Lightning's "ddp" strategy on one device runs in the test's own process: it opens a
    1-rank gloo group and sets MASTER_ADDR and the like, both undone after the test."""
    environ = dict(os.environ)
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.usefixtures("ddp_in_this_process")
def test_a_larger_batch_size_under_ddp_is_counted_by_the_callback_or_refused(
    tmp_path: Path,
) -> None:
    """Lightning's count of a resumed epoch, as on more devices, in one process: a drop-in
    loader under Lightning's (1-rank) DistributedSampler checkpointed after 2 batches of 4 and
    resumed with batches of 8 has 5 batches of epoch 0 left, where Lightning counts
    len(loader) - 2 = 4. Without the callback ``fit`` refuses before the first batch, naming
    it; with it, the resumed run trains the uninterrupted run's samples from the ninth on,
    augmented alike, through epoch 1."""

    def loader(batch_size: int) -> el.SavableDataLoader:
        return el.SavableDataLoader(lh.JitteredSamples(), batch_size=batch_size, shuffle=True)

    def samples(model: Any) -> list[tuple[int, int, float]]:
        return [(e, i, x) for e, batch, xs in model.seen for i, x in zip(batch, xs, strict=True)]

    fit = lh.fit_two_epochs
    full = fit(loader(4), tmp_path, devices=1, strategy="ddp")
    head = fit(loader(4), tmp_path, devices=1, strategy="ddp", save_at=2, max_steps=2)
    assert head.seen == full.seen[:2]
    with pytest.raises(el.StateMismatchError, match="5 batches of the resumed epoch left") as error:
        fit(loader(8), tmp_path, devices=1, strategy="ddp", resume=True, callback=False)
    assert "SavableLoaderCallback()" in str(error.value)
    tail = fit(loader(8), tmp_path, devices=1, strategy="ddp", resume=True)
    assert [len(batch) for _, batch, _ in tail.seen] == [8] * (5 + 6)
    assert samples(tail) == samples(full)[2 * 4 :]
