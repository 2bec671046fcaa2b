"""The map-style drop-in's proof of values: a restore re-makes the last batch the saving loader
handed out and checks that the same indices give the same values.

A save records a digest of the last batch's values as collated (``proof.made``), taken where
the batch was made. Once the sampler's re-run has proven the indices, :class:`ValuesCheck`
makes that batch again in the main process through the fetcher's own code
(:meth:`~energy_loader.workers.fetch.BatchFetcher.remake`) and raises ``StateMismatchError``
when its digest differs (a data file edited in place, a ``__getitem__`` that reads the clock).
It does not re-make, quietly: without ``proof.made``, after a ``Stateful`` sampler loaded its
own state, without ``seed_per_sample``, with workers and a ``worker_init_fn``, or for a dataset
``copy.copy`` cannot copy (docs/restores.md lists why). Cost: one batch per restore.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from ...errors import StateMismatchError
from ...workers.fetch import BatchFetcher
from .position import short_unit
from .sampling import epoch_seed
from .state import MapState


class ValuesCheck:
    """The engine's check of a restored state's last batch (see the module docstring), called by the
    index stream once the re-run proved the indices."""

    def __init__(self, fetcher: BatchFetcher, loader: DataLoader[Any], seed_per_sample: bool):
        self.fetcher = fetcher
        self.dataset_name = type(loader.dataset).__name__
        # Re-made in the main process only where that is how a batch could be made.
        self.enabled = seed_per_sample and not (loader.num_workers and loader.worker_init_fn)

    def __call__(self, state: MapState, unit: Any) -> None:
        made, job = state.proof.made, state.job
        if not (self.enabled and made and unit is not None):
            return
        with _threads_as_in(job.workers):
            try:
                found = self.fetcher.remake(unit, epoch_seed(job.seed, state.epoch))
            except Exception as error:
                error.add_note(
                    f"(raised while the restore re-made batch {state.used - 1} of epoch "
                    f"{state.epoch}, indices {short_unit(unit)}, to check its values: pass "
                    "verify_restore=False to skip the check)"
                )
                raise
        if found is None or found == made:
            return
        raise StateMismatchError(
            f"the restore re-made the last batch the saving loader handed out (batch "
            f"{state.used - 1} of epoch {state.epoch}, indices {short_unit(unit)}) from the "
            f"dataset {self.dataset_name}, and the same indices gave other values than they "
            f"gave then (values digest {made} saved, {found} now): the dataset makes this "
            "batch differently now. Usual causes: a data file "
            "edited or replaced in place since the save; a __getitem__ (or collate_fn) that "
            "reads the clock, a counter, or a random generator of its own that nobody seeds "
            "(the loader seeds python's, numpy's and torch's global RNGs per sample); float "
            "results that differ with the number of threads. Restore with the data (and code) "
            "that saved the state, or pass verify_restore=False to the loader to continue with "
            "the new values (docs/restores.md#the-drop-in-loaders-proof-of-values)"
        )


@contextlib.contextmanager
def _threads_as_in(worker: bool) -> Iterator[None]:
    """torch on one thread, as in a worker process, where a worker made the batch."""
    threads = torch.get_num_threads()
    if not worker or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
