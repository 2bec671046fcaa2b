"""MosaicML Streaming (0.13) on the real workloads, as its docs show: an ``MDSWriter`` copy of
the data, a ``StreamingDataset`` subclass whose ``__getitem__`` does the per-sample work, and a
``StreamingDataLoader`` whose ``state_dict()`` is the checkpoint.

It runs in its own venv (``benchmarks/peer_venvs.sh streaming``: it needs numpy < 2.2). Its
``prepare`` writes the MDS copy once into the data folder (``mds/``, in the order of the
original files; not timed):

- ``llm``: columns ``id`` (int64) and ``text`` (str). ``__getitem__`` tokenizes (as
  llm-foundry's text dataset does); the loader takes batches of :data:`DOCS_PER_BATCH`
  documents and its collate function concatenates their tokens and cuts them into 2,048-token
  rows (the last one padded), about 8 rows a batch: Streaming resumes by counting samples
  (documents) per batch, so packing has to happen inside a batch to stay resumable, and the
  batch's first entry must have one element per document (the loader counts that).
- ``vision``: columns ``jpg`` (the JPEG's bytes) and ``cls`` (int); ``__getitem__`` is
  :func:`vision.decode_and_augment` (its draws from the worker's torch generator), batches
  of 64.

Shuffle: ``shuffle=True`` with the library's default algorithm (``py1e``), seed 0.

One workaround: the torchvision on PyPI is a CUDA build whose C ops do not load against the CPU
torch; ``import torchvision`` then fails registering a fake kernel for ``torchvision::nms``.
Streaming imports torchvision only for its own vision datasets (unused here), so
:func:`_import_streaming` declares the two operator schemas that registration needs first.
"""

from __future__ import annotations

import functools
import json
import tarfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import llm, vision
from benchmarks.harness.bench import Contender
from benchmarks.harness.data import parquet_files, tar_shards
from benchmarks.harness.workloads import bound_to_folder
from energy_loader.cli.bench import shutdown_workers

from .venvs import peer_venv_python, venv_missing

__all__ = ["streaming_contender"]

DOCS_PER_BATCH = 40
VENV = "streaming"


def _import_streaming() -> Any:
    try:
        import torchvision  # noqa: F401
    except RuntimeError:
        library = torch.library.Library("torchvision", "FRAGMENT")
        for name in ("nms", "qnms"):
            library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _import_streaming.library = library  # type: ignore[attr-defined]
    import streaming

    return streaming


def _mds_folder(folder: Path) -> Path:
    return Path(folder) / "mds"


def _prepare(workload: str, folder: Path) -> None:
    """Write the MDS copy of the data once (``mds/``, completed by ``mds/done``)."""
    streaming = _import_streaming()
    target = _mds_folder(folder)
    if (target / "done").exists():
        return
    if target.exists():
        import shutil

        shutil.rmtree(target)
    if workload == "llm":
        import pyarrow.parquet as pq

        columns = {"id": "int64", "text": "str"}
        with streaming.MDSWriter(out=str(target), columns=columns, size_limit="64mb") as out:
            for path in parquet_files(folder):
                for batch in pq.ParquetFile(path).iter_batches(columns=["id", "text"]):
                    for row in batch.to_pylist():
                        out.write(row)
    else:
        columns = {"jpg": "bytes", "cls": "int"}
        with streaming.MDSWriter(out=str(target), columns=columns, size_limit="64mb") as out:
            for shard in tar_shards(folder):
                members: dict[str, dict[str, bytes]] = {}
                with tarfile.open(shard) as archive:
                    for member in archive:
                        key, _, extension = member.name.partition(".")
                        data = archive.extractfile(member)
                        if data is not None:
                            members.setdefault(key, {})[extension] = data.read()
                for key in sorted(members):
                    sample = members[key]
                    out.write({"jpg": sample["jpg"], "cls": int(sample["cls"])})
    (target / "done").write_text(json.dumps({"workload": workload}))


@functools.cache
def _dataset_classes() -> tuple[type, type]:
    streaming = _import_streaming()

    class TokenizedDocs(streaming.StreamingDataset):  # type: ignore[misc,name-defined]
        """Documents, tokenized in ``__getitem__``."""

        def __init__(self, tokenizer: str, **options: Any) -> None:
            super().__init__(**options)
            self.tokenize = llm.Tokenize(tokenizer)

        def __getitem__(self, index: int) -> torch.Tensor:
            return self.tokenize(super().__getitem__(index))

    class AugmentedImages(streaming.StreamingDataset):  # type: ignore[misc,name-defined]
        """JPEGs, decoded and augmented in ``__getitem__``."""

        def __getitem__(self, index: int) -> dict[str, Any]:
            return vision.decode_and_augment(super().__getitem__(index))

    return TokenizedDocs, AugmentedImages


class PackBatch:
    """Collate: a batch of documents' tokens, concatenated, cut into rows of 2,048 tokens
    (the last row padded): ``{"documents": [docs], "tokens": [rows, 2048], "lengths": [rows]}``.

    ``documents`` (each document's token count) comes first on purpose: the loader counts
    the samples a batch consumed as the length of its first entry, and resumes by that count.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, documents: list[torch.Tensor]) -> dict[str, Any]:
        tokens = torch.cat(documents)
        rows = -(-len(tokens) // llm.SEQ_LEN)
        lengths = torch.full((rows,), llm.SEQ_LEN, dtype=torch.int64)
        lengths[-1] = len(tokens) - (rows - 1) * llm.SEQ_LEN
        padded = torch.full((rows * llm.SEQ_LEN,), self.pad_id, dtype=torch.int64)
        padded[: len(tokens)] = tokens
        return {
            "documents": torch.tensor([len(d) for d in documents], dtype=torch.int64),
            "tokens": padded.view(rows, llm.SEQ_LEN),
            "lengths": lengths,
        }


def _build(workload: str, folder: Path) -> Any:
    streaming = _import_streaming()
    docs, images = _dataset_classes()
    local = str(_mds_folder(folder))
    options = {"local": local, "shuffle": True, "shuffle_seed": 0}
    if workload == "llm":
        tokenizer = llm.tokenizer_path(folder)
        dataset = docs(tokenizer, batch_size=DOCS_PER_BATCH, **options)
        batch_size, collate = DOCS_PER_BATCH, PackBatch(llm.Tokenize(tokenizer).pad_id())
    else:
        dataset = images(batch_size=vision.BATCH, **options)
        batch_size, collate = vision.BATCH, None
    return streaming.StreamingDataLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=2,
        prefetch_factor=2,
        persistent_workers=True,
    )


def streaming_contender(workload: str, folder: Path, venvs: Path | None = None) -> Contender:
    """MosaicML Streaming's ``StreamingDataLoader`` over its MDS copy of ``folder``'s data,
    run in ``venvs/streaming``."""
    python = peer_venv_python(venvs, VENV)
    return Contender(
        "streaming",
        build=bound_to_folder(functools.partial(_build, workload), folder, workload),
        save=lambda loader: loader.state_dict(),
        load=lambda loader, state: loader.load_state_dict(state),
        close=shutdown_workers,
        missing=venv_missing(python),
        python=python,
        prepare=functools.partial(_prepare, workload, folder),
    )
