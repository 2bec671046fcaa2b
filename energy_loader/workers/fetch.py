"""The drop-in loader's worker side for a map-style dataset: make batches, encode, send.

The index stream stays in the main process, as in torch: each task names one or several
consecutive batches of the user's sampler (a bundle: :mod:`energy_loader.workers.bundling`)
and the epoch's seed. For each batch the fetcher loads the samples (``dataset[index]``, or one
``__getitems__`` call where that draws nothing or ``seed_per_sample`` is off), collates them,
digests them where they were made (the proof of values, ``prove``) and, in a worker process,
encodes the bundle with the transport codec. With ``seed_per_sample`` the global RNGs are
seeded from (epoch seed, index) before each sample, so augmentation is the same after a
restore in any batch or worker (docs/dropin.md); without workers they are put back after each
task. An exception in user code ends the bundle, after the batches made before it.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from torch.utils.data import Dataset, Subset, get_worker_info

from ..metrics import clock
from ..rng import kept_rng_state, seed_globals_for_sample
from ..state.digests import content_digest
from ..torch_internals import ExceptionWrapper, set_worker_info
from ..transport import Packet, WorkerTransport, decode
from .bundling import payload_bytes

# The per-sample seeds of the drop-in loader: a salt of their own (wrappers use their position).
_SEED_POSITION = -1


@attrs.frozen
class FetchTask:
    """One trip to a worker: consecutive units of the index stream from number ``first`` (a unit:
    one batch's indices, or one index with ``batch_size=None``)."""

    first: int
    units: tuple[Any, ...]
    epoch_seed: int


@attrs.define
class FetchResult:
    """What a worker sends back: the made batches (encoded), their count, time and payload bytes, a
    failure if any, and with ``prove`` each batch's values' digest (``made``)."""

    first: int
    payload: Any
    count: int
    seconds: float
    nbytes: int
    failure: Any = None
    made: tuple[str, ...] | None = None

    def pin_memory(self, device: Any = None) -> FetchResult:
        """torch's pin-memory thread calls this: pin the payload (a packet pins its own)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        payload = self.payload
        if isinstance(payload, Packet):
            payload = payload.pin_memory(device)
        else:
            payload = pin_memory(payload, device)
        return attrs.evolve(self, payload=payload)

    def batches(self) -> list[Any]:
        """The batches, decoded."""
        return list(decode(self.payload))


class BatchFetcher(Dataset[Any]):
    """What the drop-in's internal DataLoader indexes: ``fetcher[task]`` makes a bundle."""

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[Any], Any],
        *,
        auto_collation: bool,
        seed_per_sample: bool,
        prove: bool = False,
    ) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.auto_collation = auto_collation
        self.seed_per_sample = seed_per_sample
        self.prove = prove  # digest each batch made (the restore's proof of values)
        # A dataset that reads only through __getitems__ (its __getitem__ is torch's stub)
        self._getitems_only = getattr(type(dataset), "__getitem__", None) is Dataset.__getitem__
        self.transport: WorkerTransport | None = None
        self._encode: Callable[[Any], Packet] | None = None
        self._worker_id: int | None = None

    def start_worker(self, worker_id: int) -> None:
        """In a new worker process: take this worker's arena for the payloads."""
        self._worker_id = worker_id
        if self.transport is not None:
            self._encode = self.transport.encoder(worker_id)

    def __getitem__(self, task: FetchTask) -> FetchResult:
        in_main = self._worker_id is None
        kept = kept_rng_state() if in_main and self.seed_per_sample else contextlib.nullcontext()
        began = clock()
        batches: list[Any] = []
        made: list[str] | None = [] if self.prove else None
        failure: Any = None
        try:
            with kept:
                for unit in task.units:
                    batch = self._make(unit, task.epoch_seed)
                    if made is not None:  # (before anyone can write into it)
                        made.append(content_digest(batch))
                    batches.append(batch)
        except Exception as error:
            if in_main:
                failure = error
            else:
                failure = ExceptionWrapper(where=f"in DataLoader worker process {self._worker_id}")
        payload: Any = batches
        if self._encode is not None:
            payload = self._encode(batches)
        return FetchResult(
            task.first,
            payload,
            len(batches),
            clock() - began,
            payload_bytes(payload),
            failure,
            None if made is None else tuple(made),
        )

    def remake(self, unit: Any, epoch_seed: int) -> str | None:
        """The digest of the batch of ``unit`` made again here exactly as a worker makes it (global
        RNGs put back after); None when the dataset cannot be copied. It reads a shallow copy, so
        what ``__getitem__`` opens lazily stays off the dataset the workers fork from."""
        try:
            dataset = copy.copy(self.dataset)
        except Exception:
            return None
        twin = copy.copy(self)
        twin.dataset, twin.prove = dataset, True
        twin._encode, twin._worker_id = None, None
        result = twin[FetchTask(0, (unit,), epoch_seed)]
        if result.failure is not None:
            raise result.failure
        return None if not result.made else result.made[0]

    def __len__(self) -> int:
        return len(self.dataset)

    def _make(self, unit: Any, epoch_seed: int) -> Any:
        dataset, seeded = self.dataset, self.seed_per_sample
        if not self.auto_collation:
            if seeded:
                seed_globals_for_sample(epoch_seed, _SEED_POSITION, unit)
            return self.collate_fn(dataset[unit])
        getitems = getattr(dataset, "__getitems__", None)
        if getitems and (not seeded or draws_nothing(dataset)):
            samples = getitems(unit)
        elif getitems and self._getitems_only:
            samples = []
            for index in unit:
                seed_globals_for_sample(epoch_seed, _SEED_POSITION, index)
                samples.append(_one_sample(getitems([index]), index))
        elif seeded:
            samples = []
            for index in unit:
                seed_globals_for_sample(epoch_seed, _SEED_POSITION, index)
                samples.append(dataset[index])
        else:
            samples = [dataset[index] for index in unit]
        return self.collate_fn(samples)


