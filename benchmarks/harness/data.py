"""The real workloads' data, made once into a cache folder: Parquet documents and a tokenizer
trained on them (``llm``), WebDataset tars of JPEGs (``vision``).

Not a data set anyone should train on: synthetic data with the shape of the real thing, made
locally and deterministically from a seed, so that every contender of the bench reads the same
files and the numbers can be reproduced anywhere.

- **llm**: ``docs`` documents of synthetic text in Parquet files written by pyarrow (columns
  ``id`` and ``text``; :data:`LLM_FILES` files, row groups of :data:`LLM_ROW_GROUP` rows, or
  a quarter of a file when that is less).
  Words come from a made-up vocabulary with Zipf frequencies; document lengths are
  log-normal (median ~200 words, a long tail up to :data:`MAX_WORDS`), sentences of a few to
  thirty words. A byte-level BPE tokenizer (Hugging Face ``tokenizers``, vocabulary of
  :data:`VOCAB_SIZE`, ``<|endoftext|>`` and ``<pad>`` special tokens) is trained on the first
  :data:`TOKENIZER_DOCS` documents and saved as ``tokenizer.json``.
- **vision**: ``images`` JPEGs made with Pillow, 256-512 pixels a side, smooth colour fields
  plus grain (so they compress like photographs, not to nothing), written by webdataset's
  ``TarWriter`` as ``{key}.jpg`` + ``{key}.cls`` (a label of :data:`CLASSES`), in shards of
  :data:`IMAGES_PER_SHARD` (fewer when that makes less than 8 shards); the shards' member
  indexes (``python -m energy_loader index``) are built too.

A folder is complete when its ``done.json`` (the parameters it was made with) exists: it is
written last, so an interrupted build is redone, and a finished one is reused. Progress bars
go to stderr while the data is made.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from energy_loader.errors import EnergyLoaderError

__all__ = [
    "CLASSES",
    "DEFAULT_CACHE",
    "EOS",
    "PAD",
    "data_dir",
    "ensure_data",
    "make_llm_data",
    "make_vision_data",
    "parquet_files",
    "tar_shards",
]

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    "energy_loader/bench"
)
SEED = 20261125
FORMAT = 2

LLM_FILES = 8
LLM_ROW_GROUP = 4096
WORDS = 24_000
MAX_WORDS = 12_000
VOCAB_SIZE = 8192
TOKENIZER_DOCS = 20_000
EOS = "<|endoftext|>"
PAD = "<pad>"

CLASSES = 1000
IMAGES_PER_SHARD = 1000
MIN_SIDE, MAX_SIDE = 256, 512


def data_dir(cache: Path, workload: str, size: int) -> Path:
    """Where the data of ``workload`` with ``size`` documents or images lives in ``cache``."""
    return Path(cache) / f"{workload}-{size}"


def parquet_files(folder: Path) -> list[str]:
    """The llm workload's Parquet files, in order."""
    return [str(p) for p in sorted((Path(folder) / "parquet").glob("*.parquet"))]


def tar_shards(folder: Path) -> list[str]:
    """The vision workload's tar shards, in order."""
    return [str(p) for p in sorted((Path(folder) / "tars").glob("*.tar"))]


def _bar(total: int, desc: str, unit: str, progress: bool) -> Any:
    """A progress bar on stderr, silent unless ``progress`` (tqdm is in the extra that making
    the data needs)."""
    from tqdm import tqdm

    return tqdm(
        total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, disable=not progress
    )


