"""Loader states across the ranks of a ``torch.distributed`` job; the only module that talks
to process groups.

Each rank saves its own state (the scalable path: the loader in a DCP save, or one file per
rank with :func:`save_state_rank_file` / :func:`restore_state_rank_file`), or, for small jobs,
:func:`save_state_global` gathers every data-parallel rank's state to one rank and
:func:`restore_state_global` hands each rank its entry. Collectives run over the loader's
data-parallel group; ``dst_rank`` and ``src_rank`` are global ranks, list positions are
data-parallel ranks. No rank is left hanging: arguments every rank judges alike are checked
before any collective, and whatever one rank finds wrong travels through the collective in
place of a state, so that every rank raises (docs/distributed.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .errors import StateFormatError, StateMismatchError, WorkerError
from .process_groups import data_parallel_layout, process_group_initialized
from .state.plain import StateReader
from .state.rank_file import ReadTally, write_rank_file
from .state.rank_folder import RankFolder, rank_file_name, rank_state_files
from .worker import WorkerConfig

if TYPE_CHECKING:  # structurally: this module never imports the loader at run time
    from .loader.engine import Engine, EngineOwner

__all__ = [
    "data_parallel_ranks",
    "rank_state_files",
    "rank_state_key",
    "rank_state_path",
    "read_rank_state_files",
    "restore_state_global",
    "restore_state_rank_file",
    "save_state_global",
    "save_state_rank_file",
]

# Error classes a refusal may be re-raised as on every rank; anything else becomes RuntimeError.
_ERROR_CLASSES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (StateMismatchError, StateFormatError, WorkerError, TypeError, ValueError)
}
# How many distinct problems an error message lists before it says "and N more".
_MAX_LISTED = 4


# -- process groups (see energy_loader.process_groups) -------------------------------------------


@attrs.frozen
class _Group:
    """A loader's data-parallel group as this process sees it: ``members`` (global ranks in
    data-parallel order), ``rank``; ``collective`` False without torch.distributed."""

    handle: Any
    members: tuple[int, ...]
    rank: int
    collective: bool

    @property
    def size(self) -> int:
        return len(self.members)

    def position_of(self, global_rank: int, name: str) -> int:
        """The data-parallel rank of ``global_rank``; ``ValueError`` outside the group."""
        if global_rank not in self.members:
            raise ValueError(
                f"`{name}`={global_rank} is not in this loader's data-parallel group, whose "
                f"global ranks are {_describe_ranks(self.members)}; pass one of them (e.g. "
                "data_parallel_ranks(loader)[0]); every data-parallel group names its own"
            )
        return self.members.index(global_rank)


def _group_of(config: WorkerConfig) -> _Group:
    import torch.distributed as dist

    if not process_group_initialized():
        return _Group(None, tuple(range(config.world_size)), config.rank, collective=False)
    handle, rank, _ = data_parallel_layout(config.data_parallel_group)
    return _Group(handle, tuple(dist.get_process_group_ranks(handle)), rank, collective=True)


def _require_collective(group: _Group, what: str) -> None:
    if not group.collective and group.size > 1:
        raise ValueError(
            f"{what} exchanges states over torch.distributed, but no process group is "
            f"initialised while the loader's WorkerConfig has world_size={group.size}; call "
            "torch.distributed.init_process_group(...) first, or save and restore each rank "
            "with save_state_rank()/restore_state_rank()"
        )


def _check_layout(config: WorkerConfig, group: _Group) -> None:
    """``ValueError`` unless the loader's rank/world size are its place in ``group``."""
    if group.collective and (config.rank, config.world_size) != (group.rank, group.size):
        raise ValueError(
            f"the loader's WorkerConfig says data-parallel rank {config.rank} of "
            f"{config.world_size}, but in its data-parallel group this process is rank "
            f"{group.rank} of {group.size}; build it with WorkerConfig.from_process_group("
            "num_workers=..., data_parallel_group=...)"
        )


def data_parallel_ranks(loader: EngineOwner | WorkerConfig) -> list[int]:
    """The global ranks of the loader's data-parallel group, in data-parallel-rank order.

    To pick a ``dst_rank``/``src_rank`` in the group (with tensor parallelism, each group gathers to
    its own first rank)::

        states = save_state_global(loader, data_parallel_ranks(loader)[0])

    Without a process group: ``[0]`` for world size 1, else ``ValueError``.
    """
    group = _group_of(_config_of(loader))
    _require_collective(group, "data_parallel_ranks")
    return list(group.members)


# -- argument checks ---------------------------------------------------------------------------


