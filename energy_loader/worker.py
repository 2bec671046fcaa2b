"""Who is iterating: the rank and worker layout, per-worker seeds, and the worker context.

A pipeline is built once, in the main process; the loader tells every copy at iteration time
which rank, worker and seed it runs with, so wrappers never take a worker config. Code inside
the pipeline (a map function, a source) asks :func:`current_worker`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from .rng import stable_hash

__all__ = ["WorkerConfig", "WorkerContext", "current_worker"]


def _non_negative_int(name: str):
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative integer (got {value!r})")

    return check


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"the environment variable {name} must be an integer (got {name}={text!r}); "
            "torchrun sets it, so check the launcher"
        ) from None
    if value < 0:
        raise ValueError(f"the environment variable {name} must be >= 0 (got {name}={value})")
    return value


def _torchrun_layout(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` from torchrun's variables, ``None`` when they are absent."""
    rank, world_size = _env_int(environ, "RANK"), _env_int(environ, "WORLD_SIZE")
    if rank is None and world_size is None:
        return None
    if rank is None or world_size is None:
        present, missing = ("RANK", "WORLD_SIZE") if world_size is None else ("WORLD_SIZE", "RANK")
        raise ValueError(
            f"{present} is set but {missing} is not; torchrun sets both (set both, or neither "
            "for a single process)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(
            f"RANK must be in range(WORLD_SIZE) (got RANK={rank}, WORLD_SIZE={world_size})"
        )
    local_rank, local_size = _env_int(environ, "LOCAL_RANK"), _env_int(environ, "LOCAL_WORLD_SIZE")
    if local_rank is not None and local_rank > rank:
        raise ValueError(
            f"LOCAL_RANK={local_rank} cannot exceed RANK={rank}: the local rank counts the "
            "processes of this node only"
        )
    if local_size is not None and not 1 <= local_size <= world_size:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local_size} must be in 1..WORLD_SIZE (WORLD_SIZE={world_size})"
        )
    if local_size is not None and local_rank is not None and local_rank >= local_size:
        raise ValueError(f"LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_size}")
    return rank, world_size


@attrs.frozen
class WorkerConfig:
    """The data-parallel layout of one rank: rank, world size, workers, seed.

    ``rank``/``world_size`` are the *data-parallel* ones sources shard by (model-parallel peers
    share one). ``data_parallel_group`` (``None``: the default group) is where
    :func:`~energy_loader.distributed.save_state_global` gathers; not sent to workers nor compared::

        WorkerConfig.from_process_group(num_workers=2, seed=1234)      # every rank a replica
        WorkerConfig.from_process_group(num_workers=2, data_parallel_group=mesh["dp"])
        WorkerConfig.from_env(num_workers=2)   # process group, torchrun variables, or 0 of 1
        WorkerConfig(rank=3, world_size=8, num_workers=2, seed=1234)   # explicit
    """

    rank: int = attrs.field(default=0, validator=_non_negative_int("rank"))
    world_size: int = attrs.field(default=1, validator=_non_negative_int("world_size"))
    num_workers: int = attrs.field(default=0, validator=_non_negative_int("num_workers"))
    seed: int = attrs.field(default=0, validator=_non_negative_int("seed"))
    data_parallel_group: Any = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"`world_size` must be at least 1 (got {self.world_size})")
        if self.rank >= self.world_size:
            raise ValueError(
                f"`rank` must be below `world_size` (got rank={self.rank}, "
                f"world_size={self.world_size})"
            )
        if self.data_parallel_group is not None:
            from .process_groups import check_group_layout

            check_group_layout(self.data_parallel_group, self.rank, self.world_size)

    @classmethod
    def from_process_group(
        cls, *, num_workers: int = 0, seed: int = 0, data_parallel_group: Any = None
    ) -> WorkerConfig:
        """The layout of this process in an initialised ``torch.distributed`` job.

        With model parallelism pass the data-parallel group (a ``ProcessGroup`` or 1-D
        ``DeviceMesh``, as in the class example); ``None``: every rank of the default group is a
        replica. ``ValueError`` without a process group or outside the group, ``TypeError`` for a
        non-group.
        """
        from .process_groups import data_parallel_layout

        group, rank, world_size = data_parallel_layout(data_parallel_group)
        return cls(rank, world_size, num_workers, seed, data_parallel_group=group)

    @classmethod
    def from_env(cls, *, num_workers: int = 0, seed: int = 0) -> WorkerConfig:
        """The layout of this process: an initialised process group, torchrun's variables, or 1.

        In that order: :meth:`from_process_group`, torchrun's ``RANK``/``WORLD_SIZE`` (checked
        against ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``), rank 0 of 1; every rank a replica. A
        half-set or malformed environment is a ``ValueError``.
        """
        from .process_groups import process_group_initialized

        if process_group_initialized():
            return cls.from_process_group(num_workers=num_workers, seed=seed)
        rank, world_size = _torchrun_layout(os.environ) or (0, 1)
        return cls(rank=rank, world_size=world_size, num_workers=num_workers, seed=seed)

    def context(self, worker_id: int) -> WorkerContext:
        """The context of one worker of this rank with the default partitions.

        With the default ``num_partitions`` (one partition per worker of every rank) worker
        ``w`` of rank ``r`` runs partition ``r + w * world_size`` of
        ``world_size * max(1, num_workers)`` (see :mod:`energy_loader.loader.partitions`).
        """
        workers = max(1, self.num_workers)
        if not 0 <= worker_id < workers:
            raise ValueError(f"`worker_id` must be in range({workers}) (got {worker_id})")
        return self.partition_context(
            self.rank + worker_id * self.world_size, self.world_size * workers, worker_id
        )

    def partition_context(
        self, partition: int, num_partitions: int, worker_id: int = 0
    ) -> WorkerContext:
        """The context of logical partition ``partition`` of ``num_partitions``, run here."""
        if not 0 <= partition < num_partitions:
            raise ValueError(f"`partition` must be in range({num_partitions}) (got {partition})")
        return WorkerContext(
            rank=self.rank,
            world_size=self.world_size,
            worker_id=worker_id,
            num_workers=max(1, self.num_workers),
            seed=self.seed,
            partition=partition,
            num_partitions=num_partitions,
        )


