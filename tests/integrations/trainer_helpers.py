"""A tiny model, a row dataset and Trainer runs for the SavableLoaderTrainer tests, on one
process or as rank programs on several (started by tests/distributed_helpers.launch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler, IterableDataset
from transformers import TrainerCallback, TrainingArguments

import energy_loader as el
from energy_loader.integrations.transformers import SavableLoaderTrainer
from tests.integrations.conftest import stop_workers

ROWS, BATCH, SEED = 20, 2, 7


class Rows(Dataset[dict[str, Any]]):
    """Row ``i`` is ``{"x": [i], "index": i}``: a batch names its rows."""

    def __init__(self, length: int = ROWS) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": torch.tensor([float(index)]), "index": index}


class RowStream(IterableDataset[dict[str, Any]]):
    """The rows as a stream without ``len()`` (each worker copy streams its share)."""

    def __init__(self, length: int = ROWS) -> None:
        self.length = length

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(first, self.length, step):
            yield {"x": torch.tensor([float(index)]), "index": index}


class Tiny(torch.nn.Module):
    """One weight; Trainer passes each batch as keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.linear(x / ROWS) - 1).pow(2).mean()}


class Recording(SavableLoaderTrainer):
    """Records the rows of every batch it trains on, with Trainer's epoch and state.epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list[list[int]] = []
        self.epochs: list[float] = []
        self.add_callback(_EpochLog(self.epochs))

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any) -> torch.Tensor:
        self.trained.append(inputs["index"].tolist())
        return super().training_step(model, inputs, *args)


class RecordingTrainer(Recording):
    """:class:`Recording` for token samples whose first token is the sample's index
    (test_transformers' GPT-2 runs)."""

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any) -> torch.Tensor:
        assert set(inputs) == {"input_ids", "labels"}, "the restore key must not reach the model"
        self.trained.append(inputs["input_ids"][:, 0].tolist())
        return SavableLoaderTrainer.training_step(self, model, inputs, *args)


class _EpochLog(TrainerCallback):  # type: ignore[misc]
    def __init__(self, epochs: list[float]) -> None:
        self.epochs = epochs

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.epochs.append(state.epoch)
        return control


class StopAt(TrainerCallback):  # type: ignore[misc]
    """A preemption: stop right after step ``step`` (its checkpoint is saved first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def loader(
    kind: str, workers: int = 0, *, replicas: int | None = None, rank: int | None = None
) -> el.SavableDataLoader:
    """``distributed``: a drop-in under a DistributedSampler (of this process group, or of
    ``replicas``/``rank``); ``shuffle``: a drop-in with shuffle=True; ``stream``: a drop-in
    over :class:`RowStream` (no len())."""
    options: dict[str, Any] = {"batch_size": BATCH, "num_workers": workers}
    if workers:
        options["multiprocessing_context"] = "fork"
    if replicas is None and not dist.is_initialized():
        replicas, rank = 1, 0
    if replicas is not None:
        options["worker_config"] = el.WorkerConfig(rank or 0, replicas, workers)
    if kind == "stream":
        return el.SavableDataLoader(RowStream(), **options)
    if kind == "shuffle":
        return el.SavableDataLoader(Rows(), shuffle=True, **options)
    sampler = DistributedSampler(Rows(), num_replicas=replicas, rank=rank, seed=SEED)
    return el.SavableDataLoader(Rows(), sampler=sampler, **options)


def trainer(
    out: Path,
    data: el.SavableDataLoader,
    *,
    epochs: float = 2,
    max_steps: int = -1,
    accumulation: int = 1,
    save_steps: int = 1000,
    stop: int = 0,
) -> Recording:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=epochs,
        max_steps=max_steps,
        gradient_accumulation_steps=accumulation,
        save_steps=save_steps,
        learning_rate=0.1,
        use_cpu=True,
        report_to=[],
        logging_steps=1000,
        disable_tqdm=True,
        seed=3,
    )
    return Recording(
        model=Tiny(), args=args, train_loader=data, callbacks=[StopAt(stop)] if stop else None
    )


def run(
    out: Path, data: el.SavableDataLoader, resume: bool | str = False, **options: Any
) -> Recording:
    """Train (or resume from the last checkpoint in ``out``, or from the checkpoint folder
    ``resume``), stop the loader's workers."""
    run_ = trainer(out, data, **options)
    try:
        run_.train(resume_from_checkpoint=resume or None)
    finally:
        stop_workers(data)
    return run_


def distributed_permutation(epoch: int, replicas: int, rank: int) -> list[int]:
    """The oracle: the rows a DistributedSampler(seed=SEED) gives ``rank`` in ``epoch``,
    written out from its definition (shuffle by a generator seeded seed + epoch, pad to a
    multiple of the replicas, every ``replicas``-th from ``rank``)."""
    generator = torch.Generator()
    generator.manual_seed(SEED + epoch)
    order = torch.randperm(ROWS, generator=generator).tolist()
    total = -(-ROWS // replicas) * replicas
    order += order[: total - len(order)]
    return order[rank:total:replicas]


# -- rank programs -------------------------------------------------------------------------------


def _report(workdir: Path, name: str, rank: int, run_: Recording, **extra: Any) -> None:
    record = {"trained": run_.trained, "epochs": run_.epochs, **extra}
    (workdir / f"{name}_rank{rank}.json").write_text(json.dumps(record))


def trainer_on_ranks(rank: int, world_size: int, workdir: Path, *, stop: int) -> None:
    """Each rank: a loader over rows with shuffle=True is refused; an uninterrupted run and a
    run stopped after step ``stop`` (its checkpoint in ``workdir/run``), under a
    DistributedSampler; what each trained goes to ``<name>_rank<r>.json``."""
    assert dist.is_initialized()
    try:
        trainer(workdir / "refused", loader("shuffle"))
    except ValueError as error:
        refused = str(error)
    else:
        refused = ""
    _report(workdir, "full", rank, run(workdir / "full", loader("distributed")), refused=refused)
    stopped = run(workdir / "run", loader("distributed"), save_steps=stop, stop=stop)
    _report(workdir, "head", rank, stopped)


def resume_on_ranks(rank: int, world_size: int, workdir: Path) -> None:
    """Each rank resumes the last checkpoint in ``workdir/run`` and trains to the end."""
    _report(workdir, "tail", rank, run(workdir / "run", loader("distributed"), resume=True))
