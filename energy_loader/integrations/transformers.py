"""Hugging Face ``Trainer``: train from a SavableDataLoader and resume it exactly.

:class:`SavableLoaderTrainer` takes the loader, saves each rank's state into every checkpoint
folder, and on resume restores it and continues Trainer's epoch bookkeeping from the loader's
position. See docs/integrations.md, "Hugging Face Trainer".
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
from torch.utils.data import (
    BatchSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as error:  # pragma: no cover - the dev extra installs transformers
    raise ImportError(
        "energy_loader.integrations.transformers needs Hugging Face transformers: "
        "pip install 'energy_loader[integrations]' (or pip install transformers)"
    ) from error

from ..dataset import RESTORE_KEY
from ..distributed import read_rank_state_files, save_state_rank_file
from ..loader import SavableDataLoader
from ..loader.dropin.build import runs_dropin

__all__ = ["STATE_PREFIX", "SavableLoaderTrainer", "TrainerLoader"]

STATE_PREFIX = "energy_loader"
TRAINER_STATE_NAME = "trainer_state.json"

# torch's samplers that know nothing of ranks: under them every process reads every row.
_RANK_BLIND_SAMPLERS: tuple[type, ...] = (SequentialSampler, RandomSampler, BatchSampler)
_RANK_BLIND_SAMPLERS += (SubsetRandomSampler, WeightedRandomSampler)


def _sampler_chain(loader: SavableDataLoader) -> list[Any]:
    """A map-style drop-in loader's samplers, outermost first (batch sampler, its sampler,
    the loader's sampler), each once; none for a pipeline or an iterable dataset."""
    if not runs_dropin(loader) or isinstance(loader.dataset, IterableDataset):
        return []
    batch_sampler = loader.batch_sampler
    candidates = [batch_sampler, getattr(batch_sampler, "sampler", None), loader.sampler]
    chain: list[Any] = []
    for sampler in candidates:
        if sampler is not None and all(sampler is not seen for seen in chain):
            chain.append(sampler)
    return chain