def _engine_of(value: Any) -> Engine | None:
    """The engine of a loader of this library, told by its interface: this module knows the
    engine protocol (:mod:`energy_loader.loader.engine`), never the loader classes."""
    engine = getattr(value, "engine", None)
    if isinstance(getattr(engine, "worker_config", None), WorkerConfig):
        return engine  # type: ignore[no-any-return]
    return None


def _config_of(loader: Any) -> WorkerConfig:
    if isinstance(loader, WorkerConfig):
        return loader
    engine = _engine_of(loader)
    if engine is not None:
        return engine.worker_config
    raise TypeError(f"expected a SavableDataLoader or a WorkerConfig (got {type(loader).__name__})")


def _require_loader(loader: Any) -> Engine:
    """The engine of ``loader``, a loader that saves state (``TypeError`` otherwise)."""
    engine = _engine_of(loader)
    if engine is None:
        raise TypeError(f"`loader` must be a SavableDataLoader (got {type(loader).__name__})")
    if not getattr(loader, "saves_state", True):
        raise TypeError(
            f"`loader` is a {type(loader).__name__}, which saves no state; use SavableDataLoader"
        )
    return engine


def _require_rank(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be a global rank, an int (got {value!r})")
    if value < 0:
        raise ValueError(f"`{name}` must be a global rank >= 0 (got {value})")
    return value


# -- refusals: a rank's problem, sent through a collective in place of a state -----------------


@attrs.frozen
class _Refusal:
    """Why one rank cannot take part. Crosses the wire (pickled) only, never stored."""

    kind: str
    message: str

    @classmethod
    def of(cls, error: BaseException) -> _Refusal:
        return cls(type(error).__name__, str(error))


def _describe_ranks(ranks: Sequence[int]) -> str:
    """``[0-3, 7]``: a compact, sorted list of ranks."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return "[" + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) + "]"


def _combined_error(action: str, refusals: dict[int, _Refusal], size: int) -> Exception:
    """One error for every rank, listing which data-parallel ranks refused and why."""
    by_problem: dict[_Refusal, list[int]] = {}
    for rank, refusal in sorted(refusals.items()):
        by_problem.setdefault(refusal, []).append(rank)
    lines = [
        f"data-parallel rank(s) {_describe_ranks(ranks)}: {refusal.kind}: {refusal.message}"
        for refusal, ranks in list(by_problem.items())[:_MAX_LISTED]
    ]
    if len(by_problem) > _MAX_LISTED:
        lines.append(f"... and {len(by_problem) - _MAX_LISTED} more distinct problems")
    first = refusals[min(refusals)]
    error_class = _ERROR_CLASSES.get(first.kind, RuntimeError)
    return error_class(
        f"{action} failed on {len(refusals)} of {size} data-parallel ranks (every rank "
        "raises this):\n  " + "\n  ".join(lines)
    )


def _agree(group: _Group, action: str, problem: BaseException | None) -> None:
    """Every rank raises if any rank of the group has a problem (one all_gather_object)."""
    import torch.distributed as dist

    if not (group.collective and group.size > 1):
        if problem is not None:
            raise problem
        return
    gathered: list[_Refusal | None] = [None] * group.size
    mine = None if problem is None else _Refusal.of(problem)
    dist.all_gather_object(gathered, mine, group=group.handle)
    refusals = {rank: r for rank, r in enumerate(gathered) if r is not None}
    if refusals:
        raise _combined_error(action, refusals, group.size) from problem


# -- gather ----------------------------------------------------------------------------------------


def save_state_global(
    loader: EngineOwner, dst_rank: int, *, held_back: int = 0
) -> list[dict[str, Any]] | None:
    """Gather every data-parallel rank's state to ``dst_rank``: a list there, ``None`` elsewhere.

    A collective over the loader's data-parallel group, every rank with the same ``dst_rank`` (a
    *global* rank in the group, else ``ValueError`` on every rank). Entry ``i`` is data-parallel
    rank ``i``'s ``save_state_rank(held_back=held_back)`` (each rank passes its own count): plain
    data for ``json.dump`` or ``torch.save`` and :func:`restore_state_global`. A rank that cannot
    save raises its error and ``dst_rank`` raises one naming every failing rank; none hangs. Cost
    grows with the ranks: beyond a few hundred prefer :func:`save_state_rank_file` or DCP
    (docs/distributed.md). Without a process group, world size 1 returns ``[state]``. Example::

        states = save_state_global(loader, dst_rank=0)
        if states is not None:
            with open(path, "w") as file:
                json.dump(states, file)
    """
    import torch.distributed as dist

    engine = _require_loader(loader)
    dst_rank = _require_rank(dst_rank, "dst_rank")
    group = _group_of(engine.worker_config)
    _require_collective(group, "save_state_global")
    dst_position = group.position_of(dst_rank, "dst_rank")
    problem: BaseException | None = None
    try:
        _check_layout(engine.worker_config, group)
        payload: dict[str, Any] | _Refusal = engine.save(held_back)
    except Exception as error:
        problem, payload = error, _Refusal.of(error)
    gathered: list[Any] | None = [None] * group.size if group.rank == dst_position else None
    if group.collective:
        dist.gather_object(payload, gathered, dst=dst_rank, group=group.handle)
    elif gathered is not None:
        gathered[0] = payload
    if problem is not None:
        raise problem
    if gathered is None:
        return None
    refusals = {rank: p for rank, p in enumerate(gathered) if isinstance(p, _Refusal)}
    if refusals:
        raise _combined_error("save_state_global", refusals, group.size)
    return gathered


# -- scatter -------------------------------------------------------------------------------------


def _check_states_list(states: Any) -> list[Any]:
    """The list-level checks: every rank's state of one save, in rank order."""
    if not isinstance(states, (list, tuple)):
        raise TypeError(
            "`states` must be the list of every data-parallel rank's state that "
            f"save_state_global returned (got {type(states).__name__})"
        )
    if not states:
        raise StateMismatchError("`states` is empty; pass every rank's state of one save")
    saved_size = StateReader(states[0], "states[0]").int("world_size", minimum=1)
    if len(states) != saved_size:
        raise StateMismatchError(
            f"`states` holds {len(states)} rank states but they were saved with "
            f"world_size={saved_size}; pass every rank's state of one save, in rank order"
        )
    for index, entry in enumerate(states):
        reader = StateReader(entry, f"states[{index}]")
        rank, world_size = reader.int("rank"), reader.int("world_size", minimum=1)
        if world_size != saved_size:
            raise StateMismatchError(
                f"states[{index}] was saved with world_size={world_size}, states[0] with "
                f"{saved_size}: the states of different saves are mixed; pass every rank's "
                "state of one save, in rank order"
            )
        if rank != index:
            raise StateMismatchError(
                f"states[{index}] is the state of rank {rank}; the list must be in "
                "data-parallel rank order, as save_state_global returns it"
            )
    return list(states)


