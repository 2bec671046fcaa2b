"""ParquetSource: rows of Parquet files (local or any fsspec URL) as dict samples, through
pyarrow, with random access by row group, a local shuffle and exact resume. State: ``{"phase",
"epoch", "position"}``; restore key ``(file, row_group, row)``. See docs/sources/parquet.md.
"""

from __future__ import annotations

import bisect
import collections
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch.utils.data

from ..dataset import EpochCursor, Key
from ..errors import DownloadError, SourceDataError
from ..rng import stable_hash
from ..state.data_fingerprint import DATA_FIELD, DataFiles, relative_names
from ..validation import require_int
from ._download import is_url as _is_url
from ._download import list_files, storage_options_dict
from ._order import EpochOrder
from ._strided import StridedCursor, StridedSource
from .permutation import FeistelPermutation

__all__ = ["ParquetSource"]

_SUFFIXES = (".parquet", ".pq")


def _take(table: Any, rows: np.ndarray) -> list[dict[str, Any]]:
    """Rows ``rows`` of an Arrow table as dicts, in that order: a slice when they are
    consecutive, else a ``take``."""
    import pyarrow as pa

    count, first = len(rows), int(rows[0])
    if int(rows[-1]) - first == count - 1 and (count == 1 or (np.diff(rows) == 1).all()):
        return table.slice(first, count).to_pylist()  # type: ignore[no-any-return]
    # ``pa.array(numpy array)`` would import pandas (~0.5 s of CPU in every worker).
    data = np.ascontiguousarray(rows, dtype=np.int64)
    indices = pa.Array.from_buffers(pa.int64(), count, [None, pa.py_buffer(data)])
    return table.take(indices).to_pylist()  # type: ignore[no-any-return]


class _Window:
    """The decoded row groups of one window, rows numbered across them: one table for one schema;
    with differing schemas each keeps its own and rows are read one by one, keeping their file's
    values and keys."""

    __slots__ = ("starts", "tables")

    def __init__(self, tables: list[Any]) -> None:
        import pyarrow as pa

        if len(tables) > 1 and all(t.schema.equals(tables[0].schema) for t in tables[1:]):
            tables = [pa.concat_tables(tables).combine_chunks()]
        self.tables = tables
        self.starts = np.cumsum([0] + [table.num_rows for table in tables])

    def rows(self, rows: np.ndarray) -> list[dict[str, Any]]:
        """Rows ``rows`` (a non-empty ``int64`` array) as dicts, in that order."""
        if len(self.tables) == 1:
            return _take(self.tables[0], rows)
        tables = self.tables
        return [_row(tables[slot], row) for slot, row in _locate(self.starts, rows)]


def _locate(starts: np.ndarray, rows: np.ndarray) -> Iterator[tuple[int, int]]:
    """``(table, row in it)`` of rows numbered across tables that start at ``starts``."""
    slots = np.searchsorted(starts, rows, side="right") - 1
    return zip(slots.tolist(), (rows - starts[slots]).tolist())


def _row(table: Any, row: int) -> dict[str, Any]:
    return table.slice(row, 1).to_pylist()[0]  # type: ignore[no-any-return]


