"""Every check of a pipeline restore, each written once (the drop-in's: :mod:`.dropin`).

A restore decodes its states (:mod:`energy_loader.state.rank_state`: format, version, fields
and digests), then runs these, each once, before it plans (:mod:`.planner`, pure):

- :func:`check_states_of_one_save`, where several states meet (a gathered list, the leaves or
  files a rank read with a witness of the save): one layout, epoch and assignment, each rank
  once, in lockstep; on another world size the same seed;
- :func:`check_one_position`, where a rank continues partitions of several saved ranks;
- :func:`check_fits`: each state fits this loader (partition count, seed, pipeline config,
  a batch size that shrank by a whole factor);
- :func:`check_checkpoints`: every partition's checkpoint restores into the pipeline (in this
  process, before any worker starts);
- :func:`report_code_changes`: a user function whose code changed warns or refuses;
- :func:`report_data_changes`: a source whose data files changed in place warns or refuses
  (a change of their layout, :func:`check_fits` refuses, naming the source and the file).

The proof (the last item re-made and compared) runs where the items are re-made, in
:mod:`energy_loader.workers`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from ..errors import CodeChangedWarning, DataChangedWarning, StateFormatError, StateMismatchError
from ..state.changes import declared_changes, values_before
from ..state.code_fingerprint import changed_parts
from ..state.data_fingerprint import data_changes
from ..state.fingerprint import (
    CODE_SUFFIX,
    ConfigDifference,
    code_differences,
    describe_differences,
)
from ..state.rank_state import PartitionState, RankState
from .partitions import world_sizes_for
from .planner import Planner

_PASS_THROUGH_TYPES = ("MapDataset", "FilterDataset", "GcDataset")
# A source's config fields that describe its data files' layout (a digest of its index or
# listing): a difference there is data that changed, not another pipeline.
_LAYOUT_FIELDS = ("fingerprint", "listing", "index")


def check_states_of_one_save(states: Sequence[RankState], *, across: bool = True) -> None:
    """``StateMismatchError`` unless ``states`` (some ranks' states, or headers) can be the
    rank states of one save of one job.

    One save: the same layout and epoch, the same assignment start, each rank once, and,
    since the ranks of a synchronous job hand out items in lockstep, the same count handed
    out by every rank still in the epoch (a rank whose shorter epoch already ended has handed
    out no more than they have). ``across``: partitions will move to other ranks (another
    world size), so the ranks' seeds must agree too: a partition continued under another
    rank's seed would draw other numbers. On the world size that saved them every rank
    continues its own partitions under its own seed, exactly.
    """
    first = states[0]
    names = ("world_size", "num_workers", "num_partitions", "epoch", "start")
    for state in states:
        for name in (*names, "seed") if across else names:
            if getattr(state, name) != getattr(first, name):
                _disagree(first, state, name)
    ranks = [state.rank for state in states]
    if len(set(ranks)) != len(ranks):
        raise StateMismatchError(
            f"the rank states list a rank twice (ranks {ranks}): pass each rank's state of "
            "one save once"
        )
    running = [s for s in states if not s.epoch_ended]
    for state in running:
        if state.delivered != running[0].delivered:
            _disagree(running[0], state, "delivered")
    if running:
        for state in states:
            if state.epoch_ended and state.delivered > running[0].delivered:
                _disagree(running[0], state, "delivered")


def _disagree(first: RankState, other: RankState, name: str) -> None:
    what = {
        "seed": " (their WorkerConfig seeds differ, so a partition that moves to another rank "
        "would draw other numbers there: such states restore on the world size that saved "
        "them only. The partitions of a job are seeded apart already: give every rank the same "
        "seed)",
        "delivered": " items handed out in the epoch (states of different saves, or of "
        "different runs, are mixed)",
        "start": " as the start of the epoch's assignment (states of different saves mixed?)",
    }.get(name, "")
    raise StateMismatchError(
        f"the rank states disagree: rank {first.rank} has {name}={getattr(first, name)}, rank "
        f"{other.rank} has {name}={getattr(other, name)}{what}; pass the states of one save of "
        "one job"
    )


def check_one_position(states: Sequence[RankState], rank: int) -> None:
    """``StateMismatchError`` unless the saved ranks whose partitions rank ``rank`` now runs
    stood at one position of the job's stream: it continues them together, so they must have
    been saved at the same step."""
    positions = {state.rank: state.stream_position() for state in states}
    if len(set(positions.values())) > 1:
        raise StateMismatchError(
            f"the saved ranks {sorted(positions)} whose partitions rank {rank} now "
            f"runs stood at different positions of the job's stream {positions} (saved "
            f"at different steps, or at an epoch's end on some ranks only); restore on "
            f"the saved world size {states[0].world_size}, or save when every rank has "
            "taken the same number of steps"
        )


def check_fits(planner: Planner, states: Sequence[RankState]) -> tuple[int, list[dict[str, Any]]]:
    """``StateMismatchError`` unless every state fits ``planner``'s loader: its partition
    count, its seed and its pipeline's config, where only the changes the loader declares and a
    batch size shrunk by a whole factor may differ; returns that factor (the replay scale, 1
    when no batch size differs) and the declared changes found (``energy_loader.state.changes``
    records)."""
    if not states:
        raise StateMismatchError(
            "no rank state to restore from: pass the states of one save (the list "
            "save_state_global returns, or the folder save_state_rank_file wrote)"
        )
    config = planner.config
    scale = 1
    changes: list[dict[str, Any]] = []
    for state in states:
        check_partition_count(state, planner.num_partitions, config.world_size)
        if state.seed != config.seed:
            raise StateMismatchError(
                f"the state was saved by a loader with WorkerConfig seed={state.seed}; this "
                f"loader has seed={config.seed}, which seeds its shuffles and per-sample "
                f"draws differently. Build the loader with seed={state.seed} to continue that "
                "stream"
            )
        changes, differences = declared_changes(
            state.config, planner.pipeline_config, planner.changes
        )
        found = _batch_size_scale(differences, planner.pipeline_config)
        if found is None:
            raise StateMismatchError(_refusal(planner, state.config, differences))
        scale = found
    return scale, changes


def _refusal(planner: Planner, saved: dict[str, Any], differences: list[ConfigDifference]) -> str:
    """Why a state whose config differs cannot restore: its data files' layout changed
    (naming the source, and the file where the fingerprints tell), or another pipeline."""
    listed = describe_differences(differences)
    changed = data_changes(saved, planner.pipeline_config, planner.pipeline.walk())
    sources = [
        d.path.rsplit(".", 1)[0] for d in differences if d.field and d.field[-1] in _LAYOUT_FIELDS
    ]
    if not changed and not sources:
        return (
            f"the state belongs to a different pipeline: {listed}. Restore it into the "
            "pipeline that saved it (`python -m energy_loader inspect` shows a state's "
            "config); a batch_size may only shrink by a whole factor, and a change made on "
            'purpose is declared: SavableDataLoader(..., changes=["BlendDataset.weights"]), '
            "docs/long-jobs.md"
        )
    named = "; ".join(changed) or f"the data files of {', '.join(dict.fromkeys(sources))} differ"
    return (
        f"the data files changed since the save, their layout too ({named}), so the saved "
        f"position does not exist in them: {listed}. Restore with the data files that saved "
        "the state (a copy of them elsewhere will do)"
    )


def check_checkpoints(planner: Planner, restores: dict[int, PartitionState]) -> None:
    """``StateFormatError`` naming the partition whose checkpoint the pipeline cannot restore:
    every partition's checkpoint is restored here, in the main process, so the error surfaces
    before any worker starts."""
    pipeline, config = planner.pipeline, planner.config
    try:
        for partition, entry in restores.items():
            pipeline.bind(config.partition_context(partition, planner.num_partitions))
            try:
                with values_before(pipeline, entry.changes):
                    pipeline.restore_state(entry.checkpoint)
            except StateFormatError as error:
                raise StateFormatError(f"partition {partition} checkpoint: {error}") from None
    finally:
        pipeline.reset_state()
        pipeline.bind(config.context(0))


def report_code_changes(saved: dict[str, Any], now: dict[str, Any], policy: str) -> bool:
    """Warn (``CodeChangedWarning``) or refuse (``StateMismatchError``) when a user function's
    code differs from the one that saved the state: never silent. True when it warned."""
    changed = code_differences(saved, now)
    if not changed:
        return False
    listed = "; ".join(
        f"{d.path.rsplit(CODE_SUFFIX, 1)[0]} (changed: {', '.join(changed_parts(d.saved, d.now))})"
        for d in changed
    )
    message = (
        f"the code of {listed} differs from the code that saved the state (the same name, "
        "other code, defaults, arguments or data it reads: a fixed bug?)"
    )
    if policy == "refuse":
        raise StateMismatchError(
            f"{message}; restore with the code that saved it, or build the loader with "
            "on_code_change='warn' to continue with the new code"
        )
    warnings.warn(
        f"{message}: the restore continues with the new code, so the items made from here on "
        "may differ from those the saving run would have made (on_code_change='refuse' "
        "refuses instead)",
        CodeChangedWarning,
        stacklevel=4,
    )
    return True


def report_data_changes(planner: Planner, saved: dict[str, Any], policy: str) -> bool:
    """Warn (``DataChangedWarning``) or refuse (``StateMismatchError``) when a source's data
    files differ from those that saved the state, their layout unchanged (a file rewritten in
    place): never silent. True when it warned."""
    changed = data_changes(saved, planner.pipeline_config, planner.pipeline.walk())
    if not changed:
        return False
    message = f"the data files changed since the save: {'; '.join(changed)}"
    if policy == "refuse":
        raise StateMismatchError(
            f"{message}. Restore with the original data files, or build the loader with "
            "on_data_change='warn' to continue with the new data"
        )
    warnings.warn(
        f"{message}. The restore continues at the saved position in the new data, so the "
        "items from here on may differ from those the saving run would have made (restore "
        "with the original data files for those; on_data_change='refuse' refuses instead)",
        DataChangedWarning,
        stacklevel=4,
    )
    return True


def _batch_size_scale(differences: list[ConfigDifference], config: dict[str, Any]) -> int | None:
    """1 when nothing differs; the saved/now batch-size ratio when only that differs.

    A smaller batch size that divides the saved one is accepted when the batch is the
    outermost stage that keeps state (only pass-through wrappers above it), so a replay of
    ``k`` saved batches is a replay of ``k * ratio`` new ones.
    """
    if not differences:
        return 1
    if len(differences) != 1:
        return None
    (difference,) = differences
    if not difference.field or difference.field[-1] != "batch_size":
        return None
    saved, now = difference.saved, difference.now
    if not (isinstance(saved, int) and isinstance(now, int)) or now <= 0 or saved % now:
        return None
    node = config
    for name in difference.field[:-1]:
        if node.get("type") not in _PASS_THROUGH_TYPES or name != "inner":
            return None
        node = node[name]
    if node.get("type") != "BatchDataset":
        return None
    return saved // now


def check_partition_count(state: RankState, num_partitions: int, world_size: int) -> None:
    """``StateMismatchError`` naming both counts unless ``state`` has ``num_partitions``."""
    if state.num_partitions == num_partitions:
        return
    saved = state.num_partitions
    advice = (
        f"Pass num_partitions={saved} to the loader, or leave num_partitions unset (a "
        "loader given none adopts the saved count; in a torch.distributed.checkpoint load, "
        "with planner=energy_loader.dcp.LoadPlanner()), to continue that stream"
        if saved % world_size == 0
        else f"{saved} partitions run on a world size in {world_sizes_for(saved)}, "
        f"not on world_size={world_size}"
    )
    raise StateMismatchError(
        f"the state was saved with num_partitions={saved} (on world_size="
        f"{state.world_size} x num_workers={state.num_workers}); this loader runs "
        f"num_partitions={num_partitions}. {advice}"
    )
