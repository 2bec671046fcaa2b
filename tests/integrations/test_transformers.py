"""Hugging Face Trainer: a run stopped at step k and resumed trains on the same batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import energy_loader as el
from tests import distributed_helpers as dh
from tests.helpers import LazyModule
from tests.integrations.conftest import stop_workers

# Transformers is imported by the first test that runs, not at collection (LazyModule says why).
th = LazyModule("tests.integrations.trainer_helpers")
integration = LazyModule("energy_loader.integrations.transformers")

VOCAB, TOKENS, SAMPLES, BATCH = 64, 8, 45, 4
TOTAL_STEPS = 30  # 12 batches per epoch


def make_sample(index: int) -> dict[str, Any]:
    """Tokens whose first one is the sample's index, so a batch names its samples."""
    tokens = (torch.arange(TOKENS) * 7 + index) % VOCAB
    tokens[0] = index
    return {"input_ids": tokens, "labels": tokens.clone()}


def _loader(workers: int) -> el.SavableDataLoader:
    source = el.IndexedSource.from_fn(SAMPLES, make_sample, shuffle=True, seed=5)
    return el.SavableDataLoader(el.BatchDataset(source, BATCH), num_workers=workers)


def _trainer(out: Path, workers: int, stop: int = 0, callbacks: list[Any] | None = None) -> Any:
    """A ``trainer_helpers.RecordingTrainer`` of a one-layer GPT-2 on :func:`_loader`."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=TOKENS, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=TOTAL_STEPS,
        save_steps=stop or TOTAL_STEPS,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        logging_steps=1000,
        disable_tqdm=True,
        seed=3,
    )
    return th.RecordingTrainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_loader=_loader(workers),
        callbacks=callbacks,
    )


@pytest.mark.parametrize(
    ("workers", "stop"),
    [(0, 17), (2, 17), (2, 12)],
    ids=["mid-epoch", "mid-epoch-2-workers", "epoch-end-2-workers"],
)
def test_resume_from_checkpoint_trains_on_exactly_the_remaining_batches(
    tmp_path: Path, workers: int, stop: int
) -> None:
    reference = _trainer(tmp_path / "reference", workers)
    reference.train()
    stop_workers(reference.train_loader)
    assert len(reference.trained) == TOTAL_STEPS

    stopped = _trainer(tmp_path / "run", workers, stop, callbacks=[th.StopAt(stop)])
    stopped.train()
    stop_workers(stopped.train_loader)
    assert len(stopped.trained) == stop
    checkpoint = tmp_path / "run" / f"checkpoint-{stop}"
    assert list(checkpoint.glob("energy_loader_rank_*.pt")), "the loader state is in the folder"

    resumed = _trainer(tmp_path / "run", workers, stop)
    resumed.train(resume_from_checkpoint=True)
    stop_workers(resumed.train_loader)
    assert stopped.trained + resumed.trained == reference.trained
    # Trainer's state.epoch in the resumed epoch counts the batches before the checkpoint.
    assert stopped.epochs + resumed.epochs == reference.epochs
    for a, b in zip(resumed.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)


def test_arguments_are_checked(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    SavableLoaderTrainer = integration.SavableLoaderTrainer
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=4, n_layer=1, n_head=1))
    with pytest.raises(TypeError, match="`train_loader` must be an energy_loader"):
        SavableLoaderTrainer(model=model, args=args, train_loader=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="either `train_loader` or `train_dataset`"):
        SavableLoaderTrainer(model=model, args=args, train_loader=_loader(0), train_dataset=[1])
    trainer = SavableLoaderTrainer(model=model, args=args, train_loader=_loader(0))
    with pytest.raises(ValueError, match="no checkpoint found"):
        trainer.train(resume_from_checkpoint=True)


# -- drop-in loaders, epochs, accumulation, loaders without len(), other layouts ---------------


def _by_epoch(batches: list[list[int]], per_epoch: int) -> list[list[int]]:
    rows = [row for batch in batches for row in batch]
    size = per_epoch * th.BATCH
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def test_a_distributed_sampler_gets_set_epoch_every_epoch(tmp_path: Path) -> None:
    run = th.run(tmp_path, th.loader("distributed", 2), epochs=3)
    assert _by_epoch(run.trained, 10) == [th.distributed_permutation(e, 1, 0) for e in range(3)]


def test_accumulation_that_does_not_divide_the_epoch_resumes_exactly(tmp_path: Path) -> None:
    """10 batches an epoch in windows of 3, 3, 3, 1 (4 steps): stopped at step 6, mid-epoch 1."""
    reference = th.run(tmp_path / "reference", th.loader("distributed"), accumulation=3)
    assert len(reference.trained) == 20 and reference.state.global_step == 8
    head = th.run(tmp_path / "run", th.loader("distributed"), accumulation=3, save_steps=6, stop=6)
    tail = th.run(tmp_path / "run", th.loader("distributed"), resume=True, accumulation=3)
    assert head.trained + tail.trained == reference.trained
    assert head.epochs + tail.epochs == reference.epochs
    assert torch.equal(tail.model.linear.weight, reference.model.linear.weight)


def test_a_loader_without_len_resumes_with_max_steps(tmp_path: Path) -> None:
    """A drop-in over an IterableDataset (no len()): Trainer plans by max_steps; 14 steps are
    one and a half passes over the stream, stopped mid-pass 0 and resumed."""
    reference = th.run(tmp_path / "reference", th.loader("stream", 2), max_steps=14)
    assert len(reference.trained) == 14
    head = th.run(tmp_path / "run", th.loader("stream", 2), max_steps=14, save_steps=6, stop=6)
    tail = th.run(tmp_path / "run", th.loader("stream", 2), resume=True, max_steps=14)
    assert head.trained + tail.trained == reference.trained
    assert torch.equal(tail.model.linear.weight, reference.model.linear.weight)
    assert sorted(r for b in reference.trained[:10] for r in b) == list(range(th.ROWS))


def _rows_of_ranks(epoch: int, replicas: int, batches: int) -> list[int]:
    """The oracle: the rows ``replicas`` ranks in lockstep took in their first ``batches``."""
    rows = []
    for rank in range(replicas):
        rows += th.distributed_permutation(epoch, replicas, rank)[: batches * th.BATCH]
    return rows


@pytest.mark.parametrize("mode", ["epochs", "max_steps"])
def test_resumed_on_another_number_of_processes_every_row_once_an_epoch(
    tmp_path: Path, mode: str
) -> None:
    """Saved by rank 0 of 2 after step 7 (epoch 1, 2 batches in: rank 1 took its 2 batches
    in lockstep), resumed on one process: the rest of epoch 1 is the 12 rows no rank took,
    then Trainer stops after 2 epochs (or after max_steps=9: 2 more steps); ``state.epoch``
    counts on from the 4 batches of 10 the new layout's epoch had before the checkpoint."""
    options: dict[str, Any] = {"max_steps": 9} if mode == "max_steps" else {}
    for rank in (1, 0):  # each rank's trainer writes its loader file into the checkpoint
        data = th.loader("distributed", replicas=2, rank=rank)
        head = th.run(tmp_path, data, save_steps=7, stop=7, **options)
        rows = [row for batch in head.trained[5:] for row in batch]
        assert rows == th.distributed_permutation(1, 2, rank)[: 2 * th.BATCH]
    tail = th.run(tmp_path, th.loader("distributed", 2), resume=True, **options)
    epoch_1 = _rows_of_ranks(1, 2, 2) + [row for batch in tail.trained for row in batch]
    if mode == "max_steps":
        assert len(tail.trained) == 2 and tail.epochs == [1.5, 1.6]
        return
    assert sorted(epoch_1) == list(range(th.ROWS)), "every row of epoch 1 exactly once"
    assert len(tail.trained) == 6 and tail.state.global_step == 13
    assert tail.epochs == pytest.approx([1.5, 1.6, 1.7, 1.8, 1.9, 2.0])


