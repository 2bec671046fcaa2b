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

Thread-safety: the count is read on the trainer's thread, where Lightning saves.
"""

from __future__ import annotations

import functools
import weakref

from ..loader import SavableDataLoader

try:  # the unified package, if the user has it; otherwise the standalone one
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:
    from pytorch_lightning import Callback, LightningModule, Trainer

__all__ = ["SavableLoaderCallback", "held_back_batches"]


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


class SavableLoaderCallback(Callback):
    """Makes Lightning checkpoints of a :class:`~energy_loader.SavableDataLoader` resume exactly.

    Saved state: nothing of its own. At the start of training (and of each epoch, so loaders
    reloaded by ``reload_dataloaders_every_n_epochs`` are covered) it sets
    ``held_back_source`` on every ``SavableDataLoader`` among the train dataloaders, and
    clears it at teardown. Other loaders are left alone. With several train dataloaders each
    fetched batch holds one item of each loader.
    """

    def __init__(self) -> None:
        super().__init__()
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

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._attach(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for loader in self._loaders:
            loader.held_back_source = None
        self._loaders.clear()