class TrainerLoader:
    """What ``SavableLoaderTrainer.get_train_dataloader`` returns: the loader, keys stripped.

    Drops ``__restore_key__`` from dict batches (Trainer passes every entry to ``model(**batch)``);
    an epoch whose batches were all taken counts as over; ``set_epoch`` reaches the drop-in's
    samplers that have one.
    """

    def __init__(self, loader: SavableDataLoader) -> None:
        self.loader = loader
        self.taken = 0  # batches handed out by the current epoch's iterator
        # While the epoch a restore continues runs: (its epoch, the batches it had before
        # the checkpoint, its batches in all), for Trainer's ``state.epoch``.
        self.resumed: tuple[int, int, int] | None = None
        self._primed: Iterator[Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of every sampler of the loader that has ``set_epoch`` (what Trainer
        and Accelerate do for a DataLoader of their own), so each epoch has its own order."""
        for sampler in _sampler_chain(self.loader):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def prime(self) -> None:
        """Open the epoch a restore continues now (the next ``iter()`` hands it out), so that
        the loader can say how many of its batches are left before Trainer plans the run."""
        self._primed = iter(self.loader)

    def epoch_progress(self) -> float | None:
        """Trainer's ``state.epoch`` in the epoch a restore continues (None in other epochs)."""
        if self.resumed is None:
            return None
        epoch, before, length = self.resumed
        return epoch + (before + self.taken) / length

    def __iter__(self) -> Iterator[Any]:
        iterator, self._primed = self._primed, None
        if iterator is None:
            iterator = iter(self.loader)
        self.taken = 0
        return self._batches(iterator)

    def _batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            if isinstance(batch, Mapping) and RESTORE_KEY in batch:
                batch = {k: v for k, v in batch.items() if k != RESTORE_KEY}
            self.taken += 1
            yield batch

    def __len__(self) -> int:
        return len(self.loader)


@attrs.frozen
class _Resume:
    """Where a restored loader stands, for Trainer's bookkeeping."""

    epoch: int  # the epoch the loader continues (or starts)
    # Its batches left on this rank: what the loader dealt, or None until Trainer's own
    # arithmetic fills it in (same layout: the batches its steps in the epoch did not take).
    left: int | None
    global_step: int  # the checkpoint's optimizer steps
    length: int | None  # len(loader); None: no len(), Trainer plans by max_steps


class _ResumedEpochProgress(TrainerCallback):  # type: ignore[misc]
    """First of the callbacks: in the epoch a restore continues, ``state.epoch`` counts the
    batches the epoch had before the checkpoint (Trainer counts from the resume point)."""

    def __init__(self, loader: TrainerLoader) -> None:
        self.loader = loader

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        progress = self.loader.epoch_progress()
        if progress is not None:
            state.epoch = progress
        return control


class SavableLoaderTrainer(Trainer):  # type: ignore[misc]
    """A ``transformers.Trainer`` that trains from a :class:`SavableDataLoader`.

    Pass ``train_loader=`` instead of ``train_dataset=`` (no ``data_collator``: the pipeline
    batches). Checkpoints carry the loader's position; ``train(resume_from_checkpoint=path |
    True)`` continues exactly there, on the same or (drop-in under a ``DistributedSampler``)
    another number of processes (docs/integrations.md).
    """

    def __init__(self, *args: Any, train_loader: SavableDataLoader, **kwargs: Any) -> None:
        if not isinstance(train_loader, SavableDataLoader):
            raise TypeError(
                "`train_loader` must be an energy_loader SavableDataLoader "
                f"(got {type(train_loader).__name__})"
            )
        if kwargs.get("train_dataset") is not None:
            raise ValueError(
                "pass either `train_loader` or `train_dataset`, not both: the loader is the "
                "training data"
            )
        if not hasattr(Trainer, "_run_epoch") or not hasattr(
            Trainer, "set_initial_training_values"
        ):
            raise ImportError(
                "SavableLoaderTrainer needs a transformers release whose Trainer has "
                "_run_epoch() and set_initial_training_values() (transformers 5): "
                "pip install -U transformers"
            )
        super().__init__(*args, **kwargs)
        _check_sharding(train_loader, int(self.args.world_size))
        self.train_loader = train_loader
        self._trainer_loader = TrainerLoader(train_loader)
        self._resume: _Resume | None = None
        # The loader resumes itself; Trainer replaying batches would skip them a second time.
        self.args.ignore_data_skip = True
        self.callback_handler.callbacks.insert(0, _ResumedEpochProgress(self._trainer_loader))

    def get_train_dataloader(self) -> Any:
        """The savable loader (wrapped so that batches have no restore-key entry)."""
        return self._trainer_loader

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """Restore the loader from the checkpoint (if any), then ``Trainer.train``."""
        if resume_from_checkpoint is False:
            resume_from_checkpoint = None
        elif resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint found in output directory {self.args.output_dir}")
        self._resume = None
        if resume_from_checkpoint is not None:
            self._resume = self._restore_loader(str(resume_from_checkpoint))
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._resume = None
            self._trainer_loader.resumed = None

    def _restore_loader(self, checkpoint: str) -> _Resume:
        """Restore the loader from the state files in the checkpoint folder; where it stands."""
        path = os.path.join(checkpoint, TRAINER_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{checkpoint} holds no {TRAINER_STATE_NAME}: not a Trainer checkpoint folder "
                "(resume_from_checkpoint takes a checkpoint-<step> folder, or True for the last)"
            )
        global_step = int(TrainerState.load_from_json(path).global_step)
        loader = self.train_loader
        states = read_rank_state_files(loader, checkpoint, STATE_PREFIX)
        first = states[0]  # a pipeline's state (a mapping) or a drop-in's
        saved_world = int(first["world_size"] if isinstance(first, Mapping) else first.world_size)
        try:
            length: int | None = len(loader)
        except TypeError:
            length = None
        world = loader.worker_config.world_size
        pipeline = not runs_dropin(loader)
        if pipeline and length is not None and saved_world != world:
            raise ValueError(
                f"the checkpoint's loader state was saved on {saved_world} process(es), this "
                f"run has {world}: under Trainer a pipeline loader with len() resumes on the "
                "number of processes that saved it (Trainer plans an epoch by len(), and the "
                "rest of a resized epoch per rank is known only by running it). Resume on "
                f"{saved_world} process(es); or train with max_steps from a pipeline without "
                "len(); or use a drop-in loader under a DistributedSampler, which Trainer "
                "resumes on any number of processes"
            )
        loader.restore_from_states(states)
        left: int | None = None
        if length is not None and _sampler_chain(loader):
            # The loader knows how many batches of the epoch it continues are left (after
            # a resize: what the new dealing gives this rank), once that epoch is open.
            self._trainer_loader.set_epoch(loader.epoch)
            self._trainer_loader.prime()
            dealt = getattr(loader, "resumed_batches_left", None)
            left = length if dealt is None else int(dealt)
        return _Resume(loader.epoch, left, global_step, length)

    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        """Trainer's run plan, continued from the loader's position on a resume."""
        values: list[Any] = list(super().set_initial_training_values(args, dataloader))
        resume = self._resume
        if resume is None or resume.length is None:
            return tuple(values)
        num_train_epochs, per_epoch, max_steps = int(values[0]), int(values[1]), int(values[6])
        accumulation = args.gradient_accumulation_steps
        length = resume.length
        trainer_epoch, steps_done = divmod(resume.global_step, per_epoch)
        trainer_left = length - steps_done * accumulation
        if resume.left is None:
            # A pipeline on the layout that saved it: Trainer's arithmetic is exact (and the
            # loader's epoch may still name the epoch a checkpoint at its end finished).
            resume = attrs.evolve(resume, epoch=trainer_epoch, left=trainer_left)
        self._resume = resume
        left = resume.left
        assert left is not None
        if (trainer_epoch, trainer_left) == (resume.epoch, left):
            return tuple(values)  # Trainer's own arithmetic holds (same layout)
        rest = math.ceil(left / accumulation)
        if args.max_steps > 0:
            owed = max(0, max_steps - resume.global_step - rest)
            num_train_epochs = resume.epoch + 1 + math.ceil(owed / per_epoch)
        else:
            if args.num_train_epochs != int(args.num_train_epochs):
                raise ValueError(
                    f"num_train_epochs={args.num_train_epochs} and a resume on another layout "
                    "(number of processes, batch size or accumulation): the steps a fractional "
                    "epoch owes differ between layouts. Use whole epochs, or max_steps"
                )
            num_train_epochs = int(args.num_train_epochs)
            owed_epochs = num_train_epochs - resume.epoch - 1
            max_steps = resume.global_step
            if owed_epochs >= 0:
                max_steps += rest + owed_epochs * per_epoch
        values[0], values[6] = num_train_epochs, max_steps
        return tuple(values)

    def _init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        epochs_trained, steps_in_epoch = super()._init_training_state(*args, **kwargs)
        if self._resume is not None:
            # The loader's epoch, not global_step // steps per epoch of this layout.
            return self._resume.epoch, 0
        return epochs_trained, steps_in_epoch

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """The epoch a restore continues runs the batches the loader has left in it."""
        resume = self._resume
        if (
            args
            or resume is None
            or resume.left is None
            or resume.length is None
            or kwargs.get("epoch") != resume.epoch
            or kwargs.get("resume_from_checkpoint") is None
        ):
            return super()._run_epoch(*args, **kwargs)
        left = resume.left
        kwargs["steps_in_epoch"] = left
        kwargs["num_update_steps_per_epoch"] = math.ceil(
            left / self.args.gradient_accumulation_steps
        )
        self._trainer_loader.resumed = (resume.epoch, resume.length - left, resume.length)
        try:
            return super()._run_epoch(*args, **kwargs)
        finally:
            self._trainer_loader.resumed = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        save_state_rank_file(self.train_loader, folder, STATE_PREFIX)


def _check_sharding(loader: SavableDataLoader, processes: int) -> None:
    """Refuse a loader that would give several processes the same rows."""
    if processes <= 1:
        return
    if loader.worker_config.world_size == 1:
        raise ValueError(
            f"Trainer runs {processes} processes but the loader was built for a single rank "
            "(world_size=1), so every process would read the same data: build the "
            "SavableDataLoader after torch.distributed is initialised (after "
            "TrainingArguments, under torchrun or accelerate launch), or pass worker_config="
            "WorkerConfig.from_process_group(...)"
        )
    chain = _sampler_chain(loader)
    if chain and all(isinstance(s, _RANK_BLIND_SAMPLERS) for s in chain):
        names = "(".join(type(s).__name__ for s in chain) + ")" * (len(chain) - 1)
        raise ValueError(
            f"Trainer runs {processes} processes and the drop-in loader samples with {names}, "
            "which gives every process every row. Shard it as torch does: "
            "SavableDataLoader(dataset, sampler=DistributedSampler(dataset, shuffle=True, "
            "seed=args.seed), batch_size=..., ...) (no shuffle=True); SavableLoaderTrainer "
            "calls its set_epoch() every epoch"
        )
