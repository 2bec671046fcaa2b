"""Hugging Face Accelerate: prepare_loader, save_state/load_state mid-epoch, clear errors.

The multi-process tests run the loop of tests/integrations/accelerate_helpers.py on two gloo
ranks (tests/distributed_helpers.launch): an uninterrupted run, then a run that saves and is
SIGKILLed a few steps later on every rank, then fresh processes that resume from the
checkpoint; every rank must train on exactly the batches (and augmentations) of the
uninterrupted run and end with the same weight.
"""

from __future__ import annotations

import gc
import signal
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import energy_loader as el
from tests import distributed_helpers as dh
from tests.helpers import LazyModule
from tests.integrations.conftest import stop_workers

# Accelerate is imported by the first test that runs, not at collection (LazyModule says why).
accelerate = LazyModule("accelerate")
accelerate_data_loader = LazyModule("accelerate.data_loader")
integration = LazyModule("energy_loader.integrations.accelerate")
ah = LazyModule("tests.integrations.accelerate_helpers")

SAVE_AT = 2  # the step (0-based) after which the killed run saves; it is killed 2 steps later


@pytest.mark.parametrize("workers", [0, 2])
def test_save_state_mid_epoch_and_load_state_resume_exactly(tmp_path: Path, workers: int) -> None:
    reference, final_weight = ah.train(workers)
    assert len(reference) == 2 * len(el.SavableDataLoader(ah.pipeline(), num_workers=workers))
    save_at = len(reference) // 2 - 3  # mid-epoch of the first epoch, stop a few steps later
    head, _ = ah.train(workers, tmp_path, save_at=save_at, stop_at=save_at + 3)
    tail, resumed_weight = ah.train(workers, tmp_path)
    assert head[: save_at + 1] + tail == reference
    assert torch.equal(resumed_weight, final_weight)


@pytest.mark.parametrize("dropin", [False, True], ids=["pipeline", "dropin"])
def test_accelerator_prepare_refuses_a_savable_loader_at_the_call(dropin: bool) -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    if dropin:
        loader = el.SavableDataLoader(ah.NoisySamples(8), batch_size=4, num_workers=2)
    else:
        loader = el.SavableDataLoader(ah.pipeline(), num_workers=2)
    name = type(loader).__name__
    with pytest.raises(TypeError, match=rf"prepare\(\) cannot take a {name}.*prepare_loader"):
        accelerator.prepare(loader)
    model = torch.nn.Linear(1, 1)
    with pytest.raises(TypeError, match="prepare_loader"):  # among other objects too
        accelerator.prepare(model, loader)
    assert accelerator._dataloaders == []
    # The loader itself is untouched and still works.
    assert next(iter(loader)) is not None
    stop_workers(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_what_accelerate_made_of_a_pipeline_loader_is_a_clear_error(
    workers: int,
) -> None:
    """accelerate's module-level prepare_data_loader skips Accelerator.prepare's check: the
    pipeline's internal dataset still refuses to be iterated by any DataLoader but its own."""
    loader = el.SavableDataLoader(ah.pipeline(), num_workers=workers)
    prepared = accelerate_data_loader.prepare_data_loader(loader, put_on_device=False)
    # The error holds torch's own iterator (accelerate's loader is a torch DataLoader) in
    # reference cycles: collected by the cyclic collector, its shutdown would wait 5 s a worker
    # (torch joins workers whose queues the collector closed first). So no collection runs until
    # the cycles are broken and the iterator shuts its workers down by reference count.
    gc.disable()
    try:
        with pytest.raises(
            TypeError, match=r"use energy_loader\.integrations\.accelerate\.prepare_loader"
        ) as caught:
            next(iter(prepared))
        traceback.clear_frames(caught.tb)
        del caught
        prepared.base_dataloader._iterator = None
    finally:
        gc.enable()
    assert next(iter(loader)) is not None
    loader.close()


def test_prepare_loader_refuses_what_would_break_the_loader() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    loader = el.SavableDataLoader(ah.pipeline())
    with pytest.raises(TypeError, match=r"what accelerator.prepare\(\) made of a Savable"):
        integration.prepare_loader(
            accelerator, accelerate_data_loader.prepare_data_loader(loader, put_on_device=False)
        )
    with pytest.raises(TypeError, match=r"`accelerator` must be an accelerate\.Accelerator"):
        integration.prepare_loader("cpu", loader)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`loader` must be an energy_loader SavableDataLoader"):
        integration.prepare_loader(accelerator, [1, 2])  # type: ignore[arg-type]
    prepared = integration.prepare_loader(accelerator, loader, register_for_checkpointing=False)
    assert (
        isinstance(prepared, integration.AcceleratedLoader)
        and accelerator.prepare(prepared) is prepared
    )
    with pytest.raises(TypeError, match="already prepared"):
        integration.prepare_loader(accelerator, prepared)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="skip_first_batches\\(\\) is not needed"):
        accelerator.skip_first_batches(prepared, 2)
    with pytest.raises(ValueError, match="`state_prefix` must be a non-empty"):
        integration.prepare_loader(accelerator, loader, state_prefix="a/b")
    saved = integration.prepare_loader(accelerator, loader)
    with pytest.raises(ValueError, match="already saves its state files as 'energy_loader'"):
        integration.prepare_loader(accelerator, el.SavableDataLoader(ah.pipeline()))
    # Accelerate's own registration would keep the main process's state only: refused.
    with pytest.raises(ValueError, match="state_dict"):
        accelerator.register_for_checkpointing(saved)


