"""Strided reading, shared by the sources that deal one global order out to their readers:
reader ``s`` of ``S`` reads global positions ``s, s + S, ...`` (:class:`StridedCursor`, state
``{"phase", "epoch", "position"}``), with shards downloaded ahead and kept open.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from ..dataset import EpochCursor, Key, SavableDataset
from ..errors import SourceDataError, StateFormatError
from ..rng import stable_hash
from ..state.data_fingerprint import DATA_FIELD, DataFiles
from ..state.plain import StateReader
from ..validation import require_bool, require_int
from ._download import Downloads, Prefetcher, ReaderProgress, ShardCache
from ._order import EpochOrder
from .shard_writer import ShardInfo


class StridedSource(SavableDataset):
    """A source of ``total`` samples per epoch whose global order is cut into
    ``num_canonical_partitions`` spans and read with a stride (see the module documentation)."""

    shuffle: bool
    seed: int
    num_canonical_partitions: int | None
    total: int

    def _set_order(self, shuffle: Any, seed: Any, partitions: Any) -> None:
        """Validate and keep ``shuffle``, ``seed`` and ``num_canonical_partitions``."""
        self.shuffle = require_bool(shuffle, "shuffle")
        self.seed = require_int(seed, "seed", minimum=0)
        if partitions is not None:
            partitions = require_int(partitions, "num_canonical_partitions", minimum=1)
        self.num_canonical_partitions = partitions

    def partitions(self) -> int:
        """P: ``num_canonical_partitions``, or this run's number of readers."""
        return self.num_canonical_partitions or self.context.num_shards

    def __len__(self) -> int:
        """Samples per epoch of this copy's reader."""
        context = self.context
        return len(range(context.shard_index, self.total, context.num_shards))

    def _order_of(self, sizes: Sequence[int], epoch: int, partitions: int | None) -> EpochOrder:
        """``epoch``'s order of units of ``sizes`` samples, shuffled per epoch from (seed, this
        source's stream, epoch), in ``partitions`` spans (``None``: :meth:`partitions`)."""
        seed = stable_hash(self.seed, self.stream_salt(), epoch)
        return EpochOrder(sizes, seed, self.shuffle, partitions or self.partitions())


