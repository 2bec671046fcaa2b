"""A drop-in loader restored by Lightning on another layout: counted right, or refused.

Lightning ends an epoch of a sized loader after ``len(loader)`` batches, counting the resumed
epoch from the saving rank's count. A drop-in loader under a ``DistributedSampler`` restored
on more ranks (or a smaller batch size) deals the rest anew, with more batches left per rank:
Lightning would end the epoch early, silently. ``SavableLoaderCallback`` makes Lightning count
as the loader deals; without it the resume is refused at the epoch's first ``next()``, naming
the callback. ``load_state_dict`` notes whether Lightning called it (a Lightning module on the
stack); the first ``iter()`` after it works out what Lightning will count.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ...errors import StateMismatchError

_LIGHTNING_MODULES = ("lightning.pytorch.", "pytorch_lightning.")
_FRAMES_LOOKED_AT = 12


def restored_by_lightning() -> bool:
    """Whether the caller's caller (up to a few frames up) is Lightning's code (its fit loop
    loads a train loader's state through ``CombinedLoader``)."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES_LOOKED_AT):
        if frame is None:
            return False
        if str(frame.f_globals.get("__name__", "")).startswith(_LIGHTNING_MODULES):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def lightning_count_check(loader: Any, saved_used: int) -> Callable[[], None] | None:
    """The check to run at the resumed epoch's first batch (None: Lightning counts it right).

    ``saved_used``: batches of the epoch the saving rank had trained, Lightning's count at
    the checkpoint. ``loader.resumed_batches_left`` (read now, right after ``iter()``) is
    what this rank will hand out.
    """
    left = loader.resumed_batches_left
    counted = len(loader) - saved_used
    if left is None or left <= counted:
        return None  # the same layout, or fewer ranks: the loader's iterator ends first

    def check() -> None:
        if loader.held_back_source is not None:  # SavableLoaderCallback attached itself
            return
        raise StateMismatchError(
            f"Lightning resumed this drop-in loader from a checkpoint of another number of "
            f"devices (or batch size): this rank has {left} batches of the resumed epoch left, "
            f"but Lightning counts the epoch from the checkpoint's {saved_used} trained "
            f"batches up to len(loader)={len(loader)} and would end it after {counted}, never "
            f"training the last {left - counted}. Add "
            "energy_loader.integrations.lightning.SavableLoaderCallback() to the Trainer's "
            "callbacks (on every rank): it makes Lightning count the resumed epoch as the "
            "loader deals it (docs/integrations-lightning.md)"
        )

    return check
