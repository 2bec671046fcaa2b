"""Lightning integration: save the loader's position as of the batch Lightning last trained on.

:class:`SavableLoaderCallback` tells each loader how many batches Lightning fetched ahead when
it saves, gathers all ranks' states into the checkpoint, and refuses a resume whose loader
state Lightning never loaded. See docs/integrations-lightning.md.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from ..dataset import is_stateful
from ..distributed import save_state_global
from ..errors import EnergyLoaderError
from ..loader import SavableDataLoader
from ..loader.dropin.build import runs_dropin
from ..process_groups import process_group_initialized
from ..validation import require_bool

try:  # the unified package, if the user has it; otherwise the standalone one
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:
    from pytorch_lightning import Callback, LightningModule, Trainer

__all__ = ["LoaderStateNotLoadedError", "SavableLoaderCallback", "held_back_batches"]


class LoaderStateNotLoadedError(EnergyLoaderError, RuntimeError):
    """Lightning resumed from a checkpoint with loader state but never gave it to the loader."""


def held_back_batches(trainer: Trainer) -> int:
    """How many train batches ``trainer`` has fetched but not yet handed to ``training_step``:
    the fit loop's fetcher's ``batches`` (one while a loader of unknown length is mid-epoch).
    """
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    prefetched = getattr(fetcher, "batches", None)
    return len(prefetched) if isinstance(prefetched, list) else 0


def _held_back(trainer_ref: weakref.ref[Trainer]) -> int:
    trainer = trainer_ref()
    return 0 if trainer is None else held_back_batches(trainer)


def _train_loaders(trainer: Trainer) -> list[Any]:
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return [] if combined is None else list(combined.flattened)


def _runs_on_several_ranks(loader: Any) -> bool:
    return (
        isinstance(loader, SavableDataLoader)
        and loader.worker_config.world_size > 1
        and process_group_initialized()
    )


def _count_the_resumed_epoch_as_the_loader_deals_it(trainer: Trainer) -> None:
    """Make Lightning's batch count of a resumed epoch end where the loader's batches end: a
    drop-in resumed on another layout deals the rest anew, so the counters become ``len(loader) -
    batches left`` (docs/integrations-lightning.md, "Several ranks").
    """
    loaders = _train_loaders(trainer)
    if len(loaders) != 1 or not runs_dropin(loaders[0]):
        return
    left = loaders[0].resumed_batches_left
    if left is None or trainer.num_training_batches != len(loaders[0]):
        return  # not a resumed epoch, or limit_train_batches cuts the epoch anyway
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = len(loaders[0]) - left - current.ready
    for counter in ("ready", "started", "processed", "completed"):
        setattr(current, counter, getattr(current, counter) + shift)


class SavableLoaderCallback(Callback):
    """Makes Lightning checkpoints of a :class:`~energy_loader.SavableDataLoader` resume exactly.

    Saves nothing of its own. At the start of training and of each epoch it sets
    ``held_back_source`` on every ``SavableDataLoader`` among the train dataloaders (cleared at
    teardown). On several ranks every checkpoint gets all ranks' loader states, so the callback
    must be in every rank's callbacks (as Lightning requires anyway).
    """

    def __init__(self, *, check_resume: bool = True) -> None:
        """``check_resume=False`` lets a resume go on when Lightning did not load the saved
        loader state (the data then restarts wherever the fresh loader starts)."""
        super().__init__()
        self._check_resume = require_bool(check_resume, "check_resume")
        self._loaders: list[SavableDataLoader] = []

    def _attach(self, trainer: Trainer) -> None:
        source = functools.partial(_held_back, weakref.ref(trainer))
        for loader in _train_loaders(trainer):
            if isinstance(loader, SavableDataLoader):
                loader.held_back_source = source
                if loader not in self._loaders:
                    self._loaders.append(loader)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._attach(trainer)
        _count_the_resumed_epoch_as_the_loader_deals_it(trainer)
        # The fit loop keeps the checkpoint's loader states until it hands them to the loaders
        # (when it sets up the train dataloader); still holding them now means it never will.
        unloaded = getattr(trainer.fit_loop, "_combined_loader_states_to_load", None)
        if self._check_resume and unloaded and self._loaders:
            raise LoaderStateNotLoadedError(
                "Lightning resumed from a checkpoint that holds the train loader's state but "
                "never passed it to the loader's load_state_dict(), so the data would restart "
                "from the beginning of the epoch. The known cause: "
                "`trainer.estimated_stepping_batches` read in configure_optimizers() while "
                "`max_epochs` is set (Lightning then builds the train dataloader before it reads "
                "the checkpoint). Compute the number of steps yourself (len(loader) * max_epochs "
                "// accumulate_grad_batches), or train with `max_steps` and leave `max_epochs` "
                "unset; SavableLoaderCallback(check_resume=False) silences this check"
            )

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._attach(trainer)

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Put every rank's loader state into the checkpoint (rank 0's is the one written).

        For each ``SavableDataLoader`` on several ranks, gathers all ranks' states to rank 0 (a
        collective) and replaces this rank's entry in the fit loop's ``combined_loader`` state with
        them, in ``state_dict()``'s layout (``loader.state_dict_of_ranks``).
        """
        # The train loaders whose states Lightning saves, in its order (the _Stateful ones).
        loaders = [loader for loader in _train_loaders(trainer) if is_stateful(loader)]
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        saved = fit_state.get("combined_loader")
        if not isinstance(saved, list) or len(saved) != len(loaders):
            return  # nothing of the train loaders in this checkpoint
        held_back = held_back_batches(trainer)
        for index, loader in enumerate(loaders):
            if not _runs_on_several_ranks(loader):
                continue
            states = save_state_global(loader, 0, held_back=held_back)
            if states is not None:
                saved[index] = loader.state_dict_of_ranks(states)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for loader in self._loaders:
            loader.held_back_source = None
        self._loaders.clear()
