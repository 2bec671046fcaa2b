"""What a rank will yield next, from a saved state: ``peek_keys`` and the ``replay`` command.

The live loader is never touched. From a rank state (``save_state_rank()`` now, or one read
from a checkpoint) this module plans the restore exactly as ``restore_state_rank`` would
(:meth:`~energy_loader.SavableDataLoader.plan_restore`), builds one
:class:`~energy_loader.workers.runner.Runner` per logical worker *in this process* (no
worker processes, no command threads, no transport), lets each restore and replay its
partitions as a restored worker does, and then takes items the way the loader receives them:

- within a worker, its partitions round-robin, one item at a time, skipping ended ones (as
  ``Runner.run_epoch``);
- across workers, torch's round-robin starting at the worker that was due next, skipping a
  worker once its epoch ended (its end marker takes its turn, then it is done).

At the end of an epoch it saves the simulated workers' states as an ended rank state and
plans again, exactly as the loader's next ``iter()`` does, so keys run on into the next epoch.

Why a throwaway copy rather than buffering items pulled from the live workers: buffered items
would have to be accounted for in every later save (the workers' rolling checkpoints cover only
a few items beyond the last one delivered, so peeking far ahead could not be saved exactly),
and the live stream's timing would change. The copy costs one save plus making the replayed
and peeked items once more, in this process: right for provenance and debugging, not for every
step. The global ``random``, ``numpy`` and ``torch`` RNG states are kept across a peek.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..dataset import Key, require_int
from ..state.rank_state import PartitionState, RankState, WorkerSlots
from ..workers.protocol import RunPlan
from ..workers.runner import Runner
from ..workers.side import WorkerSideDataset

if TYPE_CHECKING:
    from .savable_loader import SavableDataLoader

__all__ = ["future_items", "kept_rng_state", "peek_keys"]

_END = object()


@contextlib.contextmanager
def kept_rng_state() -> Iterator[None]:
    """Restore the global ``random``, ``numpy`` and ``torch`` RNG states on exit.

    Pipelines that seed per sample reseed the global generators; a peek must not change what
    the training process draws next.
    """
    import numpy as np
    import torch

    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def _worker_items(runner: Runner) -> Iterator[tuple[Key, Any]]:
    """One epoch of one simulated worker: ``(key, sample)`` in the order it yields them."""
    if not runner.prepare_epoch():
        return
    while (step := runner.next_pair(snapshot_ends=False)) is not None:
        yield step[1]


def _ended_state(loader: SavableDataLoader, runners: list[Runner], start: int) -> RankState:
    """The rank state the simulated workers stand at after their epoch ended."""
    config = loader.worker_config
    workers, partitions = [], []
    for runner in runners:
        snapshot = runner.snapshot()
        workers.append(WorkerSlots(tuple(s.partition for s in runner.slots), 0, True))
        for slot, checkpoint in zip(runner.slots, snapshot.states):
            partitions.append(PartitionState(slot.partition, checkpoint, 0, True))
    return RankState(
        rank=config.rank,
        world_size=config.world_size,
        num_workers=loader.num_workers,
        num_partitions=loader.num_partitions,
        config=loader._config_cache,
        epoch=0,
        in_epoch=False,
        epoch_ended=True,
        delivered=0,
        start=start,
        next_worker=0,
        workers=tuple(workers),
        partitions=tuple(partitions),
    )


def future_items(
    loader: SavableDataLoader, states: Sequence[RankState]
) -> Iterator[tuple[Key, Any]]:
    """``(key, sample)`` of every item ``loader`` yields after a restore from ``states``.

    ``states`` are one save's rank states (this rank's, or all ranks'). Runs on across epoch
    ends; stops only when two epochs in a row yield nothing. Raises what
    ``restore_state_rank`` raises for states that do not fit the loader. Wrap the iteration in
    :func:`kept_rng_state` to leave the global RNGs as they were.
    """
    side = loader._worker_side
    empty_epochs = 0
    current = list(states)
    while empty_epochs < 2:
        plan = loader.plan_restore(current)
        owner = WorkerSideDataset(
            loader._pipeline,
            loader.worker_config,
            side.settings,
            RunPlan(loader.num_partitions, plan.workers, plan.restores),
        )
        runners = [Runner(owner, logical) for logical in range(len(plan.workers))]
        streams = [_worker_items(runner) for runner in runners]
        done = [False] * len(streams)
        turn, yielded = plan.next_worker, 0
        while not all(done):
            if not done[turn]:
                pair = next(streams[turn], _END)
                if pair is _END:
                    done[turn] = True
                else:
                    yielded += 1
                    yield pair  # type: ignore[misc]
            turn = (turn + 1) % len(streams)
        empty_epochs = 0 if yielded else empty_epochs + 1
        current = [_ended_state(loader, runners, plan.start)]


def peek_keys(loader: SavableDataLoader, n: int) -> list[Key]:
    """The restore keys of the next ``n`` items ``loader`` yields (see the module docstring)."""
    require_int(n, "n", minimum=0)
    if not getattr(loader, "_savable", False):
        raise TypeError("peek_keys needs a SavableDataLoader (BasicDataLoader keeps no state)")
    keys: list[Key] = []
    if n == 0:
        return keys
    state = RankState.from_plain(loader.save_state_rank())
    with kept_rng_state():
        for key, _ in future_items(loader, [state]):
            keys.append(key)
            if len(keys) == n:
                break
    return keys