def draws_nothing(dataset: Any) -> bool:
    """Whether ``dataset``'s reads draw no random numbers, known without reading: a Hugging Face
    ``datasets.Dataset`` without a transform, then read one batch a call (7x faster); checked per
    batch, as a transform may be set late."""
    if isinstance(dataset, Subset):  # torch's Subset reads through its dataset's __getitems__
        return draws_nothing(dataset.dataset)
    module = sys.modules.get("datasets")  # not imported: no Hugging Face dataset here
    if module is None or not isinstance(dataset, module.Dataset):
        return False
    return bool(dataset.format.get("type") != "custom")


def _one_sample(samples: Any, index: Any) -> Any:
    """The sample of ``__getitems__([index])``: torch's contract is a list of one sample."""
    if isinstance(samples, Sequence) and not isinstance(samples, str | bytes) and len(samples) == 1:
        return samples[0]
    raise TypeError(
        f"__getitems__([{index!r}]) returned {type(samples).__name__} "
        f"{samples!r:.80}, not a list of one sample (torch's __getitems__ returns a list of "
        "samples). With seed_per_sample=True the loader calls __getitems__ one index at a "
        "time so that a sample's random augmentation does not depend on its batch; pass "
        "seed_per_sample=False to call it once per batch (augmentations are then not "
        "reproduced by a restore)"
    )


class WorkerInit:
    """The internal DataLoader's ``worker_init_fn``: point the fetcher at this worker's arena, make
    ``get_worker_info().dataset`` the user's dataset, then call the user's ``worker_init_fn``."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        fetcher = info.dataset if info is not None else None
        if isinstance(fetcher, BatchFetcher):
            fetcher.start_worker(worker_id)
            set_worker_info(dataset=fetcher.dataset)
        if self.user_fn is not None:
            self.user_fn(worker_id)
