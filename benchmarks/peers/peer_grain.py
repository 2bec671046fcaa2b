"""Google Grain (0.2.18) on the real workloads, with its dataset API as its docs show:
``MapDataset.source(...).shuffle(seed)`` -> the per-sample work -> batches ->
``to_iter_dataset()`` -> ``mp_prefetch(num_workers=2)``; the checkpoint is the iterator's
``get_state()``.

It runs in its own venv (``benchmarks/peer_venvs.sh grain``). Grain's sources are random-access
(``__len__`` + ``__getitem__``) and it ships no tar or random-access Parquet reader, so each
workload has a small one over the same files:

- ``llm``: the source is the list of Parquet row groups (random access into Parquet by row
  would decode a row group per row); shuffled, each is read (rows shuffled by a seeded RNG)
  and flattened to documents by ``FlatMapIterDataset``, tokenized (:class:`llm.Tokenize`),
  packed by Grain's ``ConcatThenSplitIterDataset`` into 2,048-token rows and batched by 8;
- ``vision``: the source indexes the tar shards once (member offsets, read with ``tarfile``)
  and reads a sample's ``jpg`` and ``cls`` with one ``pread`` each; shuffled globally; the
  augmentation is ``random_map`` (Grain hands each element its own ``numpy`` generator,
  which seeds a ``torch.Generator`` for :func:`vision.decode_and_augment`), batches of 64.

Batches are numpy; the main process turns them into the workload's torch batch.
"""

from __future__ import annotations

import functools
import os
import random
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness import llm, vision
from benchmarks.harness.bench import Contender
from benchmarks.harness.data import parquet_files, tar_shards
from benchmarks.harness.workloads import bound_to_folder

from .venvs import peer_venv_python, venv_missing

__all__ = ["grain_contender"]

VENV = "grain"
SEED = 0


class RowGroups:
    """Random access to ``(file, row group, rows)`` of Parquet files."""

    def __init__(self, files: list[str]) -> None:
        self.groups = llm.row_groups(files)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> tuple[str, int, int]:
        return self.groups[index]


def read_rows(group: tuple[str, int, int]) -> list[str]:
    """The texts of a row group, in an order shuffled by a seed and the row group."""
    import pyarrow.parquet as pq

    texts = pq.ParquetFile(group[0]).read_row_group(group[1], columns=["text"])
    rows = texts.column("text").to_pylist()
    random.Random(zlib.crc32(f"{SEED}/{Path(group[0]).name}/{group[1]}".encode())).shuffle(rows)
    return rows  # type: ignore[no-any-return]


@functools.cache
def _flatten_class() -> type:
    import grain

    class Explode(grain.experimental.FlatMapTransform):  # type: ignore[misc]
        max_fan_out = 1 << 16

        def flat_map(self, element: Sequence[str]) -> Sequence[str]:
            return element

    return Explode


class TokenizeArray:
    """A document -> ``{"tokens": int64 array}`` (what Grain's packing reads)."""

    def __init__(self, path: str) -> None:
        self.tokenize = llm.Tokenize(path)

    def __call__(self, text: str) -> dict[str, np.ndarray]:
        return {"tokens": self.tokenize({"text": text}).numpy()}


class TarSamples:
    """Random access to the samples (``{"jpg": bytes, "cls": bytes}``) of tar shards."""

    def __init__(self, shards: list[str]) -> None:
        members: dict[tuple[int, str], dict[str, tuple[int, int]]] = {}
        for number, shard in enumerate(shards):
            with tarfile.open(shard) as archive:
                for member in archive:
                    key, _, extension = member.name.partition(".")
                    members.setdefault((number, key), {})[extension] = (
                        member.offset_data,
                        member.size,
                    )
        self.shards = shards
        self.samples = [(number, parts) for (number, _), parts in sorted(members.items())]
        self._files: dict[int, Any] = {}
        self._pid = -1

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, bytes]:
        # Grain reads elements from several threads: ``os.pread`` on a descriptor per shard
        # and process (no shared file position).
        if self._pid != os.getpid():
            self._files, self._pid = {}, os.getpid()
        number, parts = self.samples[index]
        descriptor = self._files.get(number)
        if descriptor is None:
            descriptor = self._files.setdefault(number, os.open(self.shards[number], os.O_RDONLY))
        return {
            extension: os.pread(descriptor, size, offset)
            for extension, (offset, size) in parts.items()
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}, "_pid": -1}


def augment(sample: dict[str, bytes], rng: np.random.Generator) -> dict[str, Any]:
    """:func:`vision.decode_and_augment` with Grain's per-element generator, as numpy."""
    generator = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
    out = vision.decode_and_augment(sample, generator)
    return {"image": out["image"].numpy(), "label": np.int64(out["label"])}


def _dataset(workload: str, folder: Path) -> Any:
    import grain

    options = grain.MultiprocessingOptions(num_workers=2, per_worker_buffer_size=2)
    if workload == "llm":
        tokenize = TokenizeArray(llm.tokenizer_path(folder))
        documents = (
            grain.MapDataset.source(RowGroups(parquet_files(folder)))
            .shuffle(seed=SEED)
            .map(read_rows)
            .to_iter_dataset()
        )
        flat = grain.experimental.FlatMapIterDataset(documents, _flatten_class()())
        packed = grain.experimental.ConcatThenSplitIterDataset(
            flat.map(tokenize), length_struct={"tokens": llm.SEQ_LEN}
        )
        return packed.batch(llm.BATCH).mp_prefetch(options)
    return (
        grain.MapDataset.source(TarSamples(tar_shards(folder)))
        .shuffle(seed=SEED)
        .random_map(augment, seed=SEED)
        .batch(vision.BATCH)
        .to_iter_dataset()
        .mp_prefetch(options)
    )


def _as_torch(workload: str, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    if workload == "llm":
        segments = torch.from_numpy(np.asarray(batch["tokens_segment_ids"]))
        return {
            "tokens": torch.from_numpy(np.asarray(batch["tokens"])).to(torch.int64),
            "lengths": (segments > 0).sum(dim=1).to(torch.int64),
        }
    return {"image": torch.from_numpy(batch["image"]), "label": torch.from_numpy(batch["label"])}


class GrainLoader:
    """Iterates a Grain dataset as torch batches; the live iterator holds the state."""

    def __init__(self, workload: str, folder: Path) -> None:
        self.workload = workload
        self.dataset = _dataset(workload, folder)
        self.iterator: Any = None
        self.pending: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.close()
        self.iterator = iter(self.dataset)
        if self.pending is not None:
            self.iterator.set_state(self.pending)
            self.pending = None
        return (_as_torch(self.workload, batch) for batch in self.iterator)

    def state(self) -> Any:
        return self.iterator.get_state()

    def close(self) -> None:
        if self.iterator is not None:
            self.iterator.close()
            self.iterator = None


def _load(loader: GrainLoader, state: Any) -> None:
    loader.pending = state


def grain_contender(workload: str, folder: Path, venvs: Path | None = None) -> Contender:
    """Grain's dataset API with ``mp_prefetch`` over ``folder``'s files, run in ``venvs/grain``."""
    python = peer_venv_python(venvs, VENV)
    return Contender(
        "grain",
        build=bound_to_folder(functools.partial(GrainLoader, workload), folder, workload),
        save=GrainLoader.state,
        load=_load,
        close=GrainLoader.close,
        missing=venv_missing(python),
        python=python,
    )
