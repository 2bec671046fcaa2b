"""Where a pipeline engine's saved states come from: leaves and rank files, decoded.

A pipeline's saved state is one record per partition. ``state_dict()`` stores each under the
key of its *slot* (its place in the job's stream: rank ``r`` of ``R`` holds slots
``r, r + R, ...``, :func:`~energy_loader.state.rank_state.rank_slots`), and a per-rank file
holds its rank's slots, each readable on its own. So a restoring rank of any layout reads only
the slots it runs: from DCP's leaves (:func:`leaves_to_run`) or from the files that hold them
(:func:`read_rank_files`), plus the one header that names the saved partition count. Then it
checks that what it read is one save (the headers agree), and hands the records to the
planner.

Not here: planning (:mod:`.planner`), the file format (:mod:`energy_loader.state.rank_file`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..errors import StateFormatError, StateMismatchError, missing_slots_error
from ..state.rank_file import RankFile
from ..state.rank_folder import RankFolder, whole_states
from ..state.rank_state import (
    PARTITION_KEY_PREFIX,
    RANK_STATE_FORMAT,
    SLOT_KEY_PREFIX,
    RankState,
    is_partition_entries,
    rank_slots,
    slot_key,
    states_from_entries,
)
from ..worker import WorkerConfig
from .planner import Planner, check_states_of_one_save

__all__ = ["StatesReader", "check_headers_of_one_save", "leaves_to_run", "read_rank_files"]


class StatesReader(Protocol):
    """What reading a pipeline's states asks of its engine
    (:class:`~energy_loader.loader.pipeline_engine.PipelineEngine`)."""

    worker_config: WorkerConfig
    planner: Planner

    def planner_for(self, states: Sequence[RankState]) -> Planner: ...
    def decode(self, states: Sequence[Any]) -> list[RankState]: ...
    def saved_ranks_needed(self, first: RankState, rank: int) -> list[int]: ...


def check_headers_of_one_save(states: Sequence[Any], *, across: bool) -> None:
    """``StateMismatchError`` unless the pipeline rank states of a list agree as the states of
    one save (:func:`~energy_loader.loader.planner.check_states_of_one_save`; ``across``: on
    another world size), even where each rank will restore from its own entry alone. Reads
    the headers only; entries that are not pipeline rank states are left to the decoder."""
    headers = [
        RankState.from_plain({**state, "partitions": []}, complete=False)
        for state in states
        if isinstance(state, dict) and state.get("format") == RANK_STATE_FORMAT
    ]
    if len(headers) > 1:
        check_states_of_one_save(headers, across=across)


def slots_to_run(engine: StatesReader, saved: RankState) -> list[str]:
    """The slot keys ``engine``'s rank runs when it restores from the save ``saved`` (any
    saved rank's state) belongs to (``StateMismatchError`` naming both counts if this loader
    cannot run that many partitions)."""
    planner = engine.planner_for([saved])
    planner.check_partition_count(saved)
    config = engine.worker_config
    return [slot_key(s) for s in rank_slots(config.rank, config.world_size, planner.num_partitions)]


def leaves_to_run(engine: StatesReader, leaves: dict[str, Any]) -> list[RankState] | None:
    """The leaves of ``state_dict()``'s layout this rank runs, decoded (None: ``leaves`` is a
    plain rank state, not leaves).

    Raises ``StateMismatchError`` for another ``num_partitions`` (naming both), for slots the
    dict lacks, and for leaves of ranks that stood at different positions.
    """
    if not is_partition_entries(leaves):
        return None
    if any(key.startswith(PARTITION_KEY_PREFIX) for key in leaves):
        return states_from_entries(leaves)  # the first layout: keys name partitions
    lowest = min(leaves)
    (first,) = states_from_entries({lowest: leaves[lowest]}, complete=False)
    wanted = slots_to_run(engine, first)
    missing = [key for key in wanted if key not in leaves]
    if missing:
        raise missing_slots_error(
            engine.worker_config,
            missing,
            first.num_partitions,
            f"the state_dict lacks (it holds {len(leaves)} leaves). A "
            "torch.distributed.checkpoint load fills the slots a fresh loader lists for its "
            f"own num_partitions={engine.planner.num_partitions}: build the loader with "
            f"num_partitions={first.num_partitions}, or load with "
            "planner=energy_loader.dcp.LoadPlanner() (it lists the saved count's slots); "
            "otherwise pass every rank's state_dict leaves",
        )
    return states_of_slots(engine, {key: leaves[key] for key in wanted})


def states_of_slots(engine: StatesReader, leaves: dict[str, Any]) -> list[RankState]:
    """The saved rank states holding the slots this rank runs, from their leaves (JSON text,
    or the parsed ``{"rank_state": ..., "partition": ...}``), checked to stand at one position
    of the job's stream (a rank running partitions of several saved ranks needs them saved at
    the same step)."""
    states = states_from_entries(leaves, complete=False)
    positions = {state.rank: state.stream_position() for state in states}
    if len(set(positions.values())) > 1:
        config = engine.worker_config
        raise StateMismatchError(
            f"the saved ranks {sorted(positions)} whose partitions rank {config.rank} now "
            f"runs stood at different positions of the job's stream {positions} (saved "
            "at different steps, or at an epoch's end on some ranks only); restore on "
            f"the saved world size {states[0].world_size}, or save when every rank has "
            "taken the same number of steps"
        )
    return states


def read_rank_files(engine: StatesReader, folder: RankFolder) -> list[RankState]:
    """The saved states ``engine``'s rank restores from, out of a folder of rank files.

    On the world size that saved them, its own file, checked against the header of one other
    rank's file of the save. Otherwise the states of the saved ranks whose slots it now runs,
    each holding only those slots (the lowest-numbered needed file's header names the saved
    partition count). Files of an earlier release hold whole states and are read whole.
    """
    if folder.has_own():
        own = folder.open_own()
        state = _decoded(engine, own)
        _check_witness(engine, folder, own, state)
        return [state]
    # The saved rank holding this rank's first slot (r' % R) if the partition count is the
    # loader's; its header names the saved count, which a loader built without
    # num_partitions adopts.
    first = folder.open(folder.rank % len(folder.files))
    if first.split:
        return _slot_states(engine, folder, first)
    return whole_states(
        folder,
        decode=lambda file: _decoded(engine, file),
        needed=lambda state: engine.saved_ranks_needed(state, engine.worker_config.rank),
        check=None,
    )


def _decoded(engine: StatesReader, file: RankFile) -> RankState:
    try:
        (state,) = engine.decode([file.state()])
    except StateFormatError as error:
        raise StateFormatError(f"{file.path}: {error}") from None
    return state


def _check_witness(
    engine: StatesReader, folder: RankFolder, own: RankFile, state: RankState
) -> None:
    """A rank's own state checked against the header of one other rank's file of the save
    (rank 0's; rank 1's for rank 0), found by its name (no directory listing): a file of
    another save or run left in the folder is a ``StateMismatchError`` on at least one rank.
    Reads one small header."""
    if folder.world_size < 2 or state.seed is None:
        return
    path, witness = own.path, folder.witness_path()
    if not witness.is_file():
        return  # an incomplete folder: the rank whose file is missing refuses itself
    other = folder.open_witness()
    if not other.split:
        return  # a file of an earlier release: whole, and without a seed to compare
    if other.config_digest != own.config_digest:
        raise StateMismatchError(
            f"{path.parent}: {witness.name} holds another pipeline config than "
            f"{path.name}: files of different saves or runs are mixed in the folder. Keep "
            "each save's files in a folder of their own"
        )
    header = RankState.from_plain(
        {**other.header, "config": state.config, "partitions": []}, complete=False
    )
    try:
        check_states_of_one_save([header, state], across=False)
    except StateMismatchError as error:
        raise StateMismatchError(
            f"{path.parent}: {error} ({path.name} and {witness.name} are not of one save)"
        ) from None


def _slot_states(engine: StatesReader, folder: RankFolder, first: RankFile) -> list[RankState]:
    """The saved states, holding only the slots this rank runs, from a resized job's rank
    files (``first``: one of them, opened; its header gives the saved layout and its config
    the pipeline's, which the other files must share)."""
    config = first.config()
    try:
        saved = RankState.from_plain(
            {**first.header, "config": config, "partitions": []}, complete=False
        )
    except StateFormatError as error:
        raise StateFormatError(f"{first.path}: {error}") from None
    by_file: dict[int, list[str]] = {}
    for key in slots_to_run(engine, saved):
        by_file.setdefault(int(key[len(SLOT_KEY_PREFIX) :]) % saved.world_size, []).append(key)
    leaves: dict[str, Any] = {}
    for rank, keys in sorted(by_file.items()):
        file = folder.open(rank)
        if file.config_digest != first.config_digest:
            raise StateMismatchError(
                f"{file.path} and {first.path.name} hold different pipeline configs: files of "
                "different saves mixed in one folder? Keep the files of one save together"
            )
        missing = [key for key in keys if key not in file.slots]
        if missing:
            raise missing_slots_error(
                engine.worker_config,
                missing,
                saved.num_partitions,
                f"{file.path} does not hold (it holds {len(file.slots)} slots): files of "
                "different saves mixed? Keep each save's files in a folder of their own",
            )
        header = {**file.header, "config": config}
        for key, entry in file.partitions(keys).items():
            leaves[key] = {"rank_state": header, "partition": entry}
    try:
        return states_of_slots(engine, leaves)
    except StateFormatError as error:
        raise StateFormatError(f"{folder.directory}: {error}") from None
