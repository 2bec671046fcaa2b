"""What a rank will yield next, from a saved state: ``peek_keys`` and the ``replay`` command.

The live loader is never touched: from a rank state this module plans the restore as
``restore_state_rank`` would, runs one :class:`~energy_loader.workers.runner.Runner` per
logical worker *in this process*, lets each restore and replay its partitions, and takes items
in the loader's order (within a worker round-robin over its partitions, across workers from
the one due next), planning again at each epoch's end. A throwaway copy rather than buffering
the live workers' items, which every later save would have to account for; it costs making
the replayed and peeked items once more. The global RNG states are kept across a peek.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..dataset import Key
from ..rng import kept_rng_state
from ..state.rank_state import RankState
from ..validation import require_int
from ..workers.protocol import CheckpointSettings, RunPlan
from ..workers.runner import Runner
from ..workers.side import WorkerSideDataset
from .checks import check_fits
from .partitions import next_worker
from .pipeline_states import with_declared_changes
from .planner import Planner

if TYPE_CHECKING:
    from .pipeline_engine import PipelineEngine

_END = object()


def _worker_items(runner: Runner) -> Iterator[tuple[int, tuple[Key, Any]]]:
    """One epoch of one simulated worker: ``(slot, (key, sample))`` in the order it yields
    them."""
    if not runner.prepare_epoch():
        return
    while (step := runner.next_pair(snapshot_ends=False)) is not None:
        yield step


def future_items(
    planner: Planner, settings: CheckpointSettings, states: Sequence[RankState]
) -> Iterator[tuple[Key, Any]]:
    """``(key, sample)`` of every item a loader (its ``planner`` and ``settings``) yields after a
    restore from one save's ``states``, across epochs until two in a row yield nothing. Raises as
    ``restore_state_rank``; wrap it in :func:`energy_loader.rng.kept_rng_state`."""
    empty_epochs = 0
    current = list(states)
    scale, changes = check_fits(planner, current)  # the next epochs' states are the peek's own
    while empty_epochs < 2:
        # What a peek tells is keys: its replay checks the keys it re-makes, not their values
        # (the samples, where asked for, are made again by restore_sample).
        plan = planner.plan(current, scale=scale).keys_only()
        plan = with_declared_changes(planner, plan, changes)  # the restore's, then none
        scale, changes = 1, []
        owner = WorkerSideDataset(
            planner.pipeline,
            planner.config,
            settings,
            RunPlan(planner.num_partitions, plan.workers, plan.restores),
        )
        runners = [Runner(owner, logical) for logical in range(len(plan.workers))]
        streams = [_worker_items(runner) for runner in runners]
        count = len(streams)
        per_rank = sum(len(w.partitions) for w in plan.workers)
        done = [False] * count
        turn, yielded = plan.next_worker, 0
        while not all(done):
            # As the loader's Unbundler: the worker due, or the next one that has not ended.
            due = next(w for w in ((turn + i) % count for i in range(count)) if not done[w])
            step: Any = next(streams[due], _END)
            if step is _END:
                done[due] = True
                turn = (due + 1) % count
                continue
            slot, pair = step
            yielded += 1
            yield pair
            turn = next_worker(due, slot, per_rank, count)
        empty_epochs = 0 if yielded else empty_epochs + 1
        ended = [runner.snapshot() for runner in runners]
        current = [planner.ended_rank_state(ended, plan.start)]


def peek_keys(engine: PipelineEngine, n: int) -> list[Key]:
    """The restore keys of the next ``n`` items ``engine``'s loader yields (see the module
    docstring)."""
    require_int(n, "n", minimum=0)
    keys: list[Key] = []
    if n == 0:
        return keys
    state = engine.record(0)
    with kept_rng_state():
        for key, _ in future_items(
            engine.planner_for([state]), engine.checkpoint_settings, [state]
        ):
            keys.append(key)
            if len(keys) == n:
                break
    return keys
