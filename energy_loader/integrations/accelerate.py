"""Hugging Face Accelerate: a SavableDataLoader on the accelerator's device, saved with it.

``accelerator.prepare(loader)`` cannot keep a ``SavableDataLoader``: Accelerate builds a new
``DataLoader`` over ``loader.dataset`` (for a savable loader that is its internal worker-side
dataset, not the pipeline), shards or dispatches its batches across processes a second time,
and saves nothing of its position, so it raises a ``TypeError`` naming
:func:`prepare_loader` at the call (the loader's ``_is_accelerate_prepared`` attribute,
which ``Accelerator.prepare_data_loader`` reads first). :func:`prepare_loader` is the
replacement::

    from energy_loader.integrations.accelerate import prepare_loader

    accelerator = Accelerator()                       # first: it sets up torch.distributed
    loader = el.SavableDataLoader(build_pipeline(), num_workers=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = prepare_loader(accelerator, loader)      # instead of accelerator.prepare(loader)
    accelerator.load_state(checkpoint_dir)            # on resume: the loader continues exactly
    for batch in loader:                              # batches already on accelerator.device
        ...
        accelerator.save_state(checkpoint_dir)        # saves the loader's position too

The loader keeps sharding by rank itself (each rank reads its own part of the data, as
without Accelerate). Its state is saved by every rank into the checkpoint directory, one file
per data-parallel rank (``energy_loader_rank_00001_of_00004.pt``, written atomically by
:func:`~energy_loader.distributed.save_state_rank_file`), from a hook that
``accelerator.save_state`` runs on every process that calls it; ``accelerator.load_state``
runs the matching hook, and each rank reads its own file back
(:func:`~energy_loader.distributed.restore_state_rank_file`) -- or, on another number of
ranks whose layout divides the loader's ``num_partitions``, the files of the ranks that ran
the partitions it now runs (then every rank must see every file). Per-rank files rather than
Accelerate's ``register_for_checkpointing``: that writes the main process's state only, so the
states would have to be gathered first -- a collective inside ``save_state`` that hangs the
main process when only it calls ``save_state``, and that leaves every node but the first
without the list under ``ProjectConfiguration(save_on_each_node=True)``. A file per rank needs
no collective, costs each rank one small write, and is how the Hugging Face ``Trainer``
integration saves too.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

try:
    from accelerate import Accelerator
    from accelerate.utils import send_to_device
except ImportError as error:  # pragma: no cover - the dev extra installs accelerate
    raise ImportError(
        "energy_loader.integrations.accelerate needs Hugging Face Accelerate: "
        "pip install 'energy_loader[integrations]' (or pip install accelerate)"
    ) from error
from torch.utils.data import DataLoader

from ..distributed import restore_state_rank_file, save_state_rank_file
from ..loader import SavableDataLoader

__all__ = ["STATE_PREFIX", "AcceleratedLoader", "prepare_loader"]

# The name the state files start with: ``energy_loader_rank_00000_of_00002.pt``.
STATE_PREFIX = "energy_loader"

# The state-file prefixes already taken on each accelerator (two loaders must not share one).
_PREFIXES: weakref.WeakKeyDictionary[Accelerator, set[str]] = weakref.WeakKeyDictionary()


class AcceleratedLoader:
    """A :class:`SavableDataLoader` whose batches arrive on ``accelerator.device``.

    Made by :func:`prepare_loader`. Iterating it iterates the loader and moves every tensor
    of a batch to the device (restore keys and other plain values are left as they are).
    Its position is saved by ``accelerator.save_state`` (one file per rank, named by
    ``state_prefix``) and restored by ``accelerator.load_state``; the loader itself is
    ``.loader`` (e.g. for a ``torch.distributed.checkpoint`` save). It has no
    ``state_dict()``: ``accelerator.register_for_checkpointing`` would keep the main
    process's state only. ``accelerator.prepare`` returns it unchanged (it is not a
    ``DataLoader``). Not thread-safe, like the loader.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        loader: SavableDataLoader,
        *,
        non_blocking: bool,
        state_prefix: str | None,
    ) -> None:
        self.accelerator = accelerator
        self.loader = loader
        self.non_blocking = non_blocking
        self.state_prefix = state_prefix

    def __iter__(self) -> Iterator[Any]:
        device, non_blocking = self.accelerator.device, self.non_blocking
        for batch in self.loader:
            yield send_to_device(batch, device, non_blocking=non_blocking)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        """Refused: Accelerate helpers that rebuild a DataLoader from it would break resume."""
        raise TypeError(
            "an energy_loader AcceleratedLoader has no dataset to rebuild a DataLoader from: "
            "it resumes exactly through accelerator.load_state(), so "
            "accelerator.skip_first_batches() is not needed (iterate the loader after "
            "load_state instead)"
        )

    def _save(self, models: Any, weights: Any, output_dir: str) -> None:
        """``save_state``'s pre-hook: write this rank's state file into ``output_dir``."""
        if self.state_prefix is not None:
            save_state_rank_file(self.loader, output_dir, self.state_prefix)

    def _load(self, models: Any, input_dir: str) -> None:
        """``load_state``'s pre-hook: restore this rank from the state files in ``input_dir``."""
        if self.state_prefix is not None:
            restore_state_rank_file(self.loader, input_dir, self.state_prefix)

    def __repr__(self) -> str:
        return f"AcceleratedLoader(device={self.accelerator.device}, loader={self.loader!r})"


