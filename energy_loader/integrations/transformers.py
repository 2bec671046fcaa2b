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

import os
from collections.abc import Iterator, Mapping
from typing import Any

try:
    from transformers import Trainer
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
    batches, because Trainer passes every entry of a batch to ``model(**batch)``; ``len()`` is
    the loader's. Trainer takes exactly ``len()`` batches per epoch and never asks for the end;
    the loader counts an epoch whose batches have all been taken as over, so the next
    ``iter()`` starts the next epoch, also right after a restore at an epoch boundary.
    """

    def __init__(self, loader: SavableDataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
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
        """Restore the loader from the state file in the checkpoint folder."""
        steps, length = self.args.gradient_accumulation_steps, len(self.train_loader)
        if steps > 1 and length % steps:
            raise ValueError(
                f"resuming with gradient_accumulation_steps={steps} needs batches per epoch "
                f"divisible by it (the loader has {length}): Trainer restarts its step count "
                "in a resumed epoch, so its last, shorter accumulation window would not step "
                "the optimizer. Use a batch count or accumulation that divides"
            )
        restore_state_rank_file(self.train_loader, checkpoint, STATE_PREFIX)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        save_state_rank_file(self.train_loader, folder, STATE_PREFIX)
