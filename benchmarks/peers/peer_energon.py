"""The bench's workloads on megatron-energon's own ``SavableDataLoader`` (7.4.1), at its defaults.

(The ``vision`` workload, energon reading the tars itself, is :func:`energon_vision_contender`
at the end of this module; what follows is about the synthetic workloads.)

"The same pipeline" in energon's classes: a small source (:func:`_source_class`, an energon
``SavableDataset``) that gives logical worker ``w`` of :data:`WORKERS` (rank 0 of 1) the shard
``epoch_order(samples, 0, 0)[w::WORKERS]``, exactly as :class:`PlainPipeline` shards, and yields
``WORKLOADS[workload].make(index)``; energon's ``MapDataset`` with the workload's transform;
energon's ``ShuffleBufferDataset`` of the workload's buffer size; energon's ``BatchDataset`` of
:data:`BATCH` with :func:`collate`; all in ``SavableDataLoader(dataset, prefetch_factor=PREFETCH)``
with ``WorkerConfig(rank=0, world_size=1, num_workers=WORKERS)``. One epoch: the source stops
after one pass (no repeat), so ``list(loader)`` is one epoch. The shuffle draws from energon's
own per-worker generator, so the batch order is energon's, not the plain pipeline's; exact resume
compares energon against its own uninterrupted run.

What energon needs that the plain pipeline does not:

- **Restore keys.** A shuffle buffer saves the restore keys of its samples, not the samples, and
  rebuilds them on restore through ``restore_sample`` down the chain. A sample carries its key as
  a ``"__restore_key__"`` entry; every wrapper prepends its own part. The source sets
  ``("WorkloadSource", index)`` and rebuilds a sample from it; the transform's output keeps the
  input's key (the workload transforms return a fresh dict, as energon's own generic webdataset
  loader copies ``__restore_key__`` across); ``MapDataset`` is told ``stateless_map_fn=True``
  (the transforms are deterministic), without which it refuses ``restore_sample``. The batcher
  drops the keys before :func:`collate` (which stacks every non-index field), so a batch is
  exactly the workload's batch and ``SavableDataLoader.restore_sample`` (a debugging aid) is not
  available for batches.
- **Logical worker ids.** After a restore energon rotates worker ids
  (``WorkerConfig.worker_id_offset``) so that the worker due next starts first; the source asks
  ``worker_config.rank_worker_id()`` for its shard, never torch's ``get_worker_info()``.
- **Position.** The source's only state is ``_position`` in its shard, declared in
  ``_savable_fields``: energon saves such fields by ``deepcopy`` per worker.

How energon's save and restore work (and what the bench measures at defaults): each worker keeps
a few rolling snapshots of its whole pipeline's state (``checkpoint_every_sec=60``, at least
``2 * WORKERS`` batches apart, ``PREFETCH * WORKERS + 1`` kept, plus ones at batches 0 and 1);
``save_state_rank()`` sends a command to every worker (served by a thread in the worker once it
has yielded) and gets the newest snapshot at or before the last batch the main process took,
plus how many batches to skip from it. Restoring rebuilds every worker from its snapshot (the
shuffle buffer through ``restore_sample``) and re-runs the pipeline over the skipped batches.
In a run shorter than a minute the only snapshots are the first ones, so a restore replays the
epoch up to the saved point: exact, but the time grows with the position. States are dataclasses
with torch RNG bytes and the buffer's keys, so they are measured as a pickle.

One trap in 7.4.1: ``iter(loader)`` marks the workers as running before torch starts them (on
the first ``next``), so ``save_state_rank()`` between ``iter()`` and the first batch waits
forever for workers that do not exist yet. The bench always takes a batch before it saves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from benchmarks.harness.bench import Contender
from benchmarks.harness.workloads import WORKLOADS, bound_to_folder
from energy_loader.cli.bench import BATCH, PREFETCH, WORKERS, collate, epoch_order

__all__ = ["energon_contender", "energon_vision_contender"]

RESTORE_KEY = "__restore_key__"
SEED = 0
EPOCH = 0


@attrs.frozen
class _KeepRestoreKey:
    """A workload transform whose output keeps its input's energon restore key."""

    transform: Callable[[dict[str, Any]], dict[str, Any]]

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        out = self.transform(sample)
        out[RESTORE_KEY] = sample[RESTORE_KEY]
        return out


