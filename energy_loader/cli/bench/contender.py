"""How the bench drives one loader library over a workload, and the two built-in contenders.

A :class:`Contender` is five plain functions over a library's own loader: build one for a
workload, save its state, load a state into a fresh one, measure a state's size the way the
library stores it, and close it (stop its workers). The runner does the rest the same way for
every contender: throughput with and without a save every :data:`SAVE_EVERY` batches, save
latency, restore-to-first-batch at 10/50/90% of the epoch, state size, peak RSS of main and
workers, and an exact-resume check (the batches after a restore equal the uninterrupted run's).

Other libraries' loaders are contenders too, but not in the installed package: their adapters
live in the repository's ``benchmarks/peers/`` and ``benchmarks/bench_peers.py`` runs them
beside these two, through the same runner.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from typing import Any

import attrs
from torch.utils.data import DataLoader

from .workloads import BATCH, PREFETCH, WORKERS, WORKLOADS, PlainPipeline, savable_pipeline

__all__ = [
    "Contender",
    "bound_to_folder",
    "energy_loader_contender",
    "plain_contender",
    "shutdown_workers",
]


def _no_state(*_: Any) -> Any:
    raise TypeError("this contender keeps no state")


def _pickled_size(state: Any) -> int:
    return len(pickle.dumps(state))


def _always_available() -> str | None:
    return None


def shutdown_workers(loader: Any) -> None:
    """Stop the workers of a torch-style loader's live iterator, if it has one."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


@attrs.frozen
class Contender:
    """One loader library, driven through its own API.

    - ``build(samples, workload, **options)``: a fresh loader over the workload (a name in
      :data:`WORKLOADS`); iterating it yields one epoch of batches, dicts with an ``"index"``
      list (or tensor) of source indices; ``options`` are contender-specific variants;
    - ``save(loader)``: the loader's state right after the batch last taken from its iterator;
    - ``load(loader, state)``: make a fresh loader (from ``build``) continue right after the
      saved batch: its first batch is the one after it;
    - ``state_bytes(state)``: the state's size as the library stores it (by default pickled,
      as torchdata and energon states are);
    - ``close(loader)``: stop its workers (called once a run is done with it);
    - ``missing()``: ``None`` when usable, else why not (for example a package not installed);
    - ``stateful``: whether save/load exist (the plain DataLoader has neither);
    - ``python``: the interpreter of the venv the contender runs in (``None``: this one), for
      peers whose requirements conflict with ours;
    - ``prepare()``: one-time work before its runs (a copy of the data in its own format), run
      once in its interpreter, never timed.
    """

    name: str
    build: Callable[..., Any]
    save: Callable[[Any], Any] = _no_state
    load: Callable[[Any, Any], None] = _no_state
    state_bytes: Callable[[Any], int] = _pickled_size
    close: Callable[[Any], None] = lambda loader: None
    missing: Callable[[], str | None] = _always_available
    stateful: bool = True
    python: str | None = None
    prepare: Callable[[], None] | None = None

    def restored(self, samples: int, workload: str, state: Any) -> Any:
        """A fresh loader with ``state`` loaded: its first batch follows the saved one."""
        loader = self.build(samples, workload)
        self.load(loader, state)
        return loader


def _plain_loader(samples: int, workload: str) -> DataLoader:
    batches_itself = WORKLOADS[workload].plain_batches_itself
    return DataLoader(
        PlainPipeline(samples, workload=workload),
        batch_size=None if batches_itself else BATCH,
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
    )


def plain_contender() -> Contender:
    """A torch ``DataLoader`` over :class:`PlainPipeline`: the reference, with no state."""
    return Contender("plain", build=_plain_loader, close=shutdown_workers, stateful=False)


def _savable_loader(
    samples: int, workload: str, *, seed_per_sample: bool = True, **options: Any
) -> Any:
    from ...loader import SavableDataLoader

    return SavableDataLoader(
        savable_pipeline(samples, workload=workload, seed_per_sample=seed_per_sample),
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        **options,
    )


def energy_loader_contender() -> Contender:
    """``SavableDataLoader`` with its defaults; the state is measured as JSON."""
    return Contender(
        "energy_loader",
        build=_savable_loader,
        save=lambda loader: loader.save_state_rank(),
        load=lambda loader, state: loader.restore_state_rank(state),
        state_bytes=lambda state: len(json.dumps(state)),
        close=lambda loader: loader.reset_state(),
    )


def bound_to_folder(build: Callable[..., Any], folder: Any, workload: str) -> Callable[..., Any]:
    """``build(folder, **options)`` as a contender's ``build(samples, workload, **options)``,
    for the file-based workloads: their contenders are made for one data folder, so the
    ``samples`` the runner passes is not used and ``workload`` is only checked."""

    def bound(samples: int, name: str, **options: Any) -> Any:
        if name != workload:
            raise ValueError(f"this contender runs the {workload} workload, not {name!r}")
        return build(folder, **options)

    return bound
