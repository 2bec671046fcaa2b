"""Lightning integration: save the loader's position as of the batch Lightning last trained on.

Why. Lightning saves a train dataloader that has ``state_dict``/``load_state_dict`` with the
checkpoint (the fit loop stores ``loader.state_dict()`` under ``combined_loader``) and loads it
on ``fit(ckpt_path=...)``. For a loader *without* ``len()`` (a filter, a stream, an endless
pipeline) its ``_PrefetchDataFetcher`` reads one batch ahead, to know whether the batch it
trains on is the last; a checkpoint taken then holds a batch that was handed out but not
trained on, and a resume would skip it. For a loader *with* ``len()`` it does not prefetch.

How. :class:`SavableLoaderCallback` points each :class:`~energy_loader.SavableDataLoader` of
the fit loop at a function that counts the batches Lightning holds untrained right now; the
loader's ``state_dict()`` saves with that many items held back. A callback rather than a
loader option because only the trainer knows, at the moment it saves, whether it holds a
batch: prefetching depends on the loader's length, on ``training_step(dataloader_iter)``, and
on whether the epoch's end was already seen (then nothing is held). The count is read when the
state is saved, so checkpoints taken in any hook are right.

Example::

    import pytorch_lightning as pl  # or: import lightning.pytorch as pl
    from energy_loader.integrations.lightning import SavableLoaderCallback

    loader = el.SavableDataLoader(pipeline, num_workers=2)
    trainer = pl.Trainer(max_epochs=2, callbacks=[SavableLoaderCallback(), checkpointing])
    trainer.fit(model, train_dataloaders=loader, ckpt_path=last_checkpoint_or_none)

Several ranks (``strategy="ddp"``). Lightning builds the checkpoint on every rank but writes
rank 0's only, so by itself it would store rank 0's loader position and hand it to every rank
on resume. When the loader runs on several ranks, the callback gathers every rank's state to
rank 0 as the checkpoint is made (:func:`energy_loader.distributed.save_state_global`, a
collective: Lightning makes checkpoints on all ranks at once) and stores them where
Lightning keeps the loader's state, laid out by the loader (``state_dict_of_ranks``: one entry
per logical partition for a pipeline, one per rank for a drop-in loader over a plain torch
dataset). On ``fit(ckpt_path=...)`` each rank's loader takes its own part -- a pipeline on the
same number of ranks or on another one whose layout divides its ``num_partitions``, a drop-in
loader on the same number of ranks. Gathered into the checkpoint
rather than written beside it: the checkpoint stays one file that ``ModelCheckpoint`` can
rotate, copy to ``last.ckpt`` or delete without leaving stale loader files behind.
Keep ``use_distributed_sampler`` as it is: Lightning leaves a loader over a savable pipeline
(an iterable dataset inside, sharded by rank by the loader itself) as it is, and rebuilds a
drop-in loader over a map-style dataset with a ``DistributedSampler``, as it does torch's.

It also refuses a resume that Lightning did not pass the loader's state to: in Lightning
2.x, reading ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` with
``max_epochs`` set builds the train dataloader before the checkpoint is read, and the saved
loader state is then never loaded -- the run would silently restart the epoch. See
docs/integrations-lightning.md for the workarounds.

Thread-safety: the count is read on the trainer's thread, where Lightning saves.
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

try:  # the unified package, if the user has it; otherwise the standalone one
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:
    from pytorch_lightning import Callback, LightningModule, Trainer

__all__ = ["LoaderStateNotLoadedError", "SavableLoaderCallback", "held_back_batches"]


class LoaderStateNotLoadedError(EnergyLoaderError, RuntimeError):
    """Lightning resumed from a checkpoint with loader state but never gave it to the loader."""


def held_back_batches(trainer: Trainer) -> int:
    """How many train batches ``trainer`` has fetched but not yet handed to ``training_step``.

    Reads the fit loop's data fetcher: its ``batches`` list holds the batches fetched ahead
    (one while a loader of unknown length is mid-epoch; none for a sized loader, after the
    epoch's end was seen, or with ``training_step(dataloader_iter)``, where the user fetches).
    """
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    prefetched = getattr(fetcher, "batches", None)
    return len(prefetched) if isinstance(prefetched, list) else 0


def _held_back(trainer_ref: weakref.ref[Trainer]) -> int:
    trainer = trainer_ref()
    return 0 if trainer is None else held_back_batches(trainer)


def _runs_on_several_ranks(loader: Any) -> bool:
    return (
        isinstance(loader, SavableDataLoader)
        and loader.worker_config.world_size > 1
        and process_group_initialized()
    )


def _count_the_resumed_epoch_as_the_loader_deals_it(trainer: Trainer) -> None:
    """Make Lightning's batch count of a resumed epoch end where the loader's batches end.

    Lightning ends an epoch of a loader with ``len()`` when it has fetched ``len(loader)``
    batches, counting from the batches the checkpoint says were trained
    (``batch_progress.current.ready``). A drop-in loader restored on another number of ranks
    or another batch size deals the rest of the epoch anew: on more ranks each rank has
    more batches left than ``len(loader) - ready`` (Lightning would stop early and skip them),
    on fewer ranks fewer (its iterator ends first). Called at ``on_train_start`` (after
    Lightning loaded the loader's state and made its iterator, before the epoch loop adds
    ``ready`` to its fetcher's count; ``on_train_epoch_start`` is skipped on a mid-epoch
    resume), this sets the epoch's counters
    to ``len(loader) - batches left``: the epoch then ends on the loader's last batch (and
    ``batch_idx`` counts on from there). On the same layout it changes nothing. Without the
    callback the loader refuses such a resume at the epoch's first batch
    (:mod:`energy_loader.loader.dropin.trainers`); attaching ``held_back_source`` first (in
    :meth:`SavableLoaderCallback.on_train_start`) is what tells it the count is corrected.
    """
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = [] if combined is None else list(combined.flattened)
    if len(loaders) != 1 or not runs_dropin(loaders[0]):
        return
    left = loaders[0].resumed_batches_left
    if left is None or trainer.num_training_batches != len(loaders[0]):
        return  # not a resumed epoch, or limit_train_batches cuts the epoch anyway
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = len(loaders[0]) - left - current.ready
    current.ready += shift
    current.started += shift
    current.processed += shift
    current.completed += shift


class SavableLoaderCallback(Callback):
    """Makes Lightning checkpoints of a :class:`~energy_loader.SavableDataLoader` resume exactly.

    Saved state: nothing of its own. At the start of training (and of each epoch, so loaders
    reloaded by ``reload_dataloaders_every_n_epochs`` are covered) it sets
    ``held_back_source`` on every ``SavableDataLoader`` among the train dataloaders, and
    clears it at teardown. Other loaders are left alone. With several train dataloaders each
    fetched batch holds one item of each loader. On several ranks, every checkpoint gets all
    ranks' loader states (:meth:`on_save_checkpoint`); the callback must then be in the
    callbacks of every rank, as Lightning requires of callbacks anyway.
    """

    def __init__(self, *, check_resume: bool = True) -> None:
        """``check_resume=False`` lets a resume go on when Lightning did not load the saved
        loader state (the data then restarts wherever the fresh loader starts)."""
        super().__init__()
        if not isinstance(check_resume, bool):
            raise TypeError(f"`check_resume` must be True or False (got {check_resume!r})")
        self._check_resume = check_resume
        self._loaders: list[SavableDataLoader] = []

    def _attach(self, trainer: Trainer) -> None:
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        loaders = [] if combined is None else list(combined.flattened)
        source = functools.partial(_held_back, weakref.ref(trainer))
        for loader in loaders:
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

        Lightning has already stored each loader's ``state_dict()`` of *this* rank under
        ``loops.fit_loop.state_dict.combined_loader``; for every ``SavableDataLoader`` that runs
        on several ranks this gathers all ranks' states to rank 0 (a collective over the
        loader's data-parallel group) and replaces rank 0's entry with theirs, in the layout of
        ``state_dict()`` (``loader.state_dict_of_ranks``), which ``load_state_dict`` on every
        rank reads its own part of.
        """
        loaders = self._stateful_train_loaders(trainer)
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

    @staticmethod
    def _stateful_train_loaders(trainer: Trainer) -> list[Any]:
        """The train loaders whose states Lightning saves, in its order (``_Stateful`` ones)."""
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        if combined is None:
            return []
        return [loader for loader in combined.flattened if is_stateful(loader)]

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for loader in self._loaders:
            loader.held_back_source = None
        self._loaders.clear()