def _collate_without_keys(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The workload's :func:`collate`, over the samples without their restore keys."""
    return collate([{k: v for k, v in s.items() if k != RESTORE_KEY} for s in samples])


@functools.cache
def _source_class() -> type:
    """The source, defined on first use so that this module imports without energon."""
    from megatron.energon import SavableDataset

    class WorkloadSource(SavableDataset):
        """One epoch of a workload's samples, sharded over the workers like PlainPipeline."""

        _savable_fields = ("_position",)

        def __init__(self, samples: int, workload: str, *, worker_config: Any) -> None:
            super().__init__(worker_config=worker_config)
            self.samples = samples
            self.workload = WORKLOADS[workload]
            self._shard_cache: tuple[int, list[int]] | None = None
            self.reset_state_own()

        def reset_state_own(self) -> None:
            self._position = 0

        def _workers(self) -> int:
            return max(self.worker_config.num_workers, 1)

        def _shard(self) -> list[int]:
            worker = self.worker_config.rank_worker_id()
            if self._shard_cache is None or self._shard_cache[0] != worker:
                order = epoch_order(self.samples, SEED, EPOCH)
                self._shard_cache = (worker, order[worker :: self._workers()])
            return self._shard_cache[1]

        def len_worker(self, worker_idx: int | None = None) -> int:
            if worker_idx is None:
                worker_idx = self.worker_config.rank_worker_id()
            return len(range(worker_idx, self.samples, self._workers()))

        def worker_has_samples(self) -> bool:
            return self.len_worker() > 0

        def __iter__(self) -> Iterator[dict[str, Any]]:
            shard = self._shard()
            while self._position < len(shard):
                index = shard[self._position]
                self._position += 1
                sample = self.workload.make(index)
                sample[RESTORE_KEY] = (type(self).__name__, index)
                yield sample

        def can_restore_sample(self) -> bool:
            return True

        def restore_sample(self, restore_key: tuple[Any, ...]) -> dict[str, Any]:
            name, index = restore_key
            if name != type(self).__name__:
                raise ValueError(f"not a {type(self).__name__} restore key: {restore_key!r}")
            sample = self.workload.make(index)
            sample[RESTORE_KEY] = (name, index)
            return sample

        def config(self) -> dict[str, Any]:
            return {
                "type": type(self).__qualname__,
                "samples": self.samples,
                "workload": self.workload.name,
                "seed": SEED,
                "epoch": EPOCH,
            }

    return WorkloadSource


def _energon_loader(samples: int, workload: str, **options: Any) -> Any:
    if options:
        raise TypeError(f"the energon contender takes no options (got {sorted(options)})")
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r} (choose from {sorted(WORKLOADS)})")
    from megatron.energon import (
        BatchDataset,
        MapDataset,
        SavableDataLoader,
        ShuffleBufferDataset,
        WorkerConfig,
    )

    spec = WORKLOADS[workload]
    config = WorkerConfig(rank=0, world_size=1, num_workers=WORKERS)
    source = _source_class()(samples, workload, worker_config=config)
    mapped = MapDataset(
        source, _KeepRestoreKey(spec.transform), stateless_map_fn=True, worker_config=config
    )
    shuffled = ShuffleBufferDataset(mapped, spec.buffer, worker_config=config)
    batched = BatchDataset(shuffled, BATCH, _collate_without_keys, worker_config=config)
    return SavableDataLoader(batched, prefetch_factor=PREFETCH)


def _energon_close(loader: Any) -> None:
    """Stop the loader's workers now and release its command queues.

    Energon keeps one persistent torch iterator for as long as the loader lives; closing its
    epoch generator does not stop the workers, so this shuts the torch iterator down (which
    joins the workers, terminating any that do not exit in time) and closes the queues the
    main process used to send ``get_checkpoint`` commands.
    """
    epoch_iterator = getattr(loader, "_epoch_iterator", None)
    if epoch_iterator is not None:
        epoch_iterator.close()
        loader._epoch_iterator = None
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()
        loader._iterator = None
    loader._has_workers = False
    for queue in (*loader.cmd_queues, *loader.result_queues):
        queue.cancel_join_thread()
        queue.close()


def _energon_missing() -> str | None:
    try:
        import megatron.energon  # noqa: F401
    except ImportError:
        return "megatron-energon is not installed (pip install -e '.[bench]')"
    return None


