"""ChunkedFolderSource: a folder of pre-processed chunk files plus ``metadata.json``, read in
contiguous ranges per partition; :func:`write_chunked_folder` makes one. See
docs/sources/chunked.md.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from ..dataset import EpochCursor, Key, SavableDataset
from ..errors import SourceDataError, StateFormatError
from ..rng import stable_hash
from ..state.atomic import write_atomically
from ..state.data_fingerprint import DATA_FIELD, DataFiles
from ..state.plain import StateReader
from ..validation import require_bool, require_int
from ..worker import WorkerContext
from ._download import parse_json
from ._order import EpochOrder, span

__all__ = ["ChunkedFolderSource", "loaded_chunk_count", "write_chunked_folder"]

METADATA = "metadata.json"
FORMAT = "energy_loader.chunked"
VERSION = 1
BALANCE_POLICIES = ("exact", "oversample", "undersample")
FILE_FORMATS = (".pt", ".npz", ".npy")

# Every chunk in memory in this process (a diagnostic: see loaded_chunk_count()).
_LIVE_CHUNKS: weakref.WeakSet[_Chunk] = weakref.WeakSet()


def loaded_chunk_count() -> int:
    """How many chunk files this process's sources hold right now: at most one per cursor, plus
    one that ``restore_sample`` keeps for repeated look-ups."""
    return len(_LIVE_CHUNKS)


class _Chunk:
    """One chunk file in memory: columns (dict of tensors/arrays), rows (a list) or an array."""

    __slots__ = ("__weakref__", "array", "columns", "index", "rows")

    def __init__(self, path: Path, index: int, expected: int) -> None:
        self.index = index
        self.columns: dict[str, Any] | None = None
        self.rows: list[Any] | None = None
        self.array: np.ndarray | None = None
        suffix = path.suffix
        try:
            if suffix == ".pt":
                loaded = torch.load(path, weights_only=True, map_location="cpu")
            else:
                loaded = np.load(path, allow_pickle=False)
                if suffix == ".npz":
                    with loaded:
                        loaded = {name: loaded[name] for name in loaded.files}
        except FileNotFoundError:
            raise FileNotFoundError(
                f"chunk file {path} listed in {path.parent / METADATA} is missing"
            ) from None
        except Exception as error:
            raise SourceDataError(
                f"chunk file {path} cannot be loaded safely ({type(error).__name__}: {error}); "
                ".pt chunks must load with torch.load(weights_only=True), .npz/.npy with "
                "numpy.load(allow_pickle=False)"
            ) from error
        if isinstance(loaded, dict):
            for name, column in loaded.items():
                if not isinstance(column, (torch.Tensor, np.ndarray)) or column.ndim == 0:
                    raise SourceDataError(
                        f"chunk file {path}: column {name!r} is a "
                        f"{type(column).__name__}{_shape(column)}; columns must be tensors or "
                        "arrays with one row per sample"
                    )
                _check_rows(path, f"column {name!r}", column.shape[0], expected)
            self.columns = loaded
        elif isinstance(loaded, list):
            _check_rows(path, "the sample list", len(loaded), expected)
            self.rows = loaded
        elif isinstance(loaded, np.ndarray) and loaded.ndim >= 1:
            _check_rows(path, "the array", loaded.shape[0], expected)
            self.array = loaded
        else:
            raise SourceDataError(
                f"chunk file {path} holds a {type(loaded).__name__}; expected a dict of "
                "tensors/arrays with one row per sample, a list of samples, or an array"
            )
        _LIVE_CHUNKS.add(self)

    def sample(self, row: int, seq_len: int | None) -> Any:
        """Sample ``row``, copied out of the chunk, sequences cut to the last ``seq_len``."""
        if self.columns is not None:
            return {
                name: _cut(column[row], seq_len, copy=True) for name, column in self.columns.items()
            }
        if self.array is not None:
            return _cut(self.array[row], seq_len, copy=True)
        sample = self.rows[row]  # type: ignore[index]
        if isinstance(sample, dict):
            return {name: _cut(value, seq_len, copy=False) for name, value in sample.items()}
        return _cut(sample, seq_len, copy=False)


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f" of shape {tuple(shape)}" if shape is not None else ""


def _check_rows(path: Path, what: str, found: int, expected: int) -> None:
    if found != expected:
        raise SourceDataError(
            f"chunk file {path}: {what} has {found} rows but {path.parent / METADATA} says the "
            f"file holds {expected} samples; rewrite the metadata or the chunk"
        )


def _cut(value: Any, seq_len: int | None, *, copy: bool) -> Any:
    """``value[-seq_len:]`` for tensors and arrays with a sequence dimension; copied if asked."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if seq_len is not None and value.ndim >= 1:
            value = value[-seq_len:]
        if copy:
            return value.clone() if isinstance(value, torch.Tensor) else value.copy()
    return value


