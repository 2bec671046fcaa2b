"""The ``llm`` bench workload: documents from Parquet -> byte-level BPE tokenizer -> 2,048-token
sequences -> batches of 8.

The per-sample work is the same for every contender: :class:`Tokenize` (the trained Hugging
Face tokenizer of the data's folder, ``<|endoftext|>`` appended). How the tokens become
sequences is each library's own way:

- energy_loader: :class:`~energy_loader.ParquetSource` (row groups shuffled, rows shuffled
  within each, ``shuffle_window=1``, as the plain peers shuffle) -> :class:`PackingDataset`
  (first fit over a look-ahead of 16 pieces, a document longer than 2,048 tokens split, each
  pack padded to 2,048 with its ``cu_seqlens``) -> :class:`BatchDataset` of 8;
- the plain torch ``DataLoader``: an ``IterableDataset`` over pyarrow (:class:`PlainDocs`)
  that concatenates the tokens of its documents and cuts them every 2,048 (the usual "concat
  and chunk"), batched 8 by the loader (the torchdata peer of the repository's
  ``benchmarks/peers/`` runs the same dataset, made ``Stateful``).

Packing strategies fill sequences differently (first fit pads the end of some packs;
concat-and-chunk pads only the last), so throughput counts *real* tokens: a batch's
:func:`count` is its non-padding tokens / 2,048, "sequences" of real tokens per second.

Every batch is ``{"tokens": int64 [B, 2048], "lengths": int64 [B]}`` (the real tokens of each
row), plus ``cu_seqlens`` on our side. :func:`fingerprint` hashes the tokens (and lengths):
equal fingerprints mean the same sequences, token for token.
"""

from __future__ import annotations

import hashlib
import json
import random
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .data import EOS, PAD, parquet_files

__all__ = [
    "BATCH",
    "LOADER_OPTIONS",
    "SEQ_LEN",
    "PlainDocs",
    "Tokenize",
    "count",
    "fingerprint",
    "llm_pipeline",
    "plain_loader",
    "row_groups",
]

SEQ_LEN = 2048
BATCH = 8
PACK_BUFFER = 16
WORKERS = 2
PREFETCH = 2
# The plain DataLoader's arguments; a peer's loader over the same documents takes them too.
LOADER_OPTIONS: Mapping[str, Any] = MappingProxyType(
    dict(batch_size=BATCH, num_workers=WORKERS, prefetch_factor=PREFETCH, persistent_workers=True)
)

_TOKENIZERS: dict[str, tuple[Any, int]] = {}


def _tokenizer(path: str) -> tuple[Any, int]:
    """This process's tokenizer of ``path`` and its ``<|endoftext|>`` id (loaded once)."""
    loaded = _TOKENIZERS.get(path)
    if loaded is None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(path)
        eos = tokenizer.token_to_id(EOS)
        if eos is None:
            raise ValueError(f"{path} has no {EOS} token: make the llm data anew")
        loaded = _TOKENIZERS[path] = (tokenizer, eos)
    return loaded


@attrs.frozen
class Tokenize:
    """``sample["text"]`` -> int64 token ids with ``<|endoftext|>`` appended.

    The tokenizer is loaded once per process from ``path`` (a ``tokenizer.json``); the object
    itself holds only the path, so it pickles small into worker processes.
    """

    path: str

    def __call__(self, sample: dict[str, Any]) -> torch.Tensor:
        tokenizer, eos = _tokenizer(self.path)
        ids = tokenizer.encode(sample["text"]).ids
        ids.append(eos)
        return torch.tensor(ids, dtype=torch.int64)

    def pad_id(self) -> int:
        """The ``<pad>`` id, read from the file's ``added_tokens`` list alone: the process that
        builds the pipeline (the loader's main process) need not load the tokenizer (~20 MB),
        nor parse the whole file (5 MB of Python objects at its peak RSS), to know it."""
        with open(self.path, encoding="utf-8") as file:
            text = file.read()
        start = text.index("[", text.index('"added_tokens"'))
        added, _ = json.JSONDecoder().raw_decode(text, start)
        return next(int(token["id"]) for token in added if token["content"] == PAD)


def tokenizer_path(folder: Path) -> str:
    return str(Path(folder) / "tokenizer.json")


def count(batch: dict[str, Any]) -> float:
    """2,048-token sequences of real (non-padding) tokens in a batch."""
    return float(batch["lengths"].sum()) / SEQ_LEN


def fingerprint(batch: dict[str, Any]) -> str:
    """A digest of a batch's tokens and lengths: equal iff the same sequences."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(batch["tokens"].contiguous().numpy().tobytes())
    digest.update(torch.as_tensor(batch["lengths"]).to(torch.int64).numpy().tobytes())
    return digest.hexdigest()


def collate_packs(packs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Packs -> ``{"tokens": [B, 2048], "lengths": [B], "cu_seqlens": [tensor, ...]}``."""
    return {
        "tokens": torch.stack([p["tokens"] for p in packs]),
        "lengths": torch.tensor([int(p["cu_seqlens"][-1]) for p in packs], dtype=torch.int64),
        "cu_seqlens": [p["cu_seqlens"] for p in packs],
    }