def energon_contender() -> Contender:
    """megatron-energon's ``SavableDataLoader`` at its defaults; the state is measured pickled."""
    return Contender(
        "energon",
        build=_energon_loader,
        save=lambda loader: loader.save_state_rank(),
        load=lambda loader, state: loader.restore_state_rank(state),
        close=_energon_close,
        missing=_energon_missing,
    )


# --- The vision workload: energon reads the tars itself ---------------------------------------
#
# As energon's docs show for an image-classification webdataset: ``prepare`` writes the
# dataset's ``.nv-meta`` once (what ``energon prepare`` writes: the shards' index and a split
# with every shard in ``train``, and a ``dataset.yaml`` of ``ImageClassificationSample``
# mapping ``image`` to ``jpg`` and ``label`` to ``cls``). The task encoder sets ``decoder = None``
# (the members reach it as bytes, so Pillow decodes them in :func:`vision.decode_and_augment`,
# the same work as every other contender) and marks ``encode_sample`` with
# ``@stateless(restore_seeds=True)``, energon's way to make random augmentations restorable.
# ``get_train_dataset`` with a shuffle buffer of 1,000 samples (as the webdataset peers) and
# ``max_samples_per_sequence=100``, batches of 64 by the task encoder's ``batch`` (torch's
# ``default_collate``); the train dataset repeats forever, so ``virtual_epoch_length`` cuts it
# into epochs of ``ceil(images / 64)`` batches.

VISION_YAML = """\
sample_type:
  __module__: megatron.energon
  __class__: ImageClassificationSample
field_map:
  image: jpg
  label: cls
"""


def _energon_vision_prepare(folder: Any) -> None:
    from pathlib import Path

    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    from benchmarks.harness.data import tar_shards

    tars = Path(folder) / "tars"
    meta = tars / ".nv-meta"
    if (meta / "dataset.yaml").exists():
        return
    WebdatasetPreparator.prepare_dataset(
        EPath(tars),
        [Path(shard).name for shard in tar_shards(folder)],
        split_parts_ratio=[("train", 1.0)],
        shuffle_seed=None,
        workers=2,
    )
    (meta / "dataset.yaml").write_text(VISION_YAML)


@functools.cache
def _vision_encoder_class() -> type:
    import torch.utils.data
    from megatron.energon import DefaultTaskEncoder, stateless

    from benchmarks.harness import vision

    class AugmentImages(DefaultTaskEncoder):  # type: ignore[misc]
        """Raw JPEG bytes -> :func:`vision.decode_and_augment`, seeds restored per sample."""

        decoder = None

        @stateless(restore_seeds=True)  # type: ignore[untyped-decorator]
        def encode_sample(self, sample: Any) -> dict[str, Any]:
            return vision.decode_and_augment({"jpg": sample.image, "cls": sample.label})

        def batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
            return torch.utils.data.default_collate(samples)  # type: ignore[no-any-return]

    return AugmentImages


def _energon_vision_loader(folder: Any, **options: Any) -> Any:
    from pathlib import Path

    if options:
        raise TypeError(f"the energon contender takes no options (got {sorted(options)})")
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    from benchmarks.harness import vision

    config = WorkerConfig(rank=0, world_size=1, num_workers=vision.WORKERS)
    tars = Path(folder) / "tars"
    count = _vision_images(tars)
    dataset = get_train_dataset(
        str(tars),
        batch_size=vision.BATCH,
        shuffle_buffer_size=vision.WDS_SHUFFLE,
        max_samples_per_sequence=100,
        virtual_epoch_length=-(-count // vision.BATCH),
        worker_config=config,
        task_encoder=_vision_encoder_class()(),
    )
    return get_savable_loader(dataset, prefetch_factor=vision.PREFETCH)


def _vision_images(tars: Any) -> int:
    """The number of samples in the prepared split (``.nv-meta/.info.json``)."""
    import json

    info = json.loads((tars / ".nv-meta" / ".info.json").read_text())
    return int(sum(info["shard_counts"].values()))


def energon_vision_contender(folder: Any) -> Contender:
    """megatron-energon's ``SavableDataLoader`` reading ``folder``'s tars itself."""
    return attrs.evolve(
        energon_contender(),
        build=bound_to_folder(_energon_vision_loader, folder, "vision"),
        prepare=functools.partial(_energon_vision_prepare, folder),
    )
