"""Hugging Face Trainer: a run stopped at step k and resumed trains on the same batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import energy_loader as el
from energy_loader.integrations.transformers import SavableLoaderTrainer
from tests.integrations.conftest import stop_workers

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


class RecordingTrainer(SavableLoaderTrainer):
    """Records the sample indices of every batch it trains on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list[list[int]] = []

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any) -> torch.Tensor:
        assert set(inputs) == {"input_ids", "labels"}, "the restore key must not reach the model"
        self.trained.append(inputs["input_ids"][:, 0].tolist())
        return super().training_step(model, inputs, *args)


class StopAt(TrainerCallback):
    """A preemption: stop right after step ``step`` (its checkpoint is saved first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _trainer(
    out: Path, workers: int, stop: int = 0, callbacks: list[Any] | None = None
) -> RecordingTrainer:
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
    return RecordingTrainer(
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

    stopped = _trainer(tmp_path / "run", workers, stop, callbacks=[StopAt(stop)])
    stopped.train()
    stop_workers(stopped.train_loader)
    assert len(stopped.trained) == stop
    checkpoint = tmp_path / "run" / f"checkpoint-{stop}"
    assert list(checkpoint.glob("energy_loader_rank_*.pt")), "the loader state is in the folder"

    resumed = _trainer(tmp_path / "run", workers, stop)
    resumed.train(resume_from_checkpoint=True)
    stop_workers(resumed.train_loader)
    assert stopped.trained + resumed.trained == reference.trained
    for a, b in zip(resumed.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)


def test_arguments_are_checked(tmp_path: Path) -> None:
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=4, n_layer=1, n_head=1))
    with pytest.raises(TypeError, match="`train_loader` must be an energy_loader"):
        SavableLoaderTrainer(model=model, args=args, train_loader=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="either `train_loader` or `train_dataset`"):
        SavableLoaderTrainer(model=model, args=args, train_loader=_loader(0), train_dataset=[1])
    trainer = SavableLoaderTrainer(model=model, args=args, train_loader=_loader(0))
    with pytest.raises(ValueError, match="no checkpoint found"):
        trainer.train(resume_from_checkpoint=True)
