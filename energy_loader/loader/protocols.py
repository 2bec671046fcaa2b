"""The ways a loader's rank state leaves and comes back, beyond ``save_state_rank()``.

:class:`RankStateProtocols` gives :class:`~energy_loader.SavableDataLoader` the
``torch.distributed.checkpoint`` Stateful protocol (``state_dict``/``load_state_dict``: one JSON
leaf per logical partition, so a job saved on ``R`` ranks loads on ``R'``) and the collective
gather/scatter methods, which delegate to :mod:`energy_loader.distributed`. Everything here is
built on the loader's own save and restore (``_save``, ``restore_from_states``), so the state's
shape is defined once, in :mod:`energy_loader.state.rank_state`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from ..state.rank_state import (
    PARTITION_KEY_PREFIX,
    RankState,
    partition_entries,
    states_from_entries,
)

if TYPE_CHECKING:
    from ..worker import WorkerConfig
    from .planner import Planner
    from .savable_loader import SavableDataLoader

__all__ = ["RankStateProtocols"]


class RankStateProtocols:
    """State dicts for DCP and trainers, and gather/scatter across ranks (mixed into the loader)."""

    # Set by integrations whose trainer fetches ahead of training (see state_dict()).
    held_back_source: Callable[[], int] | None = None

    if TYPE_CHECKING:
        _planner: Planner

        @property
        def worker_config(self) -> WorkerConfig: ...
        def _save(self, held_back: int) -> RankState: ...
        def _is_fresh(self) -> bool: ...
        def restore_from_states(self, states: list[RankState]) -> None: ...
        def restore_state_rank(self, state: dict[str, Any]) -> None: ...
        def decode_states(self, states: Sequence[Any]) -> list[RankState]: ...

    # -- across ranks ------------------------------------------------------------------------

    def save_state_global(self, dst_rank: int = 0) -> list[dict[str, Any]] | None:
        """Gather every rank's state to ``dst_rank``: a list there, ``None`` elsewhere.

        A collective: every rank of the data-parallel group must call it.
        """
        from ..distributed import save_state_global

        return save_state_global(cast("SavableDataLoader", self), dst_rank)

    def restore_state_global(
        self, states: list[dict[str, Any]] | None, *, src_rank: int | None = None
    ) -> None:
        """Restore every rank from the list of all ranks' states.

        Either every rank passes the full list (``src_rank=None``), or only ``src_rank``
        passes it and it is scattered. A collective over the data-parallel group in both forms
        when torch.distributed is initialised: a state that does not fit on any rank raises on
        every rank.
        """
        from ..distributed import restore_state_global

        restore_state_global(cast("SavableDataLoader", self), states, src_rank=src_rank)

    # -- torch.distributed.checkpoint Stateful protocol --------------------------------------

    def state_dict(self, *, held_back: int | None = None) -> dict[str, Any]:
        """This rank's state as one JSON string leaf per partition it runs.

        ``held_back`` is passed to :meth:`save_state_rank`. Left at ``None`` (how DCP and
        trainers call it), it is ``held_back_source()`` when an integration set that attribute
        -- :class:`energy_loader.integrations.lightning.SavableLoaderCallback` does, because
        Lightning may hold a fetched batch it has not trained on when it saves -- and 0
        otherwise.

        ``{"partition_00003": "<JSON>", ...}``: each leaf holds one partition's state and its
        rank's position, so the leaves of all ranks together are the whole job's state, under
        keys that do not depend on the layout. ``torch.distributed.checkpoint`` (DCP) stores
        them leaf by leaf under one common key for the loader on every rank, and a job saved
        on ``R`` ranks loads on ``R'``: a loader that has not started yet lists every
        partition of the job (all fresh, identical on every rank), so a DCP load into a fresh
        loader reads every partition and each rank takes the ones it now runs. String leaves
        also avoid DCP's deduplication of equal leaves and its load into the *shape* of a
        fresh state, which a shuffle buffer's state does not keep. ``torch.save`` and
        ``json`` take the dict as is; :meth:`load_state_dict` reads it back.
        """
        if held_back is None:
            held_back = 0 if self.held_back_source is None else self.held_back_source()
        if held_back == 0 and self._is_fresh():
            planner = self._planner
            states = [planner.fresh_rank_state(r) for r in range(self.worker_config.world_size)]
        else:
            states = [self._save(held_back)]
        return partition_entries(states)

    def state_dict_of_ranks(self, states: Sequence[Any]) -> dict[str, Any]:
        """Every rank's state (``save_state_global``'s list) in :meth:`state_dict`'s layout,
        one leaf per partition of the job: one checkpoint for the whole job, from which each
        rank's :meth:`load_state_dict` takes the partitions it runs (Lightning's callback
        stores it)."""
        return partition_entries(self.decode_states(states))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output (from any layout with the same partitions)
        or from a plain ``save_state_rank()`` state."""
        if (
            isinstance(state_dict, dict)
            and state_dict
            and all(isinstance(k, str) and k.startswith(PARTITION_KEY_PREFIX) for k in state_dict)
        ):
            self.restore_from_states(states_from_entries(state_dict))
            return
        self.restore_state_rank(state_dict)