def read_metadata(folder: Path) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The files and sample counts listed in ``folder/metadata.json`` (validated)."""
    path = folder / METADATA
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if not folder.is_dir():
            raise FileNotFoundError(f"chunked folder {folder} does not exist") from None
        raise FileNotFoundError(
            f"{path} is missing: a chunked folder needs a metadata.json listing its files and "
            "their sample counts (write_chunked_folder() makes one)"
        ) from None
    data = parse_json(text, str(path))
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise SourceDataError(f"{path} must be a JSON object with a 'files' list")
    version = data.get("version", VERSION)
    if version != VERSION:
        raise SourceDataError(f"{path} has version {version!r}; this release reads {VERSION}")
    files: list[str] = []
    counts: list[int] = []
    for number, entry in enumerate(data["files"]):
        name = entry.get("path") if isinstance(entry, dict) else None
        count = entry.get("samples") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise SourceDataError(f"{path}: files[{number}] needs a 'path' string (got {entry!r})")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise SourceDataError(
                f"{path}: files[{number}] ({name}) needs 'samples', a non-negative integer "
                f"(got {count!r})"
            )
        if Path(name).suffix not in FILE_FORMATS:
            raise SourceDataError(
                f"{path}: files[{number}] ({name}) must end in one of {FILE_FORMATS}"
            )
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise SourceDataError(
                f"{path}: files[{number}] ({name}) must be a path inside the folder"
            )
        if not (folder / name).is_file():
            raise FileNotFoundError(f"chunk file {folder / name} listed in {path} is missing")
        files.append(name)
        counts.append(count)
    total = data.get("total_samples")
    if total != sum(counts):
        raise SourceDataError(
            f"{path}: total_samples is {total!r} but the files' sample counts add up to "
            f"{sum(counts)}; rewrite the metadata"
        )
    return tuple(files), tuple(counts)


@attrs.frozen
class _Range:
    """What one partition reads in every epoch: ``count`` samples of the epoch order Q from
    position ``start`` on, Q taken as a ring (a range may run past its end into its start)."""

    start: int
    count: int


class _ChunkedCursor(EpochCursor):
    dataset: ChunkedFolderSource

    def __init__(self, dataset: ChunkedFolderSource) -> None:
        super().__init__(dataset)
        self.position = 0
        self._chunk: _Chunk | None = None
        self._order: tuple[int, EpochOrder] | None = None

    def begin_epoch(self) -> None:
        self.position = 0

    def order(self) -> EpochOrder:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.dataset.epoch_order(self.epoch))
        return self._order[1]

    def resume(self) -> Iterator[tuple[Key, Any]]:
        source = self.dataset
        part = source.layout()
        seq_len = source.seq_len
        walk = self.order().walk_range(part.start + self.position, part.start + part.count)
        for file_index, row in walk:
            chunk = self._chunk
            if chunk is None or chunk.index != file_index:
                self._chunk = chunk = None  # free the old chunk before loading the next
                chunk = self._chunk = source.load_chunk(file_index)
            sample = chunk.sample(row, seq_len)
            self.position += 1
            yield (file_index, row), sample
        self._chunk = None

    def fields(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_fields(self, reader: StateReader) -> None:
        self.position = reader.int("position")
        if self.phase == "running":
            count = self.dataset.layout().count
            if not 0 <= self.position <= count:
                context = self.dataset.context
                raise StateFormatError(
                    f"{reader.path}.position {self.position} is outside the range [0, {count}] "
                    f"of partition {context.partition} of {context.num_partitions} of this folder"
                )


class ChunkedFolderSource(SavableDataset):
    """Stream a folder of chunk files in ranges over the loader's partitions, one file in memory
    per partition at a time; ``seq_len`` keeps the last positions of sequences. ``balance``
    (``"exact"``, ``"oversample"``, ``"undersample"``) and errors: docs/sources/chunked.md::

        source = ChunkedFolderSource("data/", shuffle=True, seed=1234, balance="oversample")
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        balance: str = "exact",
        seq_len: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"`path` must be a folder path (got {type(path).__name__})")
        require_bool(shuffle, "shuffle")
        if balance not in BALANCE_POLICIES:
            raise ValueError(f"`balance` must be one of {BALANCE_POLICIES} (got {balance!r})")
        self.seed = require_int(seed, "seed", minimum=0)
        self.seq_len = None if seq_len is None else require_int(seq_len, "seq_len", minimum=1)
        self.shuffle = shuffle
        self.balance = balance
        self.path = Path(path).resolve()
        self.files, self.counts = read_metadata(self.path)
        self.total = sum(self.counts)
        listing = json.dumps([list(self.files), list(self.counts)]).encode()
        self._fingerprint = hashlib.sha256(listing).hexdigest()[:16]
        self._data_files: DataFiles | None = None
        self._restore_chunk: _Chunk | None = None

    # -- layout and order --------------------------------------------------------------------

    def layout(self, context: WorkerContext | None = None) -> _Range:
        """The range of the epoch order this copy's partition reads (raises for ``exact``
        when the ranks of ``context``'s layout would get different numbers of samples)."""
        context = context if context is not None else self.context
        parts = context.num_partitions
        start, stop = span(self.total, parts, context.partition)
        quotient, remainder = divmod(self.total, parts)
        if self.balance == "exact":
            if remainder:
                self._check_ranks(context)
            count = stop - start
        elif self.balance == "oversample":
            count = quotient + (remainder > 0)
        else:
            count = quotient
        return _Range(start=start, count=count)

    def _check_ranks(self, context: WorkerContext) -> None:
        """Raise unless every rank's partitions add up to the same number of samples."""
        parts, ranks = context.num_partitions, context.world_size
        quotient, remainder = divmod(self.total, parts)
        spans = [span(self.total, parts, p) for p in range(parts)]
        per_rank = [sum(stop - start for start, stop in spans[r::ranks]) for r in range(ranks)]
        if len(set(per_rank)) == 1:
            return
        shown = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(per_rank[:8]))
        if ranks > 8:
            shown += f", ... ({ranks} ranks)"
        over = (quotient + 1) * parts - self.total
        raise SourceDataError(
            f"balance='exact' needs every rank to get the same number of samples, but the "
            f"{self.total} samples of {self.path} ({self._describe_files()}), cut into "
            f"{parts} partitions of {quotient + 1} or {quotient} consecutive samples, give "
            f"world_size={ranks} ranks different counts: {shown}. Use balance='oversample' "
            f"(every partition reads {quotient + 1} samples, {over} more than the folder "
            f"holds, an epoch) or balance='undersample' (every partition reads {quotient}, "
            f"{remainder} fewer than the folder holds), or a folder whose number of samples is "
            f"a multiple of {ranks}"
        )

    def _describe_files(self) -> str:
        """``"14 files: 13 of 37 samples (chunk-00000.pt, ...), 1 of 19 (chunk-00013.pt)"``."""
        groups: dict[int, list[str]] = {}
        for name, count in zip(self.files, self.counts):
            groups.setdefault(count, []).append(name)
        parts = []
        for number, (count, names) in enumerate(groups.items()):
            if number == 4:
                parts.append(f"... ({len(groups)} sizes)")
                break
            listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            unit = " samples" if not parts else ""
            parts.append(f"{len(names)} of {count}{unit} ({listed})")
        return f"{len(self.files)} files: " + ", ".join(parts)

    def epoch_order(self, epoch: int) -> EpochOrder:
        """The order Q of ``epoch``: the files in a per-epoch order, each file's rows in a
        per-epoch order (file order throughout without ``shuffle``). Memory: O(files), plus
        8 bytes a row of the file being read when shuffling."""
        return EpochOrder(
            self.counts,
            stable_hash(self.seed, self.stream_salt(), epoch),
            self.shuffle,
            self.context.num_partitions,
            row_arrays=1,  # a range reads each file once: keep only its row order
        )

    def data_files(self) -> DataFiles:
        """The chunk files and metadata.json, sampled, fingerprinted on first use
        (:mod:`energy_loader.state.data_fingerprint`)."""
        if self._data_files is None:
            self._data_files = DataFiles.local(self.path, (*self.files, METADATA))
        return self._data_files

    def load_chunk(self, file_index: int) -> _Chunk:
        """Load one chunk file (validated against the metadata)."""
        return _Chunk(self.path / self.files[file_index], file_index, self.counts[file_index])

    # -- protocol --------------------------------------------------------------------------

    def _new_cursor(self) -> EpochCursor:
        return _ChunkedCursor(self)

    def restore_sample(self, key: Key) -> Any:
        if (
            len(key) != 2
            or any(isinstance(part, bool) or not isinstance(part, int) for part in key)
            or not 0 <= key[0] < len(self.files)
            or not 0 <= key[1] < self.counts[key[0]]
        ):
            raise ValueError(
                f"ChunkedFolderSource restore keys are (file_index, row) within the "
                f"{len(self.files)} files of {self.path}; got {key!r}"
            )
        chunk = self._restore_chunk
        if chunk is None or chunk.index != key[0]:
            self._restore_chunk = None
            chunk = self._restore_chunk = self.load_chunk(key[0])
        return chunk.sample(key[1], self.seq_len)

    def can_restore_sample(self) -> bool:
        return True

    def _config_fields(self) -> dict[str, Any]:
        return {
            "files": len(self.files),
            "total_samples": self.total,
            "listing": self._fingerprint,
            DATA_FIELD: self.data_files().plain,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "balance": self.balance,
            "seq_len": self.seq_len,
        }

    def __len__(self) -> int:
        """Samples per epoch of this copy's partition."""
        return self.layout().count

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_restore_chunk": None}