class _ParquetOrder:
    """One epoch's global order: position -> ``(row group, row)``. O(row groups) memory."""

    def __init__(self, source: ParquetSource, epoch: int, partitions: int) -> None:
        sizes = source.row_group_rows
        seed = stable_hash(source.seed, source.stream_salt(), epoch)
        count = len(sizes)
        if source.shuffle and count > 1:
            permutation = FeistelPermutation(count, stable_hash(seed, "row-groups"))
            groups = permutation.take(np.arange(count, dtype=np.uint64)).astype(np.int64)
            width = source.shuffle_window
        else:
            groups = np.arange(count, dtype=np.int64)
            width = 1
        # The row groups in epoch order, back to back: where each starts in that sequence, and
        # where each window (``width`` consecutive ones) starts.
        self.groups = groups
        self.width = width
        self.group_starts = np.concatenate(([0], np.cumsum(np.asarray(sizes)[groups])[:-1]))
        window_starts = self.group_starts[::width]
        window_sizes = np.diff(np.append(window_starts, sum(sizes)))
        self.window_starts = window_starts
        self.order = EpochOrder(
            window_sizes.tolist(), seed, source.shuffle, partitions, shuffle_units=False
        )
        self.total = self.order.total
        self.partitions = partitions

    @property
    def windows(self) -> list[list[int]]:
        """The row groups of each window, in epoch order."""
        count = -(-len(self.groups) // self.width)
        return [list(self.window_groups(window)) for window in range(count)]

    def groups_and_rows(
        self, windows: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(row groups, rows in them)`` of rows of windows."""
        at = self.window_starts[windows] + rows
        slots = np.searchsorted(self.group_starts, at, side="right") - 1
        return self.groups[slots], at - self.group_starts[slots]

    def blocks(self, position: int, stride: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(row groups, rows)`` arrays of positions ``position, position + stride, ...``, a
        block at a time (see :meth:`EpochOrder.blocks`)."""
        for windows, rows in self.order.blocks(position, stride):
            yield self.groups_and_rows(windows, rows)

    def walk(self, position: int, stride: int) -> Iterator[tuple[int, int]]:
        """``(row group, row)`` of positions ``position, position + stride, ...``."""
        for groups, rows in self.blocks(position, stride):
            yield from zip(groups.tolist(), rows.tolist())

    def window_groups(self, window: int) -> tuple[int, ...]:
        """The row groups of ``window``, in epoch order."""
        width = self.width
        return tuple(self.groups[window * width : (window + 1) * width].tolist())


class _ParquetCursor(StridedCursor):
    dataset: ParquetSource

    def resume(self) -> Iterator[tuple[Key, Any]]:
        source = self.dataset
        stride = source.context.num_shards
        order = source.epoch_order(self.epoch)
        spans = order.partitions // math.gcd(order.partitions, stride)
        # One span walks its windows front to back: a window is never needed again once the
        # next is read, so it holds one. Several spans interleave theirs, and one more
        # keeps the window a span is about to leave from pushing out another span's.
        width = source.shuffle_window if source.shuffle else 1
        source.set_cache_bound(spans * width + (1 if spans > 1 else 0))
        files, numbers = source.group_files, source.group_numbers
        for windows, window_rows in order.order.blocks(self.position, stride):
            samples, error = source.rows_at(order, windows, window_rows)
            groups, rows = order.groups_and_rows(windows, window_rows)
            keys = zip(files[groups].tolist(), numbers[groups].tolist(), rows.tolist())
            for key, sample in zip(keys, samples):
                self.position += stride
                yield key, sample
            if error is not None:
                raise error


class ParquetSource(StridedSource):
    """Read the rows of Parquet files (a directory, a file or a list; local or fsspec) as dict
    samples of ``columns``, permuted within windows of ``shuffle_window`` row groups, resumed
    exactly. Remote retries and damaged files: docs/sources/parquet.md. Example::

        source = ParquetSource("/data/train", columns=["text", "label"], shuffle=True, seed=7)
    """

    def __init__(
        self,
        paths_or_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        columns: Sequence[str] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        num_canonical_partitions: int | None = None,
        shuffle_window: int = 4,
        max_cached_row_groups: int | None = None,
        storage_options: dict[str, Any] | None = None,
        read_retries: int = 2,
    ) -> None:
        super().__init__()
        # ``Table.take`` needs pyarrow.compute. Imported here, in the process that builds the
        # pipeline, forked loader workers inherit it instead of each paying ~0.15 s for it.
        import pyarrow.compute  # noqa: F401

        self._set_order(shuffle, seed, num_canonical_partitions)
        self.shuffle_window = require_int(shuffle_window, "shuffle_window", minimum=1)
        if max_cached_row_groups is not None:
            require_int(max_cached_row_groups, "max_cached_row_groups", minimum=1)
        self.max_cached_row_groups = max_cached_row_groups
        self.read_retries = require_int(read_retries, "read_retries", minimum=0)
        self.storage_options = storage_options_dict(storage_options)
        if columns is not None:
            if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
                raise TypeError(f"`columns` must be a list of column names (got {columns!r})")
            columns = list(columns)
        self.columns = columns
        self.paths = tuple(self._resolve(paths_or_dir))
        self._files: dict[int, Any] = {}
        self._files_pid = -1
        groups: list[tuple[int, int]] = []
        rows: list[int] = []
        for number in range(len(self.paths)):
            metadata = self._file(number).metadata
            for group in range(metadata.num_row_groups):
                count = metadata.row_group(group).num_rows
                if count:
                    groups.append((number, group))
                    rows.append(count)
        self.row_groups = tuple(groups)
        self.row_group_rows = tuple(rows)
        # Each row group's file and number in it, to build restore keys a block at a time.
        self.group_files = np.array([file for file, _ in groups], dtype=np.int64)
        self.group_numbers = np.array([number for _, number in groups], dtype=np.int64)
        self.total = sum(rows)
        for handle in self._files.values():  # each process opens its own
            handle.close()
        self._files = {}
        # Decoded windows (or single row groups), keyed by the row groups they hold.
        self._cache: collections.OrderedDict[tuple[int, ...], _Window] = collections.OrderedDict()
        self._cache_bound = self.max_cached_row_groups or self.shuffle_window
        self._data_files: DataFiles | None = None

    # -- construction helpers ----------------------------------------------------------------

    def _resolve(self, paths_or_dir: Any) -> list[str]:
        if isinstance(paths_or_dir, (str, os.PathLike)):
            location = os.fspath(paths_or_dir)
            missing, empty = "is neither a Parquet file nor a directory", "holds no .parquet files"
            return list_files(location, self.storage_options, _SUFFIXES, missing, empty, deep=True)
        if isinstance(paths_or_dir, Sequence) and paths_or_dir:
            out = []
            for path in paths_or_dir:
                if not isinstance(path, (str, os.PathLike)):
                    raise TypeError(f"Parquet file locations must be paths or URLs (got {path!r})")
                text = os.fspath(path)
                out.append(text if _is_url(text) else str(Path(text).resolve()))
            if len(set(out)) != len(out):
                raise ValueError("`paths_or_dir` lists a file more than once")
            return out
        raise TypeError(
            "`paths_or_dir` must be a directory, a file or a non-empty list of files "
            f"(got {paths_or_dir!r})"
        )

    def _file(self, number: int) -> Any:
        """This process's ``pyarrow.parquet.ParquetFile`` of file ``number`` (opened lazily)."""
        import pyarrow
        import pyarrow.parquet as pq

        if self._files_pid != os.getpid():
            self._files = {}
            self._files_pid = os.getpid()
        handle = self._files.get(number)
        if handle is None:
            path = self.paths[number]
            try:
                if _is_url(path):
                    import fsspec

                    fs, root = fsspec.core.url_to_fs(path, **self.storage_options)
                    handle = pq.ParquetFile(fs.open(root, "rb"))
                else:
                    handle = pq.ParquetFile(path, memory_map=False)
            except FileNotFoundError:
                raise FileNotFoundError(f"Parquet file {path} does not exist") from None
            except (pyarrow.ArrowInvalid, pyarrow.ArrowException) as error:
                raise SourceDataError(
                    f"{path} is not a readable Parquet file (corrupt or truncated footer?): {error}"
                ) from None
            if self.columns is not None:
                missing = [c for c in self.columns if c not in handle.schema_arrow.names]
                if missing:
                    raise ValueError(
                        f"`columns` {missing} are not in {path}; it has {handle.schema_arrow.names}"
                    )
            self._files[number] = handle
        return handle

    # -- reading -----------------------------------------------------------------------------

    def epoch_order(self, epoch: int, partitions: int | None = None) -> _ParquetOrder:
        """The global order of ``epoch`` (the module docstring's order)."""
        return _ParquetOrder(self, epoch, partitions or self.partitions())

    def global_order(self, epoch: int, partitions: int | None = None) -> list[tuple[int, ...]]:
        """The epoch's global order as restore keys (for tests and audits: O(N))."""
        order = self.epoch_order(epoch, partitions)
        return [(*self.row_groups[group], row) for group, row in order.walk(0, 1)]

    def set_cache_bound(self, needed: int) -> None:
        """Keep ``needed`` decoded row groups (or ``max_cached_row_groups`` if set)."""
        self._cache_bound = self.max_cached_row_groups or max(needed, 1)

    def rows_at(
        self, order: _ParquetOrder, windows: np.ndarray, rows: np.ndarray
    ) -> tuple[list[dict[str, Any]], Exception | None]:
        """Rows ``rows[i]`` of windows ``windows[i]`` of ``order`` as dicts, in order, and the error
        that cut the list short before the first row of an unreadable row group (so the rows before
        it are delivered first)."""
        if len(windows) == 0:
            return [], None
        if windows[0] == windows[-1] and (windows == windows[0]).all():  # the common case
            return self._window_rows(order.window_groups(int(windows[0])), rows)
        starts = [0, *(np.flatnonzero(windows[1:] != windows[:-1]) + 1).tolist()]
        if len(set(windows[starts].tolist())) == len(starts):
            # A block across the end of a window (a reader of one span): run after run.
            out: list[dict[str, Any]] = []
            for start, stop in zip(starts, [*starts[1:], len(windows)]):
                groups = order.window_groups(int(windows[start]))
                samples, error = self._window_rows(groups, rows[start:stop])
                out.extend(samples)
                if error is not None:
                    return out, error
            return out, None
        # Windows interleaved (a reader of several spans): each window's rows at once, put
        # back in block order; an error cuts the block at the first row it withholds.
        merged: list[Any] = [None] * len(windows)
        cut, first_error = len(windows), None
        for window in np.unique(windows).tolist():
            chosen = np.flatnonzero(windows == window)
            samples, error = self._window_rows(order.window_groups(window), rows[chosen])
            for at, sample in zip(chosen.tolist(), samples):
                merged[at] = sample
            if error is not None and chosen[len(samples)] < cut:
                cut, first_error = int(chosen[len(samples)]), error
        return merged[:cut], first_error

    def _window_rows(
        self, groups: tuple[int, ...], rows: np.ndarray
    ) -> tuple[list[dict[str, Any]], Exception | None]:
        """Rows of the window of ``groups`` (numbered across them) as dicts."""
        try:
            window = self._window(groups)
        except Exception:  # a damaged row group: the rows before it, then its error
            return self._rows_before_damage(groups, rows)
        return window.rows(rows), None

    def _window(self, groups: tuple[int, ...]) -> _Window:
        """The decoded row groups ``groups``, from the LRU cache if there."""
        cache = self._cache
        window = cache.get(groups)
        if window is not None:
            cache.move_to_end(groups)
            return window
        # Make room first: the windows this one replaces are freed before it is decoded, so a
        # reader holds its cache bound of row groups, not that plus the one being read.
        held, evicted = sum(len(key) for key in cache), False
        while cache and held + len(groups) > self._cache_bound:
            held -= len(cache.popitem(last=False)[0])
            evicted = True
        if evicted:
            # Their pages back to the OS before the next is decoded: Arrow's allocator keeps them,
            # ~8 MiB more peak RSS a worker with 4,096-document row groups (llm bench). Once per
            # window, every few thousand rows: cheap at that rate.
            import pyarrow

            pyarrow.default_memory_pool().release_unused()
        window = _Window([self._read(group) for group in groups])
        cache[groups] = window
        return window

    def _rows_before_damage(
        self, groups: tuple[int, ...], rows: np.ndarray
    ) -> tuple[list[dict[str, Any]], Exception | None]:
        """Rows of a window with a damaged row group, up to the first row that needs it."""
        tables: dict[int, Any] = {}
        errors: dict[int, Exception] = {}
        for group in groups:
            try:
                tables[group] = self._read(group)
            except Exception as error:
                errors[group] = error
        starts = np.cumsum([0] + [self.row_group_rows[group] for group in groups])
        out: list[dict[str, Any]] = []
        for slot, row in _locate(starts, rows):
            group = groups[slot]
            if group in errors:
                return out, errors[group]
            out.append(_row(tables[group], row))
        return out, None

    def _read(self, group: int) -> Any:
        """Row group ``group`` as an Arrow table (retrying remote reads)."""
        import pyarrow

        number, index = self.row_groups[group]
        path = self.paths[number]
        # A local file reads the same bytes every time, so an error reading it is damage. A
        # remote read may have been cut off in transit: it is tried again, and an error that
        # outlasts the retries is a DownloadError (pyarrow reports a damaged page and a
        # broken connection alike, as OSError).
        remote = _is_url(path)
        attempts = self.read_retries + 1 if remote else 1
        # Loader workers already decode in parallel, one row group each: Arrow's thread pool
        # would only add ~0.2 us of CPU a row (measured, 4 columns) on cores that are busy.
        in_loader_worker = torch.utils.data.get_worker_info() is not None
        last: BaseException | None = None
        for attempt in range(attempts):
            try:
                table = self._file(number).read_row_group(
                    index, columns=self.columns, use_threads=not in_loader_worker
                )
            except pyarrow.ArrowInvalid as error:
                last = error
                break
            except OSError as error:  # pyarrow's I/O errors (ArrowIOError) are OSErrors too
                last = error
            else:
                if table.num_rows != self.row_group_rows[group]:
                    raise SourceDataError(
                        f"{path}, row group {index}: {table.num_rows} rows, the footer says "
                        f"{self.row_group_rows[group]}"
                    )
                return table
            self._files.pop(number, None)  # reopen: the connection may be gone
            if attempt + 1 < attempts:
                time.sleep(min(0.05 * 2**attempt, 1.0))
        if isinstance(last, pyarrow.ArrowInvalid) or not remote:
            raise SourceDataError(
                f"{path}, row group {index} (samples ({number}, {index}, *)): cannot decode: {last}"
            ) from None
        raise DownloadError(
            f"cannot read {path}, row group {index} after {attempts} attempts: "
            f"{type(last).__name__}: {last}"
        ) from last

    # -- protocol --------------------------------------------------------------------------

    def _new_cursor(self) -> EpochCursor:
        return _ParquetCursor(self)

    def data_files(self) -> DataFiles | None:
        """The local files, sampled, fingerprinted on first use
        (:mod:`energy_loader.state.data_fingerprint`); remote ones have none."""
        if self._data_files is None and not _is_url(self.paths[0]):
            self._data_files = DataFiles.local(*relative_names(self.paths))
        return self._data_files

    def validate_key(self, key: Key) -> None:
        if (
            isinstance(key, tuple)
            and len(key) == 3
            and not any(isinstance(part, bool) or not isinstance(part, int) for part in key)
        ):
            position = bisect.bisect_left(self.row_groups, (key[0], key[1]))
            if (
                position < len(self.row_groups)
                and self.row_groups[position] == (key[0], key[1])
                and 0 <= key[2] < self.row_group_rows[position]
            ):
                return
        raise ValueError(
            "ParquetSource restore keys are (file, row_group, row) naming a row of the "
            f"{len(self.paths)} files of this source; got {key!r}"
        )

    def restore_sample(self, key: Key) -> Any:
        self.validate_key(key)
        group = bisect.bisect_left(self.row_groups, (key[0], key[1]))
        return _row(self._window((group,)).tables[0], key[2])

    def can_restore_sample(self) -> bool:
        return True

    def _config_fields(self) -> dict[str, Any]:
        files = self.data_files()
        return {
            "files": len(self.paths),
            "row_groups": len(self.row_groups),
            "total_samples": self.total,
            **({} if files is None else {DATA_FIELD: files.plain}),
            "columns": self.columns,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "shuffle_window": self.shuffle_window,
            "num_canonical_partitions": self.num_canonical_partitions,
        }

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_files={}, _files_pid=-1, _cache=collections.OrderedDict())
        return state