def _wanted(
    engine: Engine, states: list[Any], size: int, ranks: Sequence[int], own: int
) -> dict[int, list[Any]]:
    """The states each rank in ``ranks`` needs: its own on the saved world size, else the lowest
    rank's and those that ran its partitions. ``own`` is asked first, so a loader that restores only
    on the saved world size refuses there."""
    if len(states) == size:
        return {r: [states[r]] for r in ranks}
    (first,) = engine.decode([states[0]])
    needed = {own: engine.saved_ranks_needed(first, own)}
    for rank in ranks:
        if rank not in needed:  # the scatter's source, for the other ranks of its layout
            needed[rank] = engine.saved_ranks_needed(first, rank)
    return {r: [states[i] for i in sorted({0, *needed[r]})] for r in ranks}


def _scattered_entries(
    engine: Engine, states: Any, group: _Group, src_position: int, src_rank: int
) -> Any:
    """The states this rank needs (sent by ``src_rank``), or the src's refusal."""
    import torch.distributed as dist

    envelopes: list[Any] | None = None
    if group.rank == src_position:
        try:
            checked = _check_states_list(states)
            engine.check_one_save(checked, across=len(checked) != group.size)
            wanted = _wanted(engine, checked, group.size, range(group.size), group.rank)
            envelopes = [wanted[r] for r in range(group.size)]
        except Exception as error:
            refusal = _Refusal(type(error).__name__, f"{error} (found by src_rank {src_rank})")
            envelopes = [refusal] * group.size
    if not group.collective:
        return envelopes[0] if envelopes is not None else None
    received: list[Any] = [None]
    dist.scatter_object_list(received, envelopes, src=src_rank, group=group.handle)
    return received[0]


