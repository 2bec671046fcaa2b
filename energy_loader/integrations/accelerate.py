"""Hugging Face Accelerate: a SavableDataLoader on the accelerator's device, saved with it.

``accelerator.prepare(loader)`` raises a ``TypeError`` naming :func:`prepare_loader`, whose
:class:`AcceleratedLoader` makes ``save_state``/``load_state`` write and read one state file
per data-parallel rank (no collective). See docs/integrations.md, "Hugging Face Accelerate".
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

STATE_PREFIX = "energy_loader"

# The state-file prefixes already taken on each accelerator (two loaders must not share one).
_PREFIXES: weakref.WeakKeyDictionary[Accelerator, set[str]] = weakref.WeakKeyDictionary()


class AcceleratedLoader:
    """A :class:`SavableDataLoader` whose batches arrive on ``accelerator.device`` (restore keys and
    plain values stay), made by :func:`prepare_loader`; ``save_state``/``load_state`` carry its
    position, ``.loader`` is the loader. No ``state_dict()``; not thread-safe.
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

    Returns an :class:`AcceleratedLoader` on ``accelerator.device``; with
    ``register_for_checkpointing`` ``save_state``/``load_state`` carry each rank's position
    (``<state_prefix>_rank_00001_of_00004.pt``; a second loader needs its own prefix).
    ``non_blocking`` defaults to the accelerator's. Build the ``Accelerator`` first. Example::

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
    prepared = AcceleratedLoader(accelerator, loader, non_blocking=non_blocking, state_prefix=None)
    if not register_for_checkpointing:
        return prepared
    taken = _PREFIXES.setdefault(accelerator, set())
    if state_prefix in taken:
        raise ValueError(
            f"a loader prepared with this accelerator already saves its state files as "
            f"{state_prefix!r}; pass another `state_prefix` (e.g. state_prefix="
            f"'{state_prefix}_eval') so the two loaders' files do not overwrite each other"
        )
    taken.add(state_prefix)
    prepared.state_prefix = state_prefix
    accelerator.register_save_state_pre_hook(prepared._save)
    accelerator.register_load_state_pre_hook(prepared._load)
    return prepared
