"""The save-and-restore half of the engine protocol, shared by the two drop-in engines.

A drop-in state is whole: one per rank, restored by its own rank on the world size that saved
it, or, under a ``DistributedSampler``, any rank's state restores every rank of any layout.
:class:`DropInRestore` turns an engine's record methods (``state_at``, ``decode_one``,
``plan_record``, ``apply_record``, ``names_job_position``) into the protocol's ``save``,
``leaves``, ``decode``, ``plan``, ``apply`` and ``read_rank_files``. One restore checks each
fact once: the carrier that holds several states checks that they are of one save;
:meth:`DropInRestore.plan` picks, decodes and checks this rank's state and lets the engine
check that its stream can continue it; ``apply`` only hands the plan over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import StateFormatError, StateMismatchError
from ...state.plain import StateReader
from ...state.rank_file import RankFile
from ...state.rank_folder import RankFolder
from ...validation import require_int
from ...worker import WorkerConfig
from ..progress import MAX_HELD_BACK
from .entries import ANY_RANK_KEY, is_rank_entries, rank_entries, rank_key, states_of_entries
from .job import check_one_save
from .state import MapState


class DropInRestore:
    """The protocol's save and restore methods over a drop-in engine's record methods."""

    worker_config: WorkerConfig
    num_workers: int

    if TYPE_CHECKING:  # what each drop-in engine provides (map_style.py, iterable.py)

        @property
        def state_config(self) -> dict[str, Any]: ...
        def state_at(self, rank: int, world_size: int, held_back: int) -> Any: ...
        def decode_one(self, state: Any) -> Any: ...
        def plan_record(self, decoded: Any) -> Any: ...
        def apply_record(self, plan: Any) -> None: ...
        def names_job_position(self, config: dict[str, Any]) -> bool: ...

    def config(self) -> dict[str, Any]:
        """The dataset, sampler and batching a state must match, plus the layout."""
        config = self.worker_config
        return {
            "dropin": dict(self.state_config),
            "rank": config.rank,
            "world_size": config.world_size,
            "num_workers": self.num_workers,
        }

    # -- saving ----------------------------------------------------------------------------

    def own_state_at(self, held_back: int) -> Any:
        """This rank's record ``held_back`` batches before the last one handed out."""
        require_int(held_back, "held_back", minimum=0)
        if held_back > MAX_HELD_BACK:
            raise ValueError(f"`held_back` must be at most {MAX_HELD_BACK} (got {held_back})")
        config = self.worker_config
        return self.state_at(config.rank, config.world_size, held_back)

    def save(self, held_back: int) -> dict[str, Any]:
        return self.own_state_at(held_back).to_plain()  # type: ignore[no-any-return]

    def leaves(self, held_back: int) -> dict[str, Any]:
        """``{"rank_00001": "<JSON>"}`` (:mod:`.entries` says why a key per rank and a JSON
        leaf); a state any rank restores from goes under ``rank_any``."""
        state = self.own_state_at(held_back)
        if isinstance(state, MapState):  # the epoch's constant part encoded once
            key = ANY_RANK_KEY if self.names_job_position(state.config) else rank_key(state.rank)
            with contextlib.suppress(TypeError, ValueError):  # a sampler state JSON can't hold
                return {key: state.to_json()}
        return rank_entries([state.to_plain()])

    def leaves_of_ranks(self, states: Sequence[Any]) -> dict[str, Any]:
        return rank_entries(states)

    # -- restoring -------------------------------------------------------------------------

    def decode(self, states: Sequence[Any]) -> list[Any]:
        """Every rank's state as given: a drop-in state is decoded and checked when the rank
        that restores from it plans (:meth:`plan`)."""
        return list(states)

    def decode_leaves(self, leaves: dict[str, Any]) -> list[Any] | None:
        """The states of ``state_dict()``'s leaves, checked to be of one save where they hold
        several (the check this carrier owes: :meth:`plan` does not repeat it)."""
        if not is_rank_entries(leaves):
            return None
        states = states_of_entries(leaves)
        if len(states) > 1:
            check_one_save(states, across=len(states) != self.worker_config.world_size)
        return states

    def check_one_save(self, states: Sequence[Any], *, across: bool) -> None:
        check_one_save(states, across=across)

    def saved_ranks_needed(self, first: Any, rank: int) -> list[int]:
        """``first``'s rank alone under a ``DistributedSampler`` (it names the job's
        position); otherwise refused (each rank restores from its own state)."""
        if self.restores_any_rank(first):
            return [StateReader(first, "state").int("rank")]
        raise self._other_world_size(StateReader(first, "state").int("world_size", minimum=1))

    def restores_any_rank(self, state: Any) -> bool:
        """Whether ``state`` (plain, not decoded: which states to read, not a check) names
        the job's position rather than one rank's."""
        config = state.get("config") if isinstance(state, dict) else None
        return isinstance(config, dict) and self.names_job_position(config)

    def read_rank_files(self, folder: RankFolder) -> list[Any]:
        """This rank's own file on the saving world size, else the lowest rank's and those
        :meth:`saved_ranks_needed` names, plus a witness file; checked to be of one save."""
        own = folder.has_own()
        if own:
            saved_world_size = folder.world_size
            states = {folder.rank: _whole(folder.open_own())}
        else:
            saved_world_size = len(folder.files)
            states = {0: _whole(folder.open(0))}
            for rank in self.saved_ranks_needed(states[0], folder.rank):
                if rank not in states:
                    states[rank] = _whole(folder.open(rank))
        seen = dict(states)
        witness = folder.witness_rank(saved_world_size, states)
        if witness is not None:
            seen[witness] = _whole(folder.open_saved(witness, saved_world_size))
        if len(seen) > 1:
            try:
                check_one_save([seen[r] for r in sorted(seen)], across=not own)
            except StateMismatchError as error:
                raise StateMismatchError(f"{folder.directory}: {error}") from None
        return [states[r] for r in sorted(states)]

    def plan(self, records: list[Any]) -> Any:
        """This rank's state, decoded and checked once, as the plan for :meth:`apply`: from its own
        state, every rank's, or (under a ``DistributedSampler``) some of another world size."""
        config = self.worker_config
        if not records:
            raise self._other_world_size(0)
        own_layout = len(records) == config.world_size
        decoded = self.decode_one(records[config.rank if own_layout else 0])
        if not self.names_job_position(decoded.config):
            if not own_layout and len(records) > 1:
                raise self._other_world_size(len(records))
            if decoded.world_size != config.world_size or decoded.rank != config.rank:
                raise StateMismatchError(
                    f"the state was saved by rank {decoded.rank} of {decoded.world_size}; this "
                    f"loader is rank {config.rank} of {config.world_size}. A drop-in loader "
                    "restores on the same world size, each rank from its own state, unless its "
                    "sampler is a DistributedSampler (then any rank's state restores any "
                    "layout); otherwise elastic resume needs a savable pipeline: "
                    "docs/migration.md"
                )
        return self.plan_record(decoded)

    def apply(self, plan: Any) -> None:
        self.apply_record(plan)

    def _other_world_size(self, saved: int) -> StateMismatchError:
        return StateMismatchError(
            f"{saved} rank state(s) were saved, this job has world size "
            f"{self.worker_config.world_size}: a drop-in loader restores on the same world "
            "size unless its sampler is a DistributedSampler (otherwise elastic resume needs a "
            "savable pipeline: docs/migration.md)"
        )


def _whole(file: RankFile) -> Any:
    """A rank file's whole state (``StateFormatError`` naming the file)."""
    try:
        return file.state()
    except StateFormatError as error:
        raise StateFormatError(f"{file.path}: {error}") from None