# -- two processes -----------------------------------------------------------------------------


def _read(workdir: Path, name: str, rank: int) -> dict[str, Any]:
    return torch.load(workdir / f"{name}_rank{rank}.pt", weights_only=False)


def _kill_and_resume(workdir: Path, **options: Any) -> Path:
    """Two ranks with a worker each: uninterrupted; saved after step SAVE_AT and SIGKILLed two
    steps later; resumed by fresh processes. The files each rank wrote are in the directory."""
    launch = dict(timeout=150, torchrun_env=True, workers=1, **options)
    dh.launch(
        ah.train_on_ranks, 2, workdir, exitcode=-signal.SIGKILL, save_at=SAVE_AT,
        kill_at=SAVE_AT + 2, **launch,
    )  # fmt: skip
    dh.launch(ah.resume_on_ranks, 2, workdir, **launch)
    return workdir


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pipeline loader, killed and resumed (:func:`_kill_and_resume`)."""
    return _kill_and_resume(tmp_path_factory.mktemp("accelerate_ranks"))


@pytest.fixture(scope="module")
def two_ranks_dropin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drop-in loader (a torch Dataset under a DistributedSampler), killed and resumed."""
    return _kill_and_resume(tmp_path_factory.mktemp("accelerate_dropin"), dropin=True)


@pytest.mark.slow  # two torchrun-style ranks killed and resumed, ~20 s; test_distributed kills
@pytest.mark.timeout(300)  # and resumes rank programs in the default run
@pytest.mark.parametrize("run", ["two_ranks", "two_ranks_dropin"])
def test_two_processes_killed_mid_epoch_resume_every_rank_exactly(
    run: str, request: pytest.FixtureRequest
) -> None:
    two_ranks: Path = request.getfixturevalue(run)
    assert sorted(p.name for p in (two_ranks / "checkpoint").glob("energy_loader_*")) == [
        "energy_loader_rank_00000_of_00002.pt",
        "energy_loader_rank_00001_of_00002.pt",
    ]
    ranks = [{n: _read(two_ranks, n, r) for n in ("full", "head", "tail")} for r in range(2)]
    for runs in ranks:
        assert len(runs["full"]["seen"]) == 12  # 6 batches a rank and epoch, 2 epochs
        assert len(runs["head"]["seen"]) == SAVE_AT + 3
        assert runs["head"]["seen"][: SAVE_AT + 1] + runs["tail"]["seen"] == runs["full"]["seen"]
        assert torch.equal(runs["tail"]["weight"], runs["full"]["weight"])
    samples = [i for runs in ranks for _, batch, *_ in runs["full"]["seen"][:6] for i in batch]
    assert sorted(samples) == list(range(48))  # the ranks read disjoint halves of an epoch


@pytest.mark.slow  # (the two_ranks fixture's job)
@pytest.mark.timeout(300)
def test_a_two_process_checkpoint_resumes_on_one_process(two_ranks: Path) -> None:
    """Two ranks x one worker and one process x two workers run the same 2 partitions: the
    one process continues the job's stream (rank 0's and rank 1's batches, step by step)."""
    full = [_read(two_ranks, "full", r)["seen"] for r in range(2)]
    stream = [step for pair in zip(*full, strict=True) for step in pair]
    tail, _ = ah.train(2, two_ranks / "checkpoint", length=48)
    assert tail == stream[2 * (SAVE_AT + 1) :]
