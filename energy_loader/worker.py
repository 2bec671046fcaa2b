"""Who is iterating: the rank and worker layout, per-worker seeds, and the worker context.

A pipeline is built once, in the main process, without knowing where it will run. The loader
then tells every copy of it who it is: which data-parallel rank, which worker process of that
rank, and the pipeline seed. Sources shard by that context and random components derive their
streams from it, at iteration time, so wrappers never take a worker config in their
constructors.

Code inside the pipeline (a user's map function, a source) asks :func:`current_worker`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

import attrs

from .rng import stable_hash

__all__ = ["WorkerConfig", "WorkerContext", "current_worker"]


def _non_negative_int(name: str):
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative integer (got {value!r})")

    return check


@attrs.frozen
class WorkerConfig:
    """The data-parallel layout of one rank: rank, world size, workers, seed.

    ``rank`` and ``world_size`` are the *data-parallel* rank and size: ranks that must see
    identical samples (tensor- or pipeline-parallel peers) share a data-parallel rank.
    ``data_parallel_group`` is the ``torch.distributed`` group over which states are gathered
    and scattered; ``None`` means the default group.

    Example::

        WorkerConfig(rank=3, world_size=8, num_workers=2, seed=1234)
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

    @classmethod
    def from_env(cls, *, num_workers: int = 0, seed: int = 0) -> WorkerConfig:
        """The layout of this process: an initialised process group, torchrun's variables, or 1.

        Order of precedence: an initialised default ``torch.distributed`` process group, then
        the ``RANK``/``WORLD_SIZE`` environment variables torchrun sets, then rank 0 of 1.
        """
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                num_workers=num_workers,
                seed=seed,
            )
        rank_text, world_text = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        if rank_text is not None and world_text is not None:
            try:
                rank, world_size = int(rank_text), int(world_text)
            except ValueError:
                raise ValueError(
                    f"RANK and WORLD_SIZE must be integers (got RANK={rank_text!r}, "
                    f"WORLD_SIZE={world_text!r})"
                ) from None
            return cls(rank=rank, world_size=world_size, num_workers=num_workers, seed=seed)
        return cls(num_workers=num_workers, seed=seed)

    def context(self, worker_id: int) -> WorkerContext:
        """The context of one worker of this rank (worker 0 of 1 when ``num_workers == 0``)."""
        workers = max(1, self.num_workers)
        if not 0 <= worker_id < workers:
            raise ValueError(f"`worker_id` must be in range({workers}) (got {worker_id})")
        return WorkerContext(
            rank=self.rank,
            world_size=self.world_size,
            worker_id=worker_id,
            num_workers=workers,
            seed=self.seed,
        )


@attrs.frozen
class WorkerContext:
    """Where one copy of the pipeline runs: plain numbers, cheap to send to a worker.

    ``num_workers`` is at least 1 here: the main process iterating alone is worker 0 of 1.
    The pipeline is split into ``num_shards`` disjoint shards; this copy reads
    ``shard_index``.
    """

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    num_workers: int = 1
    seed: int = 0

    @property
    def shard_index(self) -> int:
        """This copy's shard among all ranks' workers, rank-major."""
        return self.rank * self.num_workers + self.worker_id

    @property
    def num_shards(self) -> int:
        """How many copies of the pipeline run in the whole job."""
        return self.world_size * self.num_workers

    @property
    def worker_seed(self) -> int:
        """A seed distinct for every (seed, rank, worker) triple and stable across runs."""
        return stable_hash("worker", self.seed, self.rank, self.worker_id)


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


def set_process_worker(context: WorkerContext) -> None:
    """Make ``context`` this process's worker for good (called once in each worker process)."""
    _PROCESS_DEFAULT[:] = [context]