# -- writing ------------------------------------------------------------------------------------


def write_chunked_folder(
    path: str | os.PathLike[str],
    samples: Iterable[Any],
    *,
    samples_per_file: int,
    file_format: str = "pt",
) -> dict[str, Any]:
    """Write ``samples`` as a chunked folder readable by :class:`ChunkedFolderSource`: every
    ``samples_per_file`` samples one file (``file_format`` ``"pt"``, ``"npz"`` or ``"npy"``:
    docs/sources/chunked.md), written atomically, ``metadata.json`` last (``FileExistsError`` if
    there is one). Returns the metadata written."""
    require_int(samples_per_file, "samples_per_file", minimum=1)
    if file_format not in ("pt", "npz", "npy"):
        raise ValueError(f"`file_format` must be 'pt', 'npz' or 'npy' (got {file_format!r})")
    if isinstance(samples, (str, bytes, dict)) or not isinstance(samples, Iterable):
        raise TypeError(f"`samples` must be an iterable of samples (got {type(samples).__name__})")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / METADATA).exists():
        raise FileExistsError(
            f"{folder / METADATA} exists: {folder} already holds a chunked folder; write to an "
            "empty folder"
        )
    entries: list[dict[str, Any]] = []
    iterator = iter(samples)
    for group in iter(lambda: list(itertools.islice(iterator, samples_per_file)), []):
        name = f"chunk-{len(entries):05d}.{file_format}"
        write_atomically(folder / name, functools.partial(_write_chunk, group, file_format, name))
        entries.append({"path": name, "samples": len(group)})
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "total_samples": sum(e["samples"] for e in entries),
        "files": entries,
    }
    write_atomically(folder / METADATA, json.dumps(metadata, indent=1).encode())
    return metadata