def prepare_loader(
    accelerator: Accelerator,
    loader: SavableDataLoader,
    *,
    register_for_checkpointing: bool = True,
    state_prefix: str = STATE_PREFIX,
    non_blocking: bool | None = None,
) -> AcceleratedLoader:
    """Use ``loader`` with ``accelerator``: call this instead of ``accelerator.prepare(loader)``.

    Returns an :class:`AcceleratedLoader` that yields the loader's batches on
    ``accelerator.device``. With ``register_for_checkpointing=True`` (the default)
    ``accelerator.save_state(dir)`` also writes each rank's loader position into ``dir``
    (``<state_prefix>_rank_00001_of_00004.pt``, from every process that calls ``save_state``)
    and ``accelerator.load_state(dir)`` restores it, exactly. A second loader prepared with
    the same accelerator needs its own ``state_prefix`` (``ValueError`` otherwise).
    ``non_blocking`` defaults to the accelerator's ``DataLoaderConfiguration.non_blocking``
    (useful with ``pin_memory=True`` on a GPU).

    Build the ``Accelerator`` before the loader: with several processes the loader needs
    torch.distributed initialised to know its rank. The loader shards by rank itself, so
    Accelerate's ``split_batches`` / ``dispatch_batches`` / ``even_batches`` settings do not
    apply to it. Example::

        loader = prepare_loader(accelerator, el.SavableDataLoader(pipeline, num_workers=2))
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"`accelerator` must be an accelerate.Accelerator (got {type(accelerator).__name__})"
        )
    if isinstance(loader, AcceleratedLoader):
        raise TypeError("`loader` is already prepared: prepare_loader returned it; use it as is")
    if not isinstance(loader, SavableDataLoader):
        inner = getattr(loader, "dataset", None)
        if isinstance(loader, DataLoader) and type(inner).__name__ == "WorkerSideDataset":
            raise TypeError(
                "`loader` is what accelerator.prepare() made of a SavableDataLoader: a new "
                "DataLoader over its internal dataset, which neither yields the pipeline's "
                "batches nor saves its position. Pass the SavableDataLoader itself to "
                "prepare_loader(accelerator, loader) instead of accelerator.prepare(loader)"
            )
        raise TypeError(
            f"`loader` must be an energy_loader SavableDataLoader (got {type(loader).__name__})"
        )
    if not isinstance(register_for_checkpointing, bool):
        raise TypeError("`register_for_checkpointing` must be True or False")
    if non_blocking is None:
        non_blocking = bool(getattr(accelerator, "non_blocking", False))
    elif not isinstance(non_blocking, bool):
        raise TypeError("`non_blocking` must be True, False or None")
    world_size = loader.config()["world_size"]
    if accelerator.num_processes > 1 and world_size == 1:
        raise ValueError(
            f"the accelerator runs {accelerator.num_processes} processes but the loader was "
            "built for a single rank (world_size=1), so every process would read the same "
            "data: create the Accelerator before the SavableDataLoader (it initialises "
            "torch.distributed, which the loader reads), or pass worker_config="
            "WorkerConfig.from_process_group(...)"
        )
    if not isinstance(state_prefix, str) or not state_prefix or "/" in state_prefix:
        raise ValueError(
            "`state_prefix` must be a non-empty file name prefix without path separators "
            f"(got {state_prefix!r})"
        )
    if not register_for_checkpointing:
        return AcceleratedLoader(accelerator, loader, non_blocking=non_blocking, state_prefix=None)
    taken = _PREFIXES.setdefault(accelerator, set())
    if state_prefix in taken:
        raise ValueError(
            f"a loader prepared with this accelerator already saves its state files as "
            f"{state_prefix!r}; pass another `state_prefix` (e.g. state_prefix="
            f"'{state_prefix}_eval') so the two loaders' files do not overwrite each other"
        )
    prepared = AcceleratedLoader(
        accelerator, loader, non_blocking=non_blocking, state_prefix=state_prefix
    )
    taken.add(state_prefix)
    accelerator.register_save_state_pre_hook(prepared._save)
    accelerator.register_load_state_pre_hook(prepared._load)
    return prepared
