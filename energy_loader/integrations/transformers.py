"""Hugging Face ``Trainer``: train from a SavableDataLoader and resume it exactly.

``Trainer`` makes its own ``DataLoader`` from ``train_dataset`` and, on
``train(resume_from_checkpoint=...)``, fast-forwards it by replaying the batches already
trained (accelerate's ``skip_first_batches``), which re-reads them all and cannot work on a
savable loader. :class:`SavableLoaderTrainer` takes the loader instead::

    from energy_loader.integrations.transformers import SavableLoaderTrainer

    loader = el.SavableDataLoader(build_pipeline(), num_workers=2)   # after dist init, if any
    trainer = SavableLoaderTrainer(model=model, args=args, train_loader=loader)
    trainer.train()                                  # or train(resume_from_checkpoint=True)

- ``get_train_dataloader()`` returns the loader (Trainer moves the batches to its device);
  dict batches lose their ``__restore_key__`` entry on the way, because Trainer passes every
  entry to ``model(**batch)`` (audit with ``LogSampleDataset`` instead);
- every checkpoint folder (``checkpoint-<step>``) also gets this rank's loader state
  (``energy_loader_rank_00000_of_00001.pt``, written atomically by ``save_state_rank_file``; no
  collective, one file per data-parallel rank);
- ``train(resume_from_checkpoint=...)`` restores the loader from that folder before training,
  and Trainer's own data skipping is turned off (``args.ignore_data_skip = True``): the loader
  continues where it stood, Trainer's counters (global step, epoch, RNG, optimizer, scheduler)
  come from its own checkpoint files as usual.

A checkpoint is taken after an optimizer step, when every batch Trainer fetched has been
trained on, so the saved position is exactly the trained position. With
``gradient_accumulation_steps > 1`` Trainer numbers the steps of a resumed epoch from zero;
its last, shorter accumulation window then never steps the optimizer, so a resume needs
``len(loader)`` divisible by ``gradient_accumulation_steps`` (checked: ``ValueError``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from typing import Any

try:
    from transformers import Trainer
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as error:  # pragma: no cover - the dev extra installs transformers
    raise ImportError(
        "energy_loader.integrations.transformers needs Hugging Face transformers: "
        "pip install 'energy_loader[integrations]' (or pip install transformers)"
    ) from error

from ..dataset import RESTORE_KEY
from ..distributed import restore_state_rank_file, save_state_rank_file
from ..loader import SavableDataLoader

__all__ = ["STATE_PREFIX", "SavableLoaderTrainer", "TrainerLoader"]

STATE_PREFIX = "energy_loader"


class TrainerLoader:
    """What ``SavableLoaderTrainer.get_train_dataloader`` returns: the loader, keys stripped.

    Iterating it iterates the loader (one epoch) and drops ``__restore_key__`` from dict
    batches; ``len()`` is the loader's. Trainer takes exactly ``len()`` batches per epoch and
    never asks for the end, so the loader's epoch would still be open when Trainer starts the
    next one (and a fresh ``iter()`` of the loader would only report that end). Each new
    iteration therefore first closes the previous epoch: it asks the previous iterator for
    its end, or, right after a restore at an epoch boundary (``end_pending``), iterates the
    loader once to the end it owes.
    """

    def __init__(self, loader: SavableDataLoader) -> None:
        self.loader = loader
        self.end_pending = False
        self._epoch: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        leftover: list[Any] = []
        if self._epoch is not None:
            leftover = list(itertools.islice(self._epoch, 1))
        elif self.end_pending:
            leftover = list(itertools.islice(iter(self.loader), 1))
        if leftover:
            raise RuntimeError(
                "Trainer started a new epoch while the loader's epoch still had batches: "
                "len(loader) does not match what the loader yields"
            )
        self.end_pending = False
        self._epoch = self._batches()
        return self._epoch

    def _batches(self) -> Iterator[Any]:
        for batch in self.loader:
            if isinstance(batch, Mapping) and RESTORE_KEY in batch:
                batch = {k: v for k, v in batch.items() if k != RESTORE_KEY}
            yield batch

    def __len__(self) -> int:
        return len(self.loader)


class SavableLoaderTrainer(Trainer):
    """A ``transformers.Trainer`` that trains from a :class:`SavableDataLoader`.

    Pass ``train_loader=`` instead of ``train_dataset=`` (and no ``data_collator``: the
    pipeline batches). All other arguments are Trainer's. Checkpoints made by Trainer carry
    the loader's position, and ``train(resume_from_checkpoint=path | True)`` continues the
    data stream exactly where that checkpoint stood (see the module docs).
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
        super().__init__(*args, **kwargs)
        self.train_loader = train_loader
        self._trainer_loader = TrainerLoader(train_loader)
        # The loader resumes itself; Trainer replaying batches would skip them a second time.
        self.args.ignore_data_skip = True

    def get_train_dataloader(self) -> Any:
        """The savable loader (wrapped so that batches have no restore-key entry)."""
        return self._trainer_loader

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """Restore the loader from the checkpoint (if any), then ``Trainer.train``."""
        if isinstance(resume_from_checkpoint, bool):
            if resume_from_checkpoint:
                resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
                if resume_from_checkpoint is None:
                    raise ValueError(
                        f"no checkpoint found in output directory {self.args.output_dir}"
                    )
            else:
                resume_from_checkpoint = None
        if resume_from_checkpoint is not None:
            self._restore_loader(str(resume_from_checkpoint))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _restore_loader(self, checkpoint: str) -> None:
        """Restore the loader; note whether the checkpoint closed an epoch (end owed)."""
        steps, length = self.args.gradient_accumulation_steps, len(self.train_loader)
        if steps > 1 and length % steps:
            raise ValueError(
                f"resuming with gradient_accumulation_steps={steps} needs batches per epoch "
                f"divisible by it (the loader has {length}): Trainer restarts its step count "
                "in a resumed epoch, so its last, shorter accumulation window would not step "
                "the optimizer. Use a batch count or accumulation that divides"
            )
        restore_state_rank_file(self.train_loader, checkpoint, STATE_PREFIX)
        state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        batches = state.global_step * steps
        self._trainer_loader.end_pending = batches > 0 and batches % length == 0

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        save_state_rank_file(self.train_loader, folder, STATE_PREFIX)