def _vocabulary(rng: np.random.Generator) -> np.ndarray:
    """``WORDS`` distinct made-up words of 1-4 syllables, most frequent first."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
              "w", "br", "ch", "st", "th", "tr", "pl", "gr", "sh"]  # fmt: skip
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "x"]
    words: dict[str, None] = {}
    while len(words) < WORDS:
        syllables = int(rng.choice([1, 2, 3, 4], p=[0.3, 0.4, 0.2, 0.1]))
        word = "".join(
            onsets[rng.integers(len(onsets))]
            + vowels[rng.integers(len(vowels))]
            + codas[rng.integers(len(codas))]
            for _ in range(syllables)
        )
        words.setdefault(word, None)
    # Shorter words are the frequent ones, as in natural language.
    return np.array(sorted(words, key=len))


def _documents(docs: int, rng: np.random.Generator) -> Iterator[str]:
    """``docs`` documents of Zipf-distributed words, log-normal lengths, in sentences."""
    vocabulary = _vocabulary(rng)
    ranks = np.arange(1, WORDS + 1, dtype=np.float64)
    weights = 1.0 / (ranks + 2.7) ** 1.07
    cumulative = np.cumsum(weights / weights.sum())
    chunk = 2048
    for first in range(0, docs, chunk):
        count = min(chunk, docs - first)
        lengths = np.clip(rng.lognormal(np.log(200), 0.9, count), 8, MAX_WORDS).astype(np.int64)
        ids = np.searchsorted(cumulative, rng.random(int(lengths.sum())))
        words = vocabulary[np.minimum(ids, WORDS - 1)].tolist()
        sentence_ends = rng.integers(4, 30, int(lengths.sum()) // 4 + count)
        start, cut = 0, 0
        for length in lengths.tolist():
            doc = words[start : start + length]
            start += length
            position = 0
            while position < length:
                step = int(sentence_ends[cut])
                cut += 1
                doc[position] = doc[position].capitalize()
                end = min(position + step, length) - 1
                doc[end] += "."
                position = end + 1
            yield " ".join(doc)


def _train_tokenizer(texts: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(path))


def _emptied(folder: Path, inner: str) -> Path:
    """``folder`` made anew (what it held removed), with an empty ``inner`` folder in it."""
    folder = Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    (folder / inner).mkdir(parents=True)
    return folder


def make_llm_data(folder: Path, docs: int, *, progress: bool = True) -> None:
    """Write the llm workload's Parquet files and tokenizer into ``folder`` (replaced)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = _emptied(folder, "parquet")
    rng = np.random.default_rng(SEED)
    per_file = -(-docs // LLM_FILES)
    bar = _bar(docs, "making llm documents", "doc", progress)
    sample: list[str] = []
    documents = _documents(docs, rng)
    for number in range(-(-docs // per_file)):
        first = number * per_file
        count = min(per_file, docs - first)
        texts = [next(documents) for _ in range(count)]
        if len(sample) < TOKENIZER_DOCS:
            sample.extend(texts[: TOKENIZER_DOCS - len(sample)])
        table = pa.table({"id": np.arange(first, first + count, dtype=np.int64), "text": texts})
        # Several row groups a file, also for the few hundred documents of a test.
        row_group = max(16, min(LLM_ROW_GROUP, -(-per_file // 4)))
        pq.write_table(
            table, folder / "parquet" / f"part-{number:05d}.parquet", row_group_size=row_group
        )
        bar.update(count)
    bar.close()
    if progress:
        print(f"training the byte-level BPE tokenizer on {len(sample)} documents", file=sys.stderr)
    _train_tokenizer(sample, folder / "tokenizer.json")


def _image(rng: np.random.Generator) -> bytes:
    """One JPEG: a smooth random colour field with grain, 256-512 pixels a side."""
    from PIL import Image

    width, height = (int(v) for v in rng.integers(MIN_SIDE, MAX_SIDE + 1, 2))
    coarse = rng.integers(0, 256, (int(rng.integers(2, 9)), int(rng.integers(2, 9)), 3))
    field = Image.fromarray(coarse.astype(np.uint8)).resize(
        (width, height), Image.Resampling.BICUBIC
    )
    grain = rng.integers(-12, 13, (height, width, 3), dtype=np.int16)
    pixels = np.asarray(field, dtype=np.int16) + grain
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def make_vision_data(folder: Path, images: int, *, progress: bool = True) -> None:
    """Write the vision workload's tar shards (and their member indexes) into ``folder``."""
    import webdataset as wds

    from energy_loader.cli.index import index_shards

    folder = _emptied(folder, "tars")
    rng = np.random.default_rng(SEED)
    bar = _bar(images, "making vision JPEGs", "img", progress)
    # At least 8 shards (so every worker of every loader gets some, also in tests).
    per_shard = max(1, min(IMAGES_PER_SHARD, -(-images // 8)))
    for shard, first in enumerate(range(0, images, per_shard)):
        with wds.TarWriter(str(folder / "tars" / f"shard-{shard:05d}.tar")) as writer:
            for index in range(first, min(first + per_shard, images)):
                label = int(rng.integers(CLASSES))
                writer.write({"__key__": f"{index:08d}", "jpg": _image(rng), "cls": label})
                bar.update(1)
    bar.close()
    index_shards(str(folder / "tars"), progress=progress)


MAKERS = {"llm": make_llm_data, "vision": make_vision_data}


def ensure_data(cache: Path, workload: str, size: int, *, progress: bool = True) -> Path:
    """The folder of ``workload``'s data with ``size`` documents or images, made if missing.

    Reuses a complete folder (one whose ``done.json`` matches); otherwise makes it anew.
    """
    if workload not in MAKERS:
        raise ValueError(f"no data to make for workload {workload!r} (choose from llm, vision)")
    if type(size) is not int or size < 1:
        raise ValueError(f"the data size must be a positive integer (got {size!r})")
    folder = data_dir(cache, workload, size)
    marker = folder / "done.json"
    expected = {"workload": workload, "size": size, "seed": SEED, "format": FORMAT}
    try:
        if json.loads(marker.read_text()) == expected:
            return folder
    except (OSError, ValueError):
        pass
    try:
        MAKERS[workload](folder, size, progress=progress)
    except ImportError as error:
        raise EnergyLoaderError(
            f"making the {workload} data needs {error.name}: pip install -c constraints.txt "
            "-e '.[bench]'"
        ) from error
    temporary = marker.with_suffix(".tmp")
    temporary.write_text(json.dumps(expected))
    os.replace(temporary, marker)
    return folder