def _write_chunk(group: list[Any], file_format: str, name: str, file: Any) -> None:
    if file_format == "npy":
        arrays = [_as_numpy(s, f"{name}: sample {i}") for i, s in enumerate(group)]
        if any(a.shape != arrays[0].shape or a.dtype != arrays[0].dtype for a in arrays):
            raise TypeError(
                f"{name}: file_format='npy' needs arrays of one shape and dtype; use "
                "file_format='pt' for ragged arrays"
            )
        np.save(file, np.stack(arrays), allow_pickle=False)
        return
    if file_format == "npz":
        columns = _columns(group, name, tensors=False)
        if columns is None:
            raise TypeError(
                f"{name}: file_format='npz' needs dict samples with the same keys, whose values "
                "are arrays, tensors or numbers of one shape and dtype per key; use "
                "file_format='pt' for other samples (ragged arrays included)"
            )
        np.savez(file, **columns)
        return
    group = [_for_torch_load(s, f"{name}: sample {i}") for i, s in enumerate(group)]
    columns = _columns(group, name, tensors=True)
    torch.save(group if columns is None else columns, file)


def _columns(group: list[Any], name: str, *, tensors: bool) -> dict[str, Any] | None:
    """Stack dict samples into columns, or ``None`` when they do not form columns."""
    if not all(isinstance(s, dict) for s in group):
        return None
    keys = list(group[0])
    if any(list(s) != keys for s in group) or not all(isinstance(k, str) for k in keys):
        return None
    out: dict[str, Any] = {}
    for key in keys:
        values = [s[key] for s in group]
        if not tensors:
            values = [_as_numpy(v, f"{name}: [{key!r}]") for v in values]
        elif not all(isinstance(v, torch.Tensor) for v in values):
            return None
        if any(v.shape != values[0].shape or v.dtype != values[0].dtype for v in values):
            return None
        out[key] = torch.stack(values) if tensors else np.stack(values)
    return out


