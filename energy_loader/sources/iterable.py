"""IterableSource: a user's ``torch.utils.data.IterableDataset`` as a savable source.

A state holds a ``Stateful`` dataset's own ``state_dict()`` or else an item count that a
restore skips; restore keys ``(epoch, item number)`` rebuild nothing. See docs/dropin.md,
"Iterable datasets".
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from ..dataset import EpochCursor, Key, SavableDataset, is_stateful, user_fn_fields
from ..rng import seed_globals_for_sample
from ..state.code_fingerprint import code_fingerprint
from ..state.fingerprint import CODE_SUFFIX
from ..state.plain import StateReader

__all__ = ["IterableSource"]


class IterableSource(SavableDataset):
    """Yield a user iterable dataset's items, saving its ``state_dict()`` or an item count.
    ``worker_init_fn`` is the user's, called once per copy inside a worker. Example::

        source = IterableSource(my_iterable_dataset)
    """

    def __init__(
        self,
        dataset: Any,
        *,
        worker_init_fn: Callable[[int], None] | None = None,
        seed_per_epoch: bool = True,
    ) -> None:
        super().__init__()
        self.dataset = dataset
        self.worker_init_fn = worker_init_fn
        self.seed_per_epoch = seed_per_epoch
        self.stateful = is_stateful(dataset)
        self._initialised = False

    def _new_cursor(self) -> EpochCursor:
        return _IterableCursor(self)

    def restore_sample(self, key: Key) -> Any:
        raise TypeError("an IterableSource cannot rebuild a sample from its key")

    def can_restore_sample(self) -> bool:
        return False

    def _config_fields(self) -> dict[str, Any]:
        return {
            "dataset": type(self.dataset).__name__,
            "stateful": self.stateful,
            **user_fn_fields("worker_init_fn", self.worker_init_fn),
            # The dataset's class (its __iter__...) as user code (the drop-in runs it so).
            "dataset" + CODE_SUFFIX: code_fingerprint(type(self.dataset)),
        }

    def enter_worker(self, dataset: Any = None) -> bool:
        """Make ``get_worker_info()`` name this copy's worker (and ``dataset``, the object
        being iterated, the user's dataset by default); True inside a worker process."""
        from torch.utils.data import get_worker_info

        from ..torch_internals import set_worker_info

        if get_worker_info() is None:
            return False
        context = self.context
        workers = max(1, context.num_partitions // max(1, context.world_size))
        set_worker_info(
            id=context.partition // max(1, context.world_size),
            num_workers=workers,
            dataset=self.dataset if dataset is None else dataset,
        )
        if not self._initialised:
            self._initialised = True
            if self.worker_init_fn is not None:
                self.worker_init_fn(context.partition // max(1, context.world_size))
        return True


class _IterableCursor(EpochCursor):
    dataset: IterableSource

    def __init__(self, dataset: IterableSource) -> None:
        super().__init__(dataset)
        self.consumed = 0
        self.user_state: Any = None
        self._live: Any = None  # the object being iterated: the dataset or a loaded copy

    def begin_epoch(self) -> None:
        self.consumed = 0
        self.user_state = None

    def resume(self) -> Iterator[tuple[Key, Any]]:
        source = self.dataset
        user = source.dataset
        in_worker = source.enter_worker()
        if in_worker and source.seed_per_epoch:
            context = source.context
            seed_globals_for_sample(context.seed, -2, (context.partition, self.epoch))
        if self.user_state is not None:
            user = loaded_copy(user, self.user_state)
            if in_worker:
                source.enter_worker(user)
        iterator = iter(user)
        if self.user_state is None:  # no state of its own: skip the items already consumed
            for _ in itertools.islice(iterator, self.consumed):
                pass
        self._live = user
        try:
            for sample in iterator:
                key = (self.epoch, self.consumed)
                self.consumed += 1
                yield key, sample
        finally:
            self._live = None

    def fields(self) -> dict[str, Any]:
        source = self.dataset
        state = None
        if source.stateful and (self._live is not None or self.user_state is not None):
            state = self._live.state_dict() if self._live is not None else self.user_state
        return {"consumed": self.consumed, "user_state": state}

    def load_fields(self, reader: StateReader) -> None:
        self.consumed = reader.int("consumed")
        self.user_state = reader.raw("user_state")


def loaded_copy(dataset: Any, state: Any) -> Any:
    """A shallow copy of ``dataset`` with ``state`` loaded into it; ``dataset`` is unchanged. The
    copy gets a ``__dict__`` of its own (``copy.copy`` of a class whose ``__getstate__`` returns
    its ``__dict__``, a Hugging Face ``IterableDataset``, would share it)."""
    view = copy.copy(dataset)
    if view is not dataset and getattr(view, "__dict__", None) is getattr(dataset, "__dict__", 0):
        view.__dict__ = dict(dataset.__dict__)
    view.load_state_dict(state)
    return view