def llm_pipeline(folder: Path, seed: int = 0, *, seed_per_sample: bool = True) -> Any:
    """The workload as an energy_loader pipeline over the Parquet files in ``folder``."""
    from energy_loader.sources import ParquetSource
    from energy_loader.wrappers import BatchDataset, PackingDataset

    tokenize = Tokenize(tokenizer_path(folder))
    # The plain peers' shuffle: row groups permuted, rows permuted within each one. (The
    # default window of 4 row groups mixes more and keeps 4 decoded row groups per worker:
    # ~60 MB more per worker with these 4,096-document row groups.)
    source = ParquetSource(
        parquet_files(folder), columns=["text"], shuffle=True, seed=seed, shuffle_window=1
    )
    packs = PackingDataset(
        source,
        SEQ_LEN,
        buffer_size=PACK_BUFFER,
        encode_fn=tokenize,
        pad_id=tokenize.pad_id(),
        seed_per_sample=seed_per_sample,
    )
    return BatchDataset(packs, BATCH, collate_fn=collate_packs)


def row_groups(files: list[str]) -> list[tuple[str, int, int]]:
    """``(file, row group, rows)`` of every row group of ``files``."""
    import pyarrow.parquet as pq

    groups = []
    for path in files:
        metadata = pq.ParquetFile(path).metadata
        for group in range(metadata.num_row_groups):
            groups.append((path, group, metadata.row_group(group).num_rows))
    return groups


class PlainDocs(IterableDataset):
    """Documents from pyarrow, tokenized, concatenated and cut into 2,048-token sequences.

    Written as a user would: each epoch shuffles the row groups (seeded by epoch), each worker
    reads every ``num_workers``-th of them with ``ParquetFile.read_row_group`` and shuffles its
    rows; the tokens run on across documents and a sequence is emitted every 2,048 (the last,
    shorter one padded). Yields ``{"tokens": [2048], "lengths": real tokens}``.
    """

    def __init__(self, folder: Path, seed: int = 0) -> None:
        self.files = parquet_files(folder)
        self.tokenize = Tokenize(tokenizer_path(folder))
        self.seed, self.epoch = seed, 0
        self.groups = row_groups(self.files)

    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def shard(self, epoch: int) -> list[tuple[str, int, int]]:
        """This worker's row groups for ``epoch``, in reading order."""
        worker, workers = self._worker()
        groups = list(self.groups)
        random.Random(self.seed * 1_000_003 + epoch).shuffle(groups)
        return groups[worker::workers]

    def rows(self, epoch: int, group: tuple[str, int, int]) -> list[int]:
        """The order in which the rows of ``group`` are read in ``epoch``."""
        order = list(range(group[2]))
        salt = zlib.crc32(f"{self.seed}/{epoch}/{Path(group[0]).name}/{group[1]}".encode())
        random.Random(salt).shuffle(order)
        return order

    def texts(self, group: tuple[str, int, int]) -> list[str]:
        import pyarrow.parquet as pq

        table = pq.ParquetFile(group[0]).read_row_group(group[1], columns=["text"])
        return table.column("text").to_pylist()  # type: ignore[no-any-return]

    def documents(self, epoch: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        """``(document number in this worker's shard, tokens)`` from document ``start`` on."""
        number = 0
        for group in self.shard(epoch):
            if number + group[2] <= start:
                number += group[2]
                continue
            texts = self.texts(group)
            for row in self.rows(epoch, group):
                if number >= start:
                    yield number, self.tokenize({"text": texts[row]})
                number += 1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch = self.epoch
        self.epoch += 1
        yield from self.sequences(epoch, 0, 0)

    def sequences(self, epoch: int, start: int, offset: int) -> Iterator[dict[str, Any]]:
        """Sequences of ``epoch`` whose tokens start at token ``offset`` of document ``start``
        (where a resumable version of this dataset picks up from its state)."""
        pending: list[torch.Tensor] = []
        held = 0
        first_doc, first_offset = start, offset
        for number, tokens in self.documents(epoch, start):
            if number == start and offset:
                tokens = tokens[offset:]
            pending.append(tokens)
            held += len(tokens)
            while held >= SEQ_LEN:
                joined = torch.cat(pending)
                sequence, rest = joined[:SEQ_LEN], joined[SEQ_LEN:]
                # The next sequence starts in this document, at this token.
                first_doc = number
                first_offset = len(tokens) - len(rest)
                if number == start:
                    first_offset += offset
                pending, held = ([rest] if len(rest) else []), len(rest)
                if not len(rest):
                    first_doc, first_offset = number + 1, 0
                self.progress(epoch, first_doc, first_offset)
                yield {"tokens": sequence, "lengths": SEQ_LEN}
        if held:
            tail = torch.cat(pending)
            padding = torch.full((SEQ_LEN - held,), self.tokenize.pad_id(), dtype=torch.int64)
            self.progress(epoch, None, 0)
            yield {"tokens": torch.cat([tail, padding]), "lengths": held}

    def progress(self, epoch: int, document: int | None, offset: int) -> None:
        """Called before each sequence is yielded: where the next one starts (a hook)."""


def plain_loader(folder: Path) -> DataLoader:
    """The plain torch ``DataLoader`` over :class:`PlainDocs`."""
    return DataLoader(PlainDocs(folder), **LOADER_OPTIONS)
