"""One drop-in job, one seed and one id, whatever each rank's own seeding.

Each epoch's per-sample seeds derive from the job's seed, a hash of the generator that drives
the loader at the job's first ``iter()``. A script that seeds per rank would give every rank
another hash, and a restore on another world size continues every rank from one rank's state.
So, as torch's ``DataLoader`` shares rank 0's base seed, the ranks of a loader under a
``DistributedSampler`` of several replicas agree at the job's first ``iter()`` (and the first
after a restore) on rank 0's seed and on a random job id kept across restores, with one
``all_gather_object``: every rank reaches the same verdict (a new job takes rank 0's; a
restored one must already agree, else every rank raises the same ``StateMismatchError``).
Every rank must call ``iter()`` then, as with torch's; a rank that never does leaves the others
waiting up to the process group's timeout. Other loaders (one process, another sampler: an
evaluation on rank 0) exchange nothing and keep their own hash and no id.

:func:`check_one_save` is the same rule where saved rank states meet at a restore.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import attrs

from ...errors import StateMismatchError
from ...process_groups import data_parallel_layout, process_group_initialized
from ...worker import WorkerConfig
from .state import DROPIN_STATE_FORMAT, JobStart


def new_job_id() -> int:
    """A random 63-bit job id (from the OS, not from any generator the job draws from)."""
    return secrets.randbits(63)


def _group_of(config: WorkerConfig) -> tuple[Any] | None:
    """``(the loader's data-parallel group,)`` (``(None,)``: the default group) when this rank is
    one of several in a matching initialised process group; None: nothing to agree with."""
    if config.world_size <= 1 or not process_group_initialized():
        return None
    group, rank, size = data_parallel_layout(config.data_parallel_group)
    if (rank, size) != (config.rank, config.world_size):
        return None  # a loader of a simulated layout inside a real job: its own business
    return (group,)


def agree_on_job(job: JobStart, restored: bool, config: WorkerConfig) -> JobStart:
    """The job every rank of the data-parallel group runs (a collective there; ``job`` unchanged
    without a group). ``restored``: whether ``job`` comes from a restored state."""
    found = _group_of(config)
    if found is None:
        return job
    (group,) = found
    import torch.distributed as dist

    mine = (restored, job.seed, job.id, new_job_id())
    everyone: list[Any] = [None] * config.world_size
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as error:
        raise RuntimeError(
            "the drop-in loader's first iter() of a job (or after a restore) agrees on the "
            "job's seed with every rank of its data-parallel group, and this exchange failed: "
            "every rank must call iter() on the loader together, as with torch's DataLoader "
            f"({error})"
        ) from error
    return _verdict(job, everyone)


def _verdict(job: JobStart, everyone: list[Any]) -> JobStart:
    """What every rank decides from every rank's (restored, seed, id, fresh id)."""
    restored = [rank for rank, entry in enumerate(everyone) if entry[0]]
    if restored and len(restored) != len(everyone):
        fresh = [rank for rank in range(len(everyone)) if rank not in restored]
        raise StateMismatchError(
            f"data-parallel ranks {restored} continue a restored job but ranks {fresh} start "
            "a new one: restore every rank's loader (from the states of one save) before the "
            "first iter(), or none"
        )
    first = everyone[0]
    if not restored:  # a new job: rank 0's seed and id (its order stays this rank's own)
        return attrs.evolve(job, seed=first[1], id=first[3])
    ids = {entry[2] for entry in everyone}
    seeds = {entry[1] for entry in everyone}
    if ids == {None}:  # saved where no process group shared a job (one process per save)
        if len(seeds) == 1:  # one job: name it now
            return attrs.evolve(job, id=first[3])
        return job  # ranks that each hashed their own seed: each continues its own
    if len(ids) > 1 or len(seeds) > 1:
        raise StateMismatchError(
            "the ranks restored states of different jobs or runs: "
            + "; ".join(f"rank {r}: job id {e[2]}, seed {e[1]}" for r, e in enumerate(everyone))
            + ". Restore every rank from the states of one save"
        )
    return job


def _position(state: dict[str, Any]) -> tuple[Any, ...]:
    """The job's position a rank state names: the same on every rank of one save (the
    dealing's ``rank`` and the last batch's proof are the rank's own)."""
    dealt = state.get("distributed")
    if isinstance(dealt, dict):
        dealt = {name: value for name, value in dealt.items() if name != "rank"}
    return (state.get("started"), state.get("epoch"), state.get("used"), dealt)


def _job_of(state: dict[str, Any]) -> tuple[Any, Any]:
    job = state.get("job")
    if not isinstance(job, dict):
        return None, None
    return job.get("seed"), job.get("id")


def check_one_save(states: Sequence[Any], *, across: bool) -> None:
    """Raise ``StateMismatchError`` unless the drop-in rank states ``states`` can be the states of
    one save of one job: one job id (and seed) and, under a ``DistributedSampler``, one position.
    ``across`` (a restore on another world size): the seeds must agree even without a job id."""
    maps = [
        (index, s)
        for index, s in enumerate(states)
        if isinstance(s, dict) and s.get("format") == DROPIN_STATE_FORMAT and s.get("kind") == "map"
    ]
    started = [(index, s) for index, s in maps if s.get("started")]
    if len(started) < 2 and len(maps) < 2:
        return

    def rank_of(index: int, state: dict[str, Any]) -> Any:
        return state.get("rank", index)

    jobs = {rank_of(i, s): _job_of(s) for i, s in started}
    ids = {job_id for _, job_id in jobs.values()}
    seeds = {seed for seed, _ in jobs.values()}
    if len(ids) > 1 or ((ids != {None} or across) and len(seeds) > 1):
        listed = "; ".join(f"rank {r}: job id {i}, seed {s}" for r, (s, i) in jobs.items())
        what = (
            "another run's or another job's state is mixed in"
            if len(ids) > 1
            else "their ranks held their own job seeds (no DistributedSampler, or no process "
            "group at the first iter()), so one rank's state cannot continue the others' "
            "samples: restore on the world size that saved them, each rank from its own state"
        )
        raise StateMismatchError(
            f"the rank states given do not belong to one save of one job ({listed}): {what}. "
            "Restore every rank from the states of one save (keep each save's per-rank "
            "files in a folder of their own)"
        )
    if all("DistributedSampler" in str(s.get("config", {}).get("sampler")) for _, s in maps):
        positions = {rank_of(i, s): _position(s) for i, s in maps}
        if len(set(map(repr, positions.values()))) > 1:
            listed = "; ".join(
                f"rank {r}: epoch {p[1]}, {p[2]} batches used" + ("" if p[0] else " (not started)")
                for r, p in positions.items()
            )
            raise StateMismatchError(
                "the rank states given stand at different positions, but under a "
                f"DistributedSampler every rank of a save has used as many batches ({listed}): "
                "states of different saves are mixed. Restore every rank from the states of "
                "one save"
            )