@attrs.frozen
class WorkerContext:
    """Where one copy of the pipeline runs: plain numbers, cheap to send to a worker.

    Sources shard and random components seed by ``partition`` of ``num_partitions``, so a copy's
    items do not depend on who runs it; ``rank``, ``world_size``, ``worker_id`` and ``num_workers``
    (at least 1) say who runs it now, for logs only, and may change after a restore.
    """

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    num_workers: int = 1
    seed: int = 0
    partition: int = 0
    num_partitions: int = 1

    @property
    def shard_index(self) -> int:
        """The shard this copy reads: its logical partition."""
        return self.partition

    @property
    def num_shards(self) -> int:
        """How many shards the data is split into: the number of logical partitions."""
        return self.num_partitions

    def share_of(self, total: int) -> int:
        """This partition's share of a job-wide count: ``total // P``, plus one for the first
        ``total % P`` partitions. The shares of all partitions add up to ``total``."""
        quotient, remainder = divmod(total, self.num_partitions)
        return quotient + (self.partition < remainder)

    @property
    def worker_seed(self) -> int:
        """A seed distinct for every (seed, partition) pair, stable across runs and layouts."""
        return stable_hash("partition", self.seed, self.partition)


_ACTIVE: contextvars.ContextVar[WorkerContext | None] = contextvars.ContextVar(
    "energy_loader_worker", default=None
)
_PROCESS_DEFAULT: list[WorkerContext] = []


def current_worker() -> WorkerContext:
    """The context of the pipeline copy that is running now.

    Inside a loader's worker process this is that worker; in the main process of a loader with
    ``num_workers=0`` it is worker 0 of 1 of the loader's rank while the loader fetches; outside
    any loader it is rank 0 of 1, worker 0 of 1, seed 0.
    """
    active = _ACTIVE.get()
    if active is not None:
        return active
    if _PROCESS_DEFAULT:
        return _PROCESS_DEFAULT[0]
    return WorkerContext()


@contextlib.contextmanager
def active_worker(context: WorkerContext) -> Iterator[None]:
    """Make ``context`` what :func:`current_worker` returns inside the ``with`` block."""
    token = _ACTIVE.set(context)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def enter_worker(context: WorkerContext) -> contextvars.Token[WorkerContext | None]:
    """Make ``context`` current until :func:`leave_worker` (cheaper than ``active_worker``).

    For a runner that switches between partitions item by item: set and reset around one
    ``next()``, never across a ``yield``.
    """
    return _ACTIVE.set(context)


def leave_worker(token: contextvars.Token[WorkerContext | None]) -> None:
    """Undo :func:`enter_worker`."""
    _ACTIVE.reset(token)


def set_process_worker(context: WorkerContext) -> None:
    """Make ``context`` this process's worker for good (called once in each worker process)."""
    _PROCESS_DEFAULT[:] = [context]
