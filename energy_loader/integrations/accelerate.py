"""Hugging Face Accelerate: a SavableDataLoader on the accelerator's device, saved with it.

``accelerator.prepare(loader)`` cannot keep a ``SavableDataLoader``: Accelerate builds a new
``DataLoader`` over ``loader.dataset`` (for a savable loader that is its internal worker-side
dataset, not the pipeline), shards or dispatches its batches across processes a second time,
and saves nothing of its position. :func:`prepare_loader` is the replacement::

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
without Accelerate). Its state travels through Accelerate's own extension point,
``register_for_checkpointing``: ``save_state`` gathers every rank's loader state to the main
process (a collective: Accelerate calls it on every rank) and writes the list into
``custom_checkpoint_<i>.pkl``; ``load_state`` reads that list on every rank (the checkpoint
directory must be visible to all ranks, as Accelerate's own custom state requires) and
restores each rank's part, also on a different number of ranks when the loader's partitions
allow it. Register in the same order on resume: Accelerate matches custom states by index.
"""

from __future__ import annotations

import json
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

from ..errors import StateFormatError
from ..loader import SavableDataLoader

__all__ = ["AcceleratedLoader", "prepare_loader"]

STATE_FORMAT = "energy_loader.accelerate"
STATE_VERSION = 1


class AcceleratedLoader:
    """A :class:`SavableDataLoader` whose batches arrive on ``accelerator.device``.

    Made by :func:`prepare_loader`. Iterating it iterates the loader and moves every tensor
    of a batch to the device (restore keys and other plain values are left as they are).
    ``state_dict()`` / ``load_state_dict()`` hold *all ranks'* loader states, for
    ``accelerator.save_state`` / ``load_state``; both are collectives when torch.distributed
    is initialised. ``accelerator.prepare`` returns it unchanged (it is not a ``DataLoader``).
    Not thread-safe, like the loader.
    """

    def __init__(self, accelerator: Accelerator, loader: SavableDataLoader, *, non_blocking: bool):
        self.accelerator = accelerator
        self.loader = loader
        self.non_blocking = non_blocking

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

    def state_dict(self) -> dict[str, Any]:
        """Every rank's loader state (on the main process; ``None`` elsewhere), as JSON."""
        states = self.loader.save_state_global(dst_rank=0)
        ranks = None if states is None else [json.dumps(s, separators=(",", ":")) for s in states]
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part of a state from :meth:`state_dict` (every rank calls it)."""
        if (
            not isinstance(state, dict)
            or state.get("format") != STATE_FORMAT
            or not isinstance(state.get("ranks"), list)
        ):
            raise StateFormatError(
                "not an energy_loader Accelerate loader state (expected a dict with format "
                f"{STATE_FORMAT!r} and the list of rank states; got "
                f"{type(state).__name__}{sorted(state) if isinstance(state, dict) else ''}); "
                "was it saved by a different object registered at this position?"
            )
        if state.get("version") != STATE_VERSION:
            raise StateFormatError(
                f"energy_loader Accelerate loader state version {state.get('version')!r} is not "
                f"supported (this version reads {STATE_VERSION})"
            )
        self.loader.restore_state_global([json.loads(s) for s in state["ranks"]])

    def __repr__(self) -> str:
        return f"AcceleratedLoader(device={self.accelerator.device}, loader={self.loader!r})"


def prepare_loader(
    accelerator: Accelerator,
    loader: SavableDataLoader,
    *,
    register_for_checkpointing: bool = True,
    non_blocking: bool | None = None,
) -> AcceleratedLoader:
    """Use ``loader`` with ``accelerator``: call this instead of ``accelerator.prepare(loader)``.

    Returns an :class:`AcceleratedLoader` that yields the loader's batches on
    ``accelerator.device`` and, with ``register_for_checkpointing=True`` (the default), is
    registered with ``accelerator.register_for_checkpointing`` so that
    ``accelerator.save_state`` / ``load_state`` save and restore the loader's exact position.
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
    prepared = AcceleratedLoader(accelerator, loader, non_blocking=non_blocking)
    if register_for_checkpointing:
        accelerator.register_for_checkpointing(prepared)
    return prepared