def test_resumed_on_more_processes_every_row_once_an_epoch(tmp_path: Path) -> None:
    """Saved on one process after step 13 (epoch 1, 3 batches in), resumed as rank 0 and as
    rank 1 of 2 (a trainer each): the two ranks share the rest of epoch 1 and stop with it."""
    head = th.run(tmp_path / "run", th.loader("distributed"), save_steps=13, stop=13)
    tails = []
    for rank in range(2):
        out = tmp_path / f"rank{rank}"
        (out / "checkpoint-13").mkdir(parents=True)
        for file in (tmp_path / "run" / "checkpoint-13").iterdir():
            (out / "checkpoint-13" / file.name).write_bytes(file.read_bytes())
        tails.append(th.run(out, th.loader("distributed", replicas=2, rank=rank), resume=True))
    epoch_1 = th.distributed_permutation(1, 1, 0)[: 3 * th.BATCH]
    assert head.trained[10:] == [epoch_1[i : i + 2] for i in range(0, 6, 2)]
    for tail in tails:
        assert len(tail.trained) == 4  # the 14 rows left, 7 a rank: batches of 2, 2, 2, 1
        epoch_1 += [row for batch in tail.trained for row in batch]
        assert tail.epochs == pytest.approx([1.4, 1.6, 1.8, 2.0])  # 1 batch of 5 before
    assert sorted(epoch_1) == list(range(th.ROWS)), "every row of epoch 1 exactly once"