def _as_numpy(value: Any, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, (np.ndarray, np.generic, int, float, bool)):
        array = np.asarray(value)
        if array.dtype.hasobject:
            raise TypeError(
                f"{what} has an object dtype, which numpy files cannot hold safely; store its "
                "items as a list with file_format='pt'"
            )
        return array
    raise TypeError(
        f"{what} is a {type(value).__name__}; numpy chunk files hold arrays only (use "
        "file_format='pt' for strings, lists and other values)"
    )


def _for_torch_load(value: Any, what: str) -> Any:
    """``value`` as ``torch.load(weights_only=True)`` reads it back: numpy arrays and scalars as
    tensors of the same dtype, named tuples as tuples, containers rebuilt; ``TypeError`` for
    what it would refuse."""
    if isinstance(value, (np.ndarray, np.generic)):
        if isinstance(value, np.str_):
            return str(value)
        if isinstance(value, np.bytes_):
            return _for_torch_load(bytes(value), what)  # refused, as bytes are
        if value.dtype.kind not in "biufc":
            raise TypeError(
                f"{what} is a numpy {type(value).__name__} of dtype {value.dtype}; .pt chunks "
                "store numeric and bool numpy data as tensors: convert it (e.g. .tolist()) "
                "before writing"
            )
        return torch.from_numpy(np.array(value, copy=True))
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, dict):
        return {k: _for_torch_load(v, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_for_torch_load(v, f"{what}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(
        f"{what} is a {type(value).__name__}; .pt chunks are read with "
        "torch.load(weights_only=True), which takes tensors (numpy arrays are converted to "
        "them), numbers, strings, None and lists, tuples and dicts of them: convert it to "
        "one of those before writing"
    )
