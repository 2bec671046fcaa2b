"""RepeatDataset: run the inner dataset's epochs back to back, forever or ``repeats`` times.

State: ``{"phase", "epoch", "repetition", "yielded", "inner"}``; an endless repeat of an inner
epoch that gives nothing is detected and raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..dataset import BaseWrapperDataset, EpochCursor, Key, SavableDataset
from ..errors import EnergyLoaderError
from ..state.plain import StateReader
from ..validation import require_int

__all__ = ["RepeatDataset"]


class _RepeatCursor(EpochCursor):
    dataset: RepeatDataset

    def __init__(self, dataset: RepeatDataset) -> None:
        super().__init__(dataset)
        self.repetition = 0
        self.yielded = 0

    def begin_epoch(self) -> None:
        self.repetition = 0
        self.yielded = 0

    def resume(self) -> Iterator[tuple[Key, Any]]:
        repeats, inner = self.dataset.repeats, self.dataset.dataset
        while repeats is None or self.repetition < repeats:
            for pair in inner.iter_keyed():
                self.yielded += 1
                yield pair
            if self.yielded == 0 and repeats is None:
                raise EnergyLoaderError(
                    f"RepeatDataset(repeats=None): the inner {type(inner).__name__} yielded no "
                    "sample in a whole epoch, so repeating it would loop forever (is this "
                    "worker's shard empty? use fewer workers or a larger dataset)"
                )
            self.repetition += 1
            self.yielded = 0

    def finish(self) -> None:
        if self.phase == "running":
            self.dataset.dataset.finish_epoch()
        super().finish()

    def fields(self) -> dict[str, Any]:
        return {
            "repetition": self.repetition,
            "yielded": self.yielded,
            "inner": self.dataset.dataset.save_state(),
        }

    def load_fields(self, reader: StateReader) -> None:
        self.repetition = reader.int("repetition")
        self.yielded = reader.int("yielded")
        self.dataset.dataset._restore_from(reader.sub("inner"))


class RepeatDataset(BaseWrapperDataset):
    """Repeat the inner dataset's epochs ``repeats`` times per epoch, or forever (``None``).

    Example::

        RepeatDataset(source)              # endless
        RepeatDataset(source, repeats=3)   # each epoch is three passes, each reshuffled
    """

    def __init__(self, dataset: SavableDataset, repeats: int | None = None) -> None:
        super().__init__(dataset)
        self.repeats = None if repeats is None else require_int(repeats, "repeats", minimum=1)

    def _new_cursor(self) -> EpochCursor:
        return _RepeatCursor(self)

    def _config_fields(self) -> dict[str, Any]:
        return {"repeats": self.repeats}

    def __len__(self) -> int:
        if self.repeats is None:
            raise TypeError("RepeatDataset(repeats=None) is endless and has no len()")
        return self.repeats * len(self.dataset)  # type: ignore[arg-type]
