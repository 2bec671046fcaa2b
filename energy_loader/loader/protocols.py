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

from ..errors import StateMismatchError, missing_slots_error
from ..state.rank_state import (
    PARTITION_KEY_PREFIX,
    RankState,
    is_partition_entries,
    partition_entries,
    rank_slots,
    slot_key,
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
    # Whether a restore on another world size takes the saved partitions by slot (a savable
    # pipeline's rank states), rather than whole states (a drop-in loader's).
    restores_by_slot: bool = True

    if TYPE_CHECKING:
        _planner: Planner

        @property
        def worker_config(self) -> WorkerConfig: ...
        def _save(self, held_back: int) -> RankState: ...
        def planner_for(self, states: Sequence[RankState]) -> Planner: ...
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

        ``{"slot_00003": "<JSON>", ...}``: each leaf holds one partition's state and its
        rank's position, under the key of the partition's *slot*, its place in the job's
        stream from the rank's position (:func:`~energy_loader.state.rank_state.rank_slots`:
        rank ``r`` of ``R`` holds slots ``r, r + R, ...``). The leaves of all ranks together
        are the whole job's state. ``torch.distributed.checkpoint`` (DCP) stores them leaf by
        leaf under one common key for the loader on every rank, and a fresh loader lists the
        slots its own rank runs from the saved position, on any layout: a DCP load into a
        fresh loader built with the saved ``num_partitions`` reads only the partitions its
        rank runs, whether the world size is the one that saved or not. String leaves also
        avoid DCP's deduplication of equal leaves and its load into the *shape* of a fresh
        state, which a shuffle buffer's state does not keep. ``torch.save`` and ``json`` take
        the dict as is; :meth:`load_state_dict` reads it back.
        """
        if held_back is None:
            held_back = 0 if self.held_back_source is None else self.held_back_source()
        return partition_entries([self._save(held_back)])

    def state_dict_of_ranks(self, states: Sequence[Any]) -> dict[str, Any]:
        """Every rank's state (``save_state_global``'s list) in :meth:`state_dict`'s layout,
        one leaf per partition of the job: one checkpoint for the whole job, from which each
        rank's :meth:`load_state_dict` takes the partitions it runs (Lightning's callback
        stores it)."""
        return partition_entries(self.decode_states(states))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output (a DCP template this loader listed, filled;
        or every rank's leaves, from any layout with the same partitions) or from a plain
        ``save_state_rank()`` state. Decodes only the leaves this rank runs."""
        if is_partition_entries(state_dict):
            self.restore_from_states(self._states_to_run(state_dict))
            return
        self.restore_state_rank(state_dict)

    def _states_to_run(self, entries: dict[str, Any]) -> list[RankState]:
        """The leaves of ``entries`` this rank runs, decoded (the lowest key's leaf first, for
        the saved partition count).

        Raises ``StateMismatchError`` for another ``num_partitions`` (naming both), for slots
        the dict lacks, and for leaves of ranks that stood at different positions (a rank
        running partitions of several saved ranks needs them in lockstep).
        """
        if any(key.startswith(PARTITION_KEY_PREFIX) for key in entries):
            return states_from_entries(entries)  # the first layout: keys name partitions
        lowest = min(entries)
        (first,) = states_from_entries({lowest: entries[lowest]}, complete=False)
        wanted = self.slots_to_run(first)
        missing = [key for key in wanted if key not in entries]
        if missing:
            raise missing_slots_error(
                self.worker_config,
                missing,
                first.num_partitions,
                f"the state_dict lacks (it holds {len(entries)} leaves). A "
                "torch.distributed.checkpoint load fills the slots a fresh loader lists for its "
                f"own num_partitions={self._planner.num_partitions}: build the loader with "
                f"num_partitions={first.num_partitions}, or load with "
                "planner=energy_loader.dcp.LoadPlanner() (it lists the saved count's slots); "
                "otherwise pass every rank's state_dict leaves",
            )
        return self.states_of_slots({key: entries[key] for key in wanted})

    def slots_to_run(self, saved: RankState) -> list[str]:
        """The slot keys this rank runs when it restores from the save ``saved`` (any saved
        rank's state, partitions or not) belongs to: its own layout's slots of the saved
        ``num_partitions`` (``StateMismatchError`` naming both counts if this loader cannot
        run that many)."""
        planner = self.planner_for([saved])
        planner.check_partition_count(saved)
        config = self.worker_config
        return [
            slot_key(s) for s in rank_slots(config.rank, config.world_size, planner.num_partitions)
        ]

    def states_of_slots(self, leaves: dict[str, Any]) -> list[RankState]:
        """The saved rank states holding the slots this rank runs, from their leaves (JSON
        text, or the parsed ``{"rank_state": ..., "partition": ...}``), checked to stand at
        one position of the job's stream (``StateMismatchError`` otherwise: a rank running
        partitions of several saved ranks needs them saved at the same step)."""
        states = states_from_entries(leaves, complete=False)
        positions = {state.rank: state.stream_position() for state in states}
        if len(set(positions.values())) > 1:
            config = self.worker_config
            raise StateMismatchError(
                f"the saved ranks {sorted(positions)} whose partitions rank {config.rank} now "
                f"runs stood at different positions of the job's stream {positions} (saved "
                "at different steps, or at an epoch's end on some ranks only); restore on "
                f"the saved world size {states[0].world_size}, or save when every rank has "
                "taken the same number of steps"
            )
        return states