def test_loaders_that_would_repeat_rows_on_several_processes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"RandomSampler\).*DistributedSampler"):
        integration._check_sharding(th.loader("shuffle", replicas=2, rank=0), 2)
    with pytest.raises(ValueError, match="built for a single rank"):
        integration._check_sharding(th.loader("distributed"), 2)
    integration._check_sharding(th.loader("distributed", replicas=2, rank=1), 2)


def test_a_pipeline_with_len_resumed_on_another_number_of_processes_is_refused(
    tmp_path: Path,
) -> None:
    def pipeline(rank: int, world_size: int) -> el.SavableDataLoader:
        source = el.IndexedSource.from_fn(th.ROWS, th.Rows().__getitem__, shuffle=True, seed=1)
        config = el.WorkerConfig(rank, world_size, 0)
        return el.SavableDataLoader(el.BatchDataset(source, th.BATCH), worker_config=config)

    for rank in (1, 0):
        th.run(tmp_path, pipeline(rank, 2), save_steps=3, stop=3)
    with pytest.raises(ValueError, match=r"saved on 2 process\(es\), this run has 1.*Resume on 2"):
        th.run(tmp_path, pipeline(0, 1), resume=True)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_processes_set_epoch_refusal_and_resume_on_one_and_two(tmp_path: Path) -> None:
    """Trainer on 2 real processes (gloo): a shuffle=True drop-in is refused; under a
    DistributedSampler each epoch is a new order, the ranks' rows disjoint; stopped after step
    7 (epoch 1), resumed on 2 processes (exactly the uninterrupted run's batches) and on one
    (every row of epoch 1 once)."""
    dh.launch(th.trainer_on_ranks, 2, tmp_path, timeout=300, torchrun_env=True, stop=7)
    read = [
        {n: json.loads((tmp_path / f"{n}_rank{r}.json").read_text()) for n in ("full", "head")}
        for r in range(2)
    ]
    for rank, runs in enumerate(read):
        assert "samples with BatchSampler(RandomSampler)" in runs["full"]["refused"]
        expected = [th.distributed_permutation(e, 2, rank) for e in range(2)]
        assert _by_epoch(runs["full"]["trained"], 5) == expected
        assert runs["head"]["trained"] == runs["full"]["trained"][:7]
    dh.launch(th.resume_on_ranks, 2, tmp_path, timeout=300, torchrun_env=True)
    for rank, runs in enumerate(read):
        tail = json.loads((tmp_path / f"tail_rank{rank}.json").read_text())
        assert runs["head"]["trained"] + tail["trained"] == runs["full"]["trained"]
        assert runs["head"]["epochs"] + tail["epochs"] == runs["full"]["epochs"]
    # (the run above saved a last checkpoint: name the one to resume)
    checkpoint = str(tmp_path / "run" / "checkpoint-7")
    one = th.run(tmp_path / "run", th.loader("distributed"), resume=checkpoint)
    epoch_1 = _rows_of_ranks(1, 2, 2) + [row for batch in one.trained for row in batch]
    assert sorted(epoch_1) == list(range(th.ROWS))
    assert len(one.trained) == 6 and one.epochs == pytest.approx([1.5, 1.6, 1.7, 1.8, 1.9, 2])