class StridedCursor(EpochCursor):
    """The reader's next global position: ``shard_index``, then steps of ``num_shards``."""

    #: What a pipeline copy is called when a restored position is not one of its positions.
    reader_name = "reader"

    def __init__(self, dataset: SavableDataset) -> None:
        super().__init__(dataset)
        self.position = 0

    def begin_epoch(self) -> None:
        self.position = self.dataset.context.shard_index

    def fields(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_fields(self, reader: StateReader) -> None:
        self.position = reader.int("position")
        context = self.dataset.context
        if self.phase == "running" and self.position % context.num_shards != context.shard_index:
            raise StateFormatError(
                f"{reader.path}.position {self.position} does not belong to {self.reader_name} "
                f"{context.shard_index} of {context.num_shards}"
            )


class PrefetchingCursor(StridedCursor):
    """A strided cursor whose shards a background :class:`Prefetcher` downloads ahead of it,
    in a :meth:`prefetching` block of the reader (or until :meth:`stop_prefetch`)."""

    def __init__(self, dataset: SavableDataset) -> None:
        super().__init__(dataset)
        self._prefetcher: Prefetcher | None = None
        self._finalizer: weakref.finalize | None = None

    @contextlib.contextmanager
    def prefetching(
        self,
        order: EpochOrder,
        predownload: int,
        cache: Callable[[], ShardCache],
        shard_of: Callable[[int], int] | None = None,
    ) -> Iterator[ReaderProgress]:
        """For the body of a ``with``: download the shards of the next ``predownload`` samples
        (0: no thread; ``shard_of(unit)`` names a unit's shard, default: units are shards) and
        yield the progress the reader updates (``progress.step``); the thread stops when the
        body ends (unless a later start replaced it) or the cursor is dropped."""
        self.stop_prefetch()
        context = self.dataset.context
        start, stride = context.shard_index, context.num_shards
        steps = len(range(start, order.total, stride))
        progress = ReaderProgress((self.position - start) // stride)
        prefetcher = None
        if predownload > 0 and progress.step < steps:

            def shard_at(step: int) -> int:
                unit = order.locate(start + step * stride)[0]
                return unit if shard_of is None else shard_of(unit)

            prefetcher = Prefetcher(cache(), shard_at, steps, predownload, progress)
            prefetcher.start()
            self._prefetcher = prefetcher
            # Stop the thread if this cursor is dropped without finishing its epoch.
            self._finalizer = weakref.finalize(self, prefetcher.stop_event.set)
        try:
            yield progress
        finally:
            if self._prefetcher is prefetcher:
                self.stop_prefetch()

    def read_rows(
        self,
        order: EpochOrder,
        predownload: int,
        cache: Callable[[], ShardCache],
        files: OpenShards[Any],
        read: Callable[[Any, int, int], Any],
        skip: Callable[[int, int, SourceDataError], None] | None = None,
    ) -> Iterator[tuple[Key, Any]]:
        """Every ``((shard, row), sample)`` of ``order`` this reader reads from its position,
        each made by ``read(file, shard, row)`` on the shard ``files`` keeps open, with the
        next ``predownload`` samples' shards downloaded ahead. With ``skip``, a sample whose
        read raises :class:`SourceDataError` is passed over after ``skip(shard, row, error)``.
        The download thread and the files are closed when the walk ends or is abandoned."""
        context = self.dataset.context
        stride, start = context.num_shards, context.shard_index
        partitions = order.partitions
        try:
            with self.prefetching(order, predownload, cache) as progress:
                for shard, row in order.walk(self.position, stride):
                    try:
                        sample = read(files.get(self.position % partitions, shard), shard, row)
                    except SourceDataError as error:
                        if skip is None:
                            raise
                        skip(shard, row, error)
                        self.position += stride
                        progress.step = (self.position - start) // stride
                        continue
                    self.position += stride
                    progress.step = (self.position - start) // stride
                    yield (shard, row), sample
        finally:
            files.close()

    def stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.stop()
            self._prefetcher = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None


class _Closable(Protocol):
    def close(self) -> None: ...


F = TypeVar("F", bound=_Closable)


class OpenShards(Generic[F]):
    """The shards a strided reader has open, one per span, shared by spans; ``release(shard)`` runs
    after a file is closed (a cache may then evict it). Not thread-safe: one reader uses it."""

    def __init__(self, open_shard: Callable[[int], F], release: Callable[[int], None]) -> None:
        self._open = open_shard
        self._release = release
        self.files: dict[int, F] = {}
        self._users: dict[int, int] = {}  # open shard -> number of spans reading it
        self._current: dict[int, int] = {}  # span -> the shard it is reading

    def get(self, span: int, shard: int) -> F:
        """The open file of ``shard``, now read by ``span`` (closing what no span reads)."""
        if self._current.get(span) != shard:
            previous = self._current.pop(span, None)
            if shard not in self.files:
                self.files[shard] = self._open(shard)
            self._current[span] = shard
            self._users[shard] = self._users.get(shard, 0) + 1
            if previous is not None:
                self._users[previous] -= 1
                if not self._users[previous]:
                    del self._users[previous]
                    self.files.pop(previous).close()
                    self._release(previous)
        return self.files[shard]

    def close(self) -> None:
        """Close and release every open shard."""
        for shard, file in self.files.items():
            file.close()
            self._release(shard)
        self.files = {}


class RestoreShard(Generic[F]):
    """The one shard ``restore_sample`` keeps open between calls (restores tend to ask for
    neighbouring samples); reopened when another shard is asked for, and after a failed read."""

    def __init__(self) -> None:
        self.shard = -1
        self.file: F | None = None

    def read(self, shard: int, open_shard: Callable[[int], F], read: Callable[[F], Any]) -> Any:
        """``read(file)`` on the open file of ``shard`` (opened with ``open_shard``)."""
        if self.file is None or self.shard != shard:
            self.close()
            self.file = open_shard(shard)
            self.shard = shard
        try:
            return read(self.file)
        except (OSError, SourceDataError):
            self.close()
            raise

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def is_shard_row(key: Key, shards: Sequence[ShardInfo]) -> bool:
    """Whether ``key`` is a ``(shard, row)`` restore key naming a sample of ``shards``."""
    return (
        len(key) == 2
        and not any(isinstance(part, bool) or not isinstance(part, int) for part in key)
        and 0 <= key[0] < len(shards)
        and 0 <= key[1] < shards[key[0]].samples
    )


class ShardRowCursor(PrefetchingCursor):
    """Reads a :class:`ShardRowSource`'s rows in its epoch order, downloading ahead what comes
    through its cache."""

    dataset: ShardRowSource

    def on_damage(self) -> Callable[[int, int, SourceDataError], None] | None:
        """What is called for a sample whose read raised :class:`SourceDataError` before it is
        skipped (``None``: the error propagates)."""
        return None

    def resume(self) -> Iterator[tuple[Key, Any]]:
        source = self.dataset
        files = OpenShards(source.open_shard, source.release)
        predownload = source.predownload if source.cached else 0
        order = source.epoch_order(self.epoch)
        yield from self.read_rows(
            order, predownload, source.cache, files, source.read_row, self.on_damage()
        )


class ShardRowSource(Downloads, StridedSource):
    """A strided source over shards whose samples are ``(shard, row)`` (ShardWriter, WebDataset,
    MDS, litdata): the reading cursor, the key check, ``restore_sample`` through one open shard,
    shared config fields. A subclass sets ``shards``, ``cached``, ``_fingerprint`` and
    ``_restore`` and defines ``open_shard``, ``read_row``, ``cache`` and ``data_files``."""

    shards: tuple[ShardInfo, ...]
    #: Whether shards come through the download cache (``False``: read where they lie).
    cached: bool
    _fingerprint: int
    _restore: RestoreShard[Any]

    @abstractmethod
    def cache(self) -> ShardCache:
        """This process's view of the download cache."""

    def release(self, shard: int) -> None:
        """The reader is done with ``shard`` for now (a cached one may be evicted)."""
        if self.cached:
            self.cache().release(shard)

    def _new_cursor(self) -> EpochCursor:
        return ShardRowCursor(self)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_restore": RestoreShard()}

    @abstractmethod
    def open_shard(self, shard: int) -> Any:
        """Shard ``shard``'s file, open for reading rows (each format its own)."""

    @abstractmethod
    def read_row(self, file: Any, shard: int, row: int) -> Any:
        """Row ``row`` of the open ``file`` of ``shard``, decoded into a sample."""

    @abstractmethod
    def data_files(self) -> DataFiles:
        """The files this source reads, fingerprinted once, on first use
        (:mod:`energy_loader.state.data_fingerprint`)."""

    def epoch_order(self, epoch: int, partitions: int | None = None) -> EpochOrder:
        """The global order of ``epoch``: the shards' rows, shuffled per epoch from (seed,
        this source's stream, epoch), in the partitions' spans
        (:mod:`energy_loader.sources._order`)."""
        return self._order_of([info.samples for info in self.shards], epoch, partitions)

    def global_order(self, epoch: int, partitions: int | None = None) -> list[tuple[int, int]]:
        """The epoch's global order as ``(shard, row)`` keys (for tests and audits: O(N))."""
        order = self.epoch_order(epoch, partitions)
        return [order.key(position) for position in range(self.total)]

    def _key_scope(self) -> str:
        """Where the shards are, for the restore key's message (empty: not said)."""
        return ""

    #: Whether a restore key must be a tuple (ShardedSource takes any sequence).
    _tuple_keys = True

    def validate_key(self, key: Key) -> None:
        if (self._tuple_keys and not isinstance(key, tuple)) or not is_shard_row(key, self.shards):
            raise ValueError(
                f"{type(self).__name__} restore keys are (shard, row) within the "
                f"{len(self.shards)} shards of {self._key_scope() or 'this source'}; "
                f"got {key!r}"
            )

    def restore_sample(self, key: Key) -> Any:
        self.validate_key(key)
        shard, row = key
        return self._restore.read(
            shard, self.open_shard, lambda file: self.read_row(file, shard, row)
        )

    def can_restore_sample(self) -> bool:
        return True

    def _config_fields(self) -> dict[str, Any]:
        """The config fields every shard source has: its shards, order and content."""
        return {
            "shards": len(self.shards),
            "total_samples": self.total,
            "fingerprint": self._fingerprint,
            DATA_FIELD: self.data_files().plain,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "num_canonical_partitions": self.num_canonical_partitions,
        }
