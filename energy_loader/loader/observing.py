"""Looking at a loader: what it has been doing, what it will yield next, what it runs.

:class:`ObservedLoader` gives :class:`~energy_loader.SavableDataLoader` its observing methods.
``stats()`` reads the counters the loader keeps per item (:mod:`energy_loader.metrics`) and
asks each worker for its own over the fleet's command channels; the stall warning
(:mod:`energy_loader.loader.stall`) watches the same numbers. ``peek_keys(n)`` runs a
throwaway copy of the pipeline from a save (:mod:`energy_loader.loader.peek`). Neither takes
anything from the live workers' stream. ``restore_sample(key)`` rebuilds any sample from its
restore key, and ``config()`` describes the pipeline and layout (for audits and messages).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ..dataset import attach_restore_key
from ..metrics import LoaderMetrics, StallPolicy
from ..state.plain import to_key
from ..worker import active_worker
from .stall import StallWarner

if TYPE_CHECKING:
    from ..errors import WorkerError
    from ..workers.side import WorkerSideDataset
    from .fleet import WorkerFleet
    from .planner import Planner
    from .savable_loader import SavableDataLoader

__all__ = ["ObservedLoader", "make_metrics"]

Readings = tuple[list[dict[str, float] | None], list[int]]


class ObservedLoader:
    """``stats()``, ``peek_keys()``, ``restore_sample()`` and ``config()`` (mixed into the
    loader)."""

    if TYPE_CHECKING:
        num_workers: int
        _metrics: LoaderMetrics
        _worker_side: WorkerSideDataset
        _fleet: WorkerFleet
        _failure: WorkerError | None
        _planner: Planner

    def stats(self) -> dict[str, Any]:
        """What the loader has been doing, as plain numbers: see :mod:`energy_loader.metrics`.

        ``{"since_last": {...}, "total": {...}, "queue_depth": [...]}``: per section the
        items handed out and items/s, the time ``next()`` waited (mean, p50/p90/p99, max,
        and as a fraction of the step time), decoding, saves and their latency, and per worker
        its busy fraction, checkpoint and encode seconds and payload bytes. Asks each worker
        over its command channel (a round trip, not a wait for a sample). Example::

            if step % 100 == 0:
                print(energy_loader.metrics.flatten(loader.stats()))
        """
        return self._metrics.stats()

    def peek_keys(self, n: int) -> list[Any]:
        """The restore keys of the next ``n`` items this rank will yield, without taking them.

        How: save this rank's state and run a throwaway copy of the pipeline from it in this
        process, the way a restore would, emulating the workers' order (see
        :mod:`energy_loader.loader.peek`). Exact by the same argument as save/restore, and the
        live loader is untouched: nothing is pulled from its workers and nothing buffered, so
        a later save needs no special case. Cost: one save plus making the replayed and the
        ``n`` peeked items once more in this process (global RNG states are kept). Keys run
        on across an epoch end into the epoch the next ``iter(loader)`` starts; fewer than
        ``n`` only if the pipeline has no more items at all.
        """
        from .peek import peek_keys

        return peek_keys(self, n)  # type: ignore[arg-type]

    def restore_sample(self, key: Any) -> Any:
        """Rebuild the sample (or batch) that carried ``key``."""
        key = to_key(key)
        with active_worker(self._planner.config.context(0)):
            return attach_restore_key(self._planner.pipeline.restore_sample(key), key)

    def config(self) -> dict[str, Any]:
        """The pipeline's configuration plus the loader's layout."""
        config = self._planner.config
        return {
            "pipeline": self._planner.pipeline_config,
            "rank": config.rank,
            "world_size": config.world_size,
            "num_workers": self.num_workers,
            "num_partitions": self._planner.num_partitions,
            "seed": config.seed,
        }

    def _poll_workers(self) -> Readings:
        """Each logical worker's counters and queue depth, for ``stats()``."""
        workers = self.num_workers
        if workers == 0:
            runner = self._worker_side.local_runner
            return [None if runner is None else runner.counters.read()], [0]
        if self._failure is not None:
            return [None] * workers, [0] * workers
        return self._fleet.poll_stats(self._worker_side.offset)


def make_metrics(loader: SavableDataLoader, stall: StallPolicy | None) -> LoaderMetrics:
    """The loader's stats and stall check (by weak reference: no cycle keeps workers alive)."""
    workers = loader.worker_config.num_workers
    owner = weakref.ref(loader)

    def poll() -> Readings:
        live = owner()
        if live is None:
            return [None] * max(1, workers), [0] * max(1, workers)
        return live._poll_workers()

    warner = None if stall is None else StallWarner(workers, stall.threshold)
    return LoaderMetrics(max(1, workers), poll, stall, warner)
