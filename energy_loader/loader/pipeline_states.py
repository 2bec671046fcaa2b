"""Where a pipeline engine's saved states come from: leaves and rank files, decoded.

A pipeline's saved state is one record per partition. ``state_dict()`` stores each under the
key of its *slot* (its place in the job's stream: rank ``r`` of ``R`` holds slots
``r, r + R, ...``, :func:`~energy_loader.state.rank_state.rank_slots`), and a per-rank file
holds its rank's slots, each readable on its own. So a restoring rank of any layout reads only
the slots it runs: from DCP's leaves (:func:`leaves_to_run`) or from the files that hold them
(:func:`read_rank_files`), plus the one header that names the saved partition count. Then it
checks, once, that what it read is one save (the headers agree), and hands the records to the
planner.

Not here: planning (:mod:`.planner`), the file format (:mod:`energy_loader.state.rank_file`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from ..errors import StateFormatError, StateMismatchError, missing_slots_error
from ..state.changes import draws_other_sources, merged, stage_config
from ..state.rank_file import RankFile
from ..state.rank_folder import RankFolder
from ..state.rank_state import (
    RANK_STATE_FORMAT,
    SLOT_KEY_PREFIX,
    RankState,
    is_partition_entries,
    rank_slots,
    slot_key,
    states_from_entries,
)
from ..worker import WorkerConfig
from . import checks
from .planner import Planner, RestorePlan


def with_declared_changes(
    planner: Planner, restore: RestorePlan, changes: list[dict[str, Any]]
) -> RestorePlan:
    """``restore`` with the declared ``changes`` :func:`~.checks.check_fits` found: each
    partition's replay undoes them, and the history records them at the restored position."""
    if not changes:
        return restore
    now = planner.pipeline_config
    restores = {
        p: attrs.evolve(entry, changes=merged(entry.changes, changes))
        for p, entry in restore.restores.items()
    }
    after = [{**c, "after": stage_config(now, c["stage"], c["field"])} for c in changes]
    counted = restore.tally is not None and planner.config.world_size > 1
    finite = [c for c in after if stage_config(now, c["stage"], "on_exhausted") == "drop"]
    if counted and not restore.epoch_ended and any(map(draws_other_sources, finite)):
        warnings.warn(
            "the restore changes which sources a blend draws from (a source added, or a weight "
            "to or from 0): the items the restored epoch has left differ from the count its "
            "ranks' equal steps were taken from, so in this epoch the ranks may take unequal "
            "steps (a DDP job can stop on the last step every rank takes). From the next epoch "
            "on the count holds again; a blend of RepeatDataset sources under EpochizeDataset "
            "keeps it through any change (docs/long-jobs.md)",
            stacklevel=4,
        )
    entry = {"epoch": restore.epoch, "step": restore.delivered, "changes": after}
    return attrs.evolve(restore, restores=restores, history=(*restore.history, entry))


class StatesReader(Protocol):
    """What reading a pipeline's states asks of its engine
    (:class:`~energy_loader.loader.pipeline_engine.PipelineEngine`)."""

    worker_config: WorkerConfig
    planner: Planner

    def planner_for(self, states: Sequence[RankState]) -> Planner: ...
    def decode(self, states: Sequence[Any]) -> list[RankState]: ...
    def saved_ranks_needed(self, first: RankState, rank: int) -> list[int]: ...


def plan(
    planner: Planner, records: list[RankState], on_code_change: str, on_data_change: str
) -> RestorePlan:
    """Check that ``records`` fit ``planner``'s pipeline and plan the restore; user code that
    changed (``on_code_change``) or data files rewritten in place (``on_data_change``) warn or
    refuse, and a restore that continues checks only the keys of the items it re-makes."""
    scale, changes = checks.check_fits(planner, records)
    restore = with_declared_changes(planner, planner.plan(records, scale=scale), changes)
    saved = records[0].config
    checks.check_checkpoints(planner, restore.restores)
    code = checks.report_code_changes(saved, planner.pipeline_config, on_code_change)
    if checks.report_data_changes(planner, saved, on_data_change) or code:
        restore = restore.keys_only()
    return restore


