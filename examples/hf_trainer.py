"""Hugging Face Trainer with an energy_loader pipeline: stop at a checkpoint, resume exactly.

Runs on CPU in a few seconds with a tiny GPT-2 built from a config (nothing downloaded):

    python examples/hf_trainer.py

1. trains 30 steps uninterrupted, recording which samples each step trained on;
2. trains again, "preempted" right after the checkpoint of step 17 (mid-epoch);
3. resumes from that checkpoint (``train(resume_from_checkpoint=True)``) and checks that the
   two parts together trained on exactly the uninterrupted run's batches.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import energy_loader as el
from energy_loader.integrations.transformers import SavableLoaderTrainer

VOCAB, TOKENS, SAMPLES = 64, 16, 45
STEPS, STOP_AT = 30, 17


def make_sample(index: int) -> dict[str, Any]:
    """A causal-LM sample: tokens (the first one is the sample's index) and labels."""
    tokens = (torch.arange(TOKENS) * 7 + index) % VOCAB
    tokens[0] = index
    return {"input_ids": tokens, "labels": tokens.clone()}


def build_loader() -> el.SavableDataLoader:
    source = el.IndexedSource.from_fn(SAMPLES, make_sample, shuffle=True, seed=5)
    pipeline = el.BatchDataset(el.ShuffleBufferDataset(source, size=8), batch_size=4)
    return el.SavableDataLoader(pipeline, num_workers=2)


class RecordingTrainer(SavableLoaderTrainer):
    """Notes the samples of every batch it trains on (for the comparison at the end)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list[list[int]] = []

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any) -> torch.Tensor:
        self.trained.append(inputs["input_ids"][:, 0].tolist())
        return super().training_step(model, inputs, *args)


class Preempt(TrainerCallback):
    """Stop right after step ``step`` (Trainer saves that step's checkpoint first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def make_trainer(output_dir: Path, callbacks: list[Any] | None = None) -> RecordingTrainer:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=32, n_layer=2, n_head=2)
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        save_steps=STOP_AT,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        logging_steps=10,
        seed=1,
    )
    return RecordingTrainer(
        model=GPT2LMHeadModel(config), args=args, train_loader=build_loader(), callbacks=callbacks
    )


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="energy_loader-hf-"))
    reference = make_trainer(root / "reference")
    reference.train()

    preempted = make_trainer(root / "run", callbacks=[Preempt(STOP_AT)])
    preempted.train()
    resumed = make_trainer(root / "run")
    resumed.train(resume_from_checkpoint=True)  # the newest checkpoint in output_dir

    combined = preempted.trained + resumed.trained
    assert combined == reference.trained, "the resumed run trained on different batches"
    print(
        f"resumed exactly: {len(preempted.trained)} + {len(resumed.trained)} steps == "
        f"{len(reference.trained)} uninterrupted steps, same batches in the same order"
    )


if __name__ == "__main__":
    main()