def restore_state_global(
    loader: EngineOwner,
    states: Sequence[dict[str, Any]] | None,
    *,
    src_rank: int | None = None,
) -> None:
    """Restore every data-parallel rank from the list of all ranks' states.

    A collective over the data-parallel group, every rank with the same ``src_rank``:
    ``src_rank=None``: every rank passes the full list; ``src_rank=r`` (a global rank in the group):
    only ``r`` passes it (others ``None``) and each rank is sent the few entries it needs. The list
    is one save's states in rank order, possibly of another world size or worker count with the same
    ``num_partitions``. If anything does not fit on any rank every rank raises the same
    ``StateMismatchError``/``StateFormatError``/``TypeError`` and no loader is changed; a
    ``src_rank`` outside the group is a ``ValueError``. Without a process group the full-list form
    restores this loader and the scatter form needs world size 1. Example::

        states = json.load(open(path)) if dist.get_rank() == 0 else None
        restore_state_global(loader, states, src_rank=0)
    """
    engine = _require_loader(loader)
    if src_rank is not None:
        src_rank = _require_rank(src_rank, "src_rank")
    group = _group_of(engine.worker_config)
    entries: Any = None
    if src_rank is not None:
        _require_collective(group, "restore_state_global with a src_rank")
        src_position = group.position_of(src_rank, "src_rank")
        entries = _scattered_entries(engine, states, group, src_position, src_rank)
    problem: BaseException | None = None
    plan: Any = None
    try:
        if src_rank is None:
            checked = _check_states_list(states)
            engine.check_one_save(checked, across=len(checked) != group.size)
            entries = _wanted(engine, checked, group.size, [group.rank], group.rank)[group.rank]
        if isinstance(entries, _Refusal):
            raise _ERROR_CLASSES.get(entries.kind, RuntimeError)(entries.message)
        _check_layout(engine.worker_config, group)
        plan = engine.plan(engine.decode(entries))
    except Exception as error:
        problem = error
    _agree(group, "restore_state_global", problem)
    engine.apply(plan)


# -- each rank its own state: DCP keys and per-rank files ------------------------------------------


def _rank_stem(config: WorkerConfig, prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix or "/" in prefix or os.sep in prefix:
        raise ValueError(
            f"`prefix` must be a non-empty name without path separators (got {prefix!r})"
        )
    return rank_file_name(prefix, config.rank, config.world_size)


def rank_state_key(loader: EngineOwner | WorkerConfig, prefix: str = "loader") -> str:
    """A per-rank name, ``loader_rank_00003_of_00016``, for things saved once per rank.

    Not for ``torch.distributed.checkpoint``: there the loader goes under one common key on every
    rank, so a job saved on ``R`` ranks loads on ``R'``::

        dcp.save({"model": model_state, "loader": loader}, checkpoint_id=path)
        dcp.load({"model": model_state, "loader": fresh_loader}, checkpoint_id=path)

    :class:`energy_loader.dcp.LoadPlanner` refuses a per-rank key on another world size.
    """
    return _rank_stem(_config_of(loader), prefix)


def rank_state_path(
    directory: str | os.PathLike[str],
    loader: EngineOwner | WorkerConfig,
    prefix: str = "loader",
) -> Path:
    """This rank's state file in ``directory``: ``loader_rank_00003_of_00008.pt``."""
    return Path(directory) / (_rank_stem(_config_of(loader), prefix) + ".pt")


def save_state_rank_file(
    loader: EngineOwner, directory: str | os.PathLike[str], prefix: str = "loader"
) -> Path:
    """Write this rank's state to its own file in ``directory``; returns the path.

    No collective: call it on every rank. The file (:mod:`energy_loader.state.rank_file`) is written
    atomically, so a crash leaves the old file or the new one; the directory is created if needed.
    Tensor-parallel peers share a file name (docs/distributed.md).
    """
    engine = _require_loader(loader)
    return write_rank_file(rank_state_path(directory, loader, prefix), engine.save(0))


def restore_state_rank_file(
    loader: EngineOwner,
    directory: str | os.PathLike[str],
    prefix: str = "loader",
    *,
    tally: ReadTally | None = None,
) -> None:
    """Restore this rank from the files in ``directory`` written by :func:`save_state_rank_file`.

    No collective. Reads about what its own file would hold, whatever the old and new world sizes
    (:func:`read_rank_state_files`); nothing is unpickled and every byte read is checksummed. Raises
    ``FileNotFoundError`` without state files, ``StateFormatError`` for a damaged file,
    ``StateMismatchError`` for files of two saves or a state that does not fit. ``tally`` (a
    :class:`~energy_loader.state.rank_file.ReadTally`) counts bytes and files read.
    """
    engine = _require_loader(loader)
    engine.apply(engine.plan(read_rank_state_files(loader, directory, prefix, tally=tally)))


def read_rank_state_files(
    loader: EngineOwner,
    directory: str | os.PathLike[str],
    prefix: str | None = "loader",
    *,
    tally: ReadTally | None = None,
) -> list[Any]:
    """The saved states ``loader``'s rank restores from, read from ``directory``'s rank files.

    What :func:`restore_state_rank_file` restores from, without restoring: this rank's own file on
    the saved world size, else only the headers and partitions it now runs (docs/distributed.md).
    One more file of the save is read so that a file of another save in the folder is a
    ``StateMismatchError``. ``prefix=None`` takes the prefix the files have. Changes nothing; raises
    as :func:`restore_state_rank_file` does.
    """
    engine = _require_loader(loader)
    config = engine.worker_config
    if prefix is not None:
        _rank_stem(config, prefix)
    with RankFolder(directory, prefix, config.rank, config.world_size, tally) as folder:
        return engine.read_rank_files(folder)