def check_headers_of_one_save(states: Sequence[Any], *, across: bool) -> None:
    """``StateMismatchError`` unless the pipeline rank states of a list (plain or decoded) are of
    one save (``across``: on another world size); decodes the headers only."""
    headers = [
        state
        if isinstance(state, RankState)
        else RankState.from_plain({**state, "partitions": []}, complete=False)
        for state in states
        if isinstance(state, RankState)
        or (isinstance(state, dict) and state.get("format") == RANK_STATE_FORMAT)
    ]
    if len(headers) > 1:
        checks.check_states_of_one_save(headers, across=across)


def slots_to_run(engine: StatesReader, saved: RankState) -> list[str]:
    """The slot keys ``engine``'s rank runs to restore from ``saved``'s save (``StateMismatchError``
    naming both counts if it cannot run that many partitions)."""
    planner = engine.planner_for([saved])
    checks.check_partition_count(saved, planner.num_partitions, engine.worker_config.world_size)
    config = engine.worker_config
    return [slot_key(s) for s in rank_slots(config.rank, config.world_size, planner.num_partitions)]


def leaves_to_run(engine: StatesReader, leaves: dict[str, Any]) -> list[RankState] | None:
    """The leaves of ``state_dict()``'s layout this rank runs, decoded (None: a plain rank state).
    ``StateMismatchError`` for another ``num_partitions``, missing slots or mixed positions."""
    if not is_partition_entries(leaves):
        return None
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
    states = states_from_entries({key: leaves[key] for key in wanted}, complete=False)
    _check_slot_states(engine, states)
    return states


def _check_slot_states(
    engine: StatesReader, states: list[RankState], witnesses: Sequence[RankState] = ()
) -> None:
    """The saved states of the slots this rank runs (and the ``witnesses``' headers) are of one save
    and stood at one position of the job's stream."""
    config = engine.worker_config
    across = states[0].world_size != config.world_size
    checks.check_states_of_one_save([*states, *witnesses], across=across)
    checks.check_one_position(states, config.rank)


def read_rank_files(engine: StatesReader, folder: RankFolder) -> list[RankState]:
    """The saved states ``engine``'s rank restores from, out of a folder of rank files, each holding
    only the slots it now runs: the files of its slots plus a witness's header, checked to be of one
    save, so a stray file of another save is refused on at least one rank."""
    first = folder.open_own() if folder.has_own() else folder.open(folder.rank % len(folder.files))
    config = first.config()
    saved = _header_state(first, config)
    by_file: dict[int, list[str]] = {}
    for key in slots_to_run(engine, saved):
        by_file.setdefault(int(key[len(SLOT_KEY_PREFIX) :]) % saved.world_size, []).append(key)
    states = []
    for rank, keys in sorted(by_file.items()):
        file = first if rank == saved.rank else folder.open_saved(rank, saved.world_size)
        _check_same_config(file, first)
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
        leaves = {key: {"rank_state": header, "partition": entry}
                  for key, entry in file.partitions(keys).items()}  # fmt: skip
        try:
            states.extend(states_from_entries(leaves, complete=False))
        except StateFormatError as error:
            raise StateFormatError(f"{file.path}: {error}") from None
    witnesses = []
    witness_rank = folder.witness_rank(saved.world_size, {state.rank for state in states})
    if witness_rank is not None:
        witness = folder.open_saved(witness_rank, saved.world_size)
        _check_same_config(witness, first)
        witnesses.append(_header_state(witness, config))
    try:
        _check_slot_states(engine, states, witnesses)
    except StateMismatchError as error:
        raise StateMismatchError(f"{folder.directory}: {error}") from None
    return states


def _header_state(file: RankFile, config: dict[str, Any]) -> RankState:
    """A rank file's header as a state without partitions (``StateFormatError`` naming the
    file)."""
    try:
        return RankState.from_plain(
            {**file.header, "config": config, "partitions": []}, complete=False
        )
    except StateFormatError as error:
        raise StateFormatError(f"{file.path}: {error}") from None


def _check_same_config(file: RankFile, first: RankFile) -> None:
    if file.config_check != first.config_check:
        raise StateMismatchError(
            f"{file.path} and {first.path.name} hold different pipeline configs: files of "
            "different saves or runs mixed in one folder? Keep each save's files in a folder "
            "of their own"
        )
