"""Remote files of the shard sources: listing, the local cache (node-wide locks, validated
downloads, eviction under ``cache_limit``) and the thread that downloads ahead. See
docs/sources/sharded.md.
"""

from __future__ import annotations

import bz2
import collections
import contextlib
import fcntl
import gzip
import hashlib
import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from ..errors import DownloadError, SourceDataError
from ..validation import require_int
from .shard_writer import ShardInfo, zstd_module

LOGGER = logging.getLogger("energy_loader.sources.sharded")
_READ_SIZE = 1 << 20
LOCKS = ".locks"


def resolve_cache_dir(cache_dir: Any, kind: str, location: str) -> Path:
    """The cache directory a source was given (``TypeError`` unless a local path), resolved; for
    ``None``, ``~/.cache/energy_loader/<kind>/<hash of location>`` (``$XDG_CACHE_HOME`` if set)."""
    if cache_dir is None:
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        digest = hashlib.sha256(location.encode()).hexdigest()[:16]
        return Path(root) / "energy_loader" / kind / digest
    if not isinstance(cache_dir, (str, os.PathLike)) or "://" in os.fspath(cache_dir):
        raise TypeError(f"`cache_dir` must be a local directory path (got {cache_dir!r})")
    return Path(cache_dir).resolve()


def is_url(path: str) -> bool:
    return "://" in path


def storage_options_dict(storage_options: Any) -> dict[str, Any]:
    """A copy of the fsspec options a source was given (``TypeError`` unless a dict or None)."""
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(
            f"`storage_options` must be a dict of fsspec options (got {storage_options!r})"
        )
    return dict(storage_options or {})


def list_files(
    url: str, options: dict[str, Any], ends: tuple[str, ...], *messages: str, deep: bool = False
) -> list[str]:
    """``[url]`` for a file, else the files of the directory ``url`` (local or fsspec;
    ``deep``: subfolders too) whose names end with ``ends``, sorted. ``messages``: ``url``
    is missing, holds none."""
    if is_url(url):
        import fsspec

        fs, root = fsspec.core.url_to_fs(url, **options)
        if fs.isfile(root):
            return [url]
        protocol = url.split("://", 1)[0]
        found = fs.find(root) if deep else fs.glob(root.rstrip("/") + "/*")
        paths = [f"{protocol}://{path}" for path in sorted(found) if path.endswith(ends)]
    else:
        path = Path(url)
        if path.is_file():
            return [str(path.resolve())]
        if not path.is_dir():
            raise FileNotFoundError(f"{url} {messages[0]}")
        found = path.rglob("*") if deep else path.glob("*")
        paths = sorted(str(p.resolve()) for p in found if p.name.endswith(ends))
    if not paths:
        raise FileNotFoundError(f"{url} {messages[1]}")
    return paths


def positive_seconds(value: Any, name: str) -> float:
    """``value`` as a float, or ``ValueError`` unless it is a finite number of seconds above 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"`{name}` must be a positive number of seconds (got {value!r})")
    return float(value)


@contextlib.contextmanager
def node_lock(path: Path, timeout: float, purpose: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (node-wide; it belongs to an open file, so threads of
    one process exclude each other too); :class:`DownloadError` after ``timeout`` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(path, "a+b") as handle:
        delay = 0.002
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise DownloadError(
                        f"waited {timeout:.1f} s for the lock {path} ({purpose}) held by another "
                        "process of this node; is a download stuck, or is download_timeout too "
                        "small for the shard size?"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


class Remote:
    """A remote directory: any fsspec URL, or a local directory standing in for one. The filesystem
    is opened lazily in each process; ``storage_options`` must be plain data (they travel)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url if "://" in url else str(Path(url).resolve())
        self.storage_options = storage_options_dict(storage_options)
        self._fs: Any = None
        self._root = ""
        self._pid = -1

    def filesystem(self) -> tuple[Any, str]:
        """This process's fsspec filesystem and the remote's root path in it."""
        if self._fs is None or self._pid != os.getpid():
            import fsspec

            self._fs, self._root = fsspec.core.url_to_fs(self.url, **self.storage_options)
            self._pid = os.getpid()
        return self._fs, self._root

    def where(self, name: str) -> str:
        """The full URL of ``name`` (for messages)."""
        return f"{self.url.rstrip('/')}/{name}"

    def open(self, name: str) -> Any:
        """Open ``name`` for binary reading (``FileNotFoundError`` if it is not there)."""
        fs, root = self.filesystem()
        return fs.open(f"{root.rstrip('/')}/{name}", "rb")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_root": "", "_pid": -1}


class _Corrupt(Exception):
    """A downloaded file failed validation."""


class _Stopped(Exception):
    """The download was abandoned because its thread was asked to stop."""


def parse_json(data: bytes | str, where: str) -> Any:
    """An index file's JSON; :class:`SourceDataError` naming ``where`` if it is not JSON."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SourceDataError(f"{where} is not valid JSON: {error}") from None


class Downloads:
    """The download side of a source whose files come from a :class:`Remote` through a
    :class:`ShardCache`: its validated settings, small fetches, and the cache, made on first use
    in each process (never pickled)."""

    predownload: int
    cache_limit: int | None
    download_retries: int
    download_timeout: float
    _cache: ShardCache | None = None
    _cache_pid = -1

    def _set_downloads(
        self, predownload: Any, cache_limit: Any, download_retries: Any, download_timeout: Any
    ) -> None:
        """Validate and keep ``predownload`` (>= 0), ``cache_limit`` (None or > 0 bytes),
        ``download_retries`` (>= 0) and ``download_timeout`` (> 0 s)."""
        self.predownload = require_int(predownload, "predownload", minimum=0)
        if cache_limit is not None:
            cache_limit = require_int(cache_limit, "cache_limit", minimum=1)
        self.cache_limit = cache_limit
        self.download_retries = require_int(download_retries, "download_retries", minimum=0)
        self.download_timeout = positive_seconds(download_timeout, "download_timeout")

    def _require_room(self, shards: tuple[ShardInfo, ...]) -> None:
        """``ValueError`` unless ``cache_limit`` holds the largest of ``shards`` uncompressed."""
        largest = max((info.raw_bytes for info in shards), default=0)
        if self.cache_limit is not None and self.cache_limit < largest:
            raise ValueError(
                f"`cache_limit` ({self.cache_limit} bytes) must hold at least the largest "
                f"shard ({largest} bytes uncompressed)"
            )

    def fetch(self, remote: Remote, name: str) -> bytes:
        """A small remote file (an index) in memory, with retries and a per-attempt timeout."""
        retries, timeout = self.download_retries, self.download_timeout
        last: BaseException | None = None
        for attempt in range(retries + 1):
            try:
                deadline = time.monotonic() + timeout
                out = bytearray()
                with remote.open(name) as source:
                    while chunk := source.read(_READ_SIZE):
                        out += chunk
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"reading took more than {timeout} s")
                return bytes(out)
            except FileNotFoundError:
                raise
            except (OSError, TimeoutError) as error:
                last = error
                if attempt < retries:
                    time.sleep(min(0.05 * 2**attempt, 1.0))
        raise DownloadError(
            f"cannot read {remote.where(name)} after {retries + 1} attempts: "
            f"{type(last).__name__}: {last}"
        ) from last

    def _shard_cache(
        self, remote: Remote, local: Path, shards: tuple[ShardInfo, ...], **options: Any
    ) -> ShardCache:
        """This process's cache of ``shards`` in ``local`` (``options``: ShardCache's
        ``compression`` and ``remedy``)."""
        if self._cache is None or self._cache_pid != os.getpid():
            local.mkdir(parents=True, exist_ok=True)
            self._cache = ShardCache(
                remote,
                local,
                shards,
                retries=self.download_retries,
                timeout=self.download_timeout,
                cache_limit=self.cache_limit,
                **options,
            )
            self._cache_pid = os.getpid()
        return self._cache

    def __getstate__(self) -> dict[str, Any]:
        return {**cast(dict[str, Any], super().__getstate__()), "_cache": None, "_cache_pid": -1}


class ShardCache:
    """The shards of one index in a local directory: ensure present, release, evict (with
    ``cache_limit``, oldest released first; docs/sources/sharded.md)."""

    def __init__(
        self,
        remote: Remote,
        local: Path,
        shards: tuple[ShardInfo, ...],
        *,
        compression: str | None,
        retries: int,
        timeout: float,
        cache_limit: int | None,
        remedy: str = "rewrite the dataset with ShardWriter",
    ) -> None:
        self.remote = remote
        self.remedy = remedy
        self.local = local
        self.shards = shards
        self.compression = compression
        self.retries = retries
        self.timeout = timeout
        self.cache_limit = cache_limit
        # Another process may download a shard for up to every attempt's timeout; wait longer.
        self.lock_timeout = 2.0 * (retries + 1) * timeout + 1.0
        self._done: collections.deque[int] = collections.deque()
        self._done_lock = threading.Lock()
        # Bytes promised to downloads in progress in this process (the reader's and the
        # prefetch thread's): counted as used, so two downloads cannot both take the same room.
        self._reserved: dict[int, int] = {}
        # Shards whose download ahead of the reader failed: the reader raises that error
        # when it gets there, instead of downloading (and failing) all over again.
        self._failed: dict[int, BaseException] = {}

    def path(self, shard: int) -> Path:
        """Where shard ``shard`` lives (uncompressed) once downloaded."""
        return self.local / self.shards[shard].raw_name

    def local_path(self, shard: int, what: str) -> Path:
        """The local path of shard ``shard``, downloaded first if needed (``what`` names it in
        the :class:`DownloadError` of a download that gave up)."""
        path = self.ensure(shard)
        if path is None:
            raise DownloadError(f"{what} could not be downloaded")
        return path

    def present(self, shard: int) -> bool:
        """Whether the shard's complete file is in the cache."""
        try:
            return self.path(shard).stat().st_size == self.shards[shard].raw_bytes
        except FileNotFoundError:
            return False

    def ensure(
        self, shard: int, *, ahead: bool = False, stop: threading.Event | None = None
    ) -> Path | None:
        """Make shard ``shard`` present and return its path. ``ahead=True`` (the prefetch thread)
        returns ``None`` rather than download into a full cache or once ``stop`` is set, and keeps
        a failure for the reader's next ``ensure`` to raise once."""
        # The reader takes the shard off the eviction list under the eviction lock: the prefetch
        # thread cannot evict a shard the reader came back to before it opens it.
        if not ahead and self.cache_limit is not None:
            with node_lock(self.local / LOCKS / "cache.lock", self.lock_timeout, "cache eviction"):
                with self._done_lock:
                    if shard in self._done:
                        self._done.remove(shard)
                if self.present(shard):
                    return self.path(shard)
        elif self.present(shard):
            return self.path(shard)
        info = self.shards[shard]
        lock = self.local / LOCKS / f"{info.raw_name}.lock"
        with node_lock(lock, self.lock_timeout, f"download of shard {info.name}"):
            if ahead and shard in self._failed:
                return self.path(shard)  # already failed; the reader will raise it
            failure = self._failed.pop(shard, None)
            if failure is not None:
                raise failure
            if self.present(shard):
                return self.path(shard)
            fits = self.make_room(info.raw_bytes, reserve_for=shard, even_if_full=not ahead)
            if not fits and ahead:
                return None
            try:
                return self._download(shard, stop)
            except Exception as error:
                if ahead:
                    self._failed[shard] = error
                    return self.path(shard)
                raise
            finally:
                with self._done_lock:
                    self._reserved.pop(shard, None)

    def release(self, shard: int) -> None:
        """The reader is done with ``shard`` for now: it may be evicted (if over the limit)."""
        if self.cache_limit is None:
            return
        with self._done_lock:
            if shard in self._done:
                self._done.remove(shard)
            self._done.append(shard)
        self.make_room(0)

    def usage(self) -> int:
        """Bytes of complete shard files in the cache directory."""
        total = 0
        for info in self.shards:
            with contextlib.suppress(FileNotFoundError):
                total += (self.local / info.raw_name).stat().st_size
        return total

    def make_room(
        self, needed: int, *, reserve_for: int | None = None, even_if_full: bool = False
    ) -> bool:
        """Evict released shards until ``needed`` more bytes fit; returns whether they fit. With
        ``reserve_for`` they are kept for its download (when full too, ``even_if_full``)."""
        if self.cache_limit is None:
            return True
        with node_lock(self.local / LOCKS / "cache.lock", self.lock_timeout, "cache eviction"):
            used = self.usage()
            with self._done_lock:
                used += sum(self._reserved.values())
            while used + needed > self.cache_limit:
                with self._done_lock:
                    if not self._done:
                        break
                    victim = self._done.popleft()
                path = self.path(victim)
                with contextlib.suppress(FileNotFoundError):
                    size = path.stat().st_size
                    path.unlink()
                    used -= size
                    LOGGER.debug("evicted shard %s (%d bytes)", self.shards[victim].raw_name, size)
            fits = used + needed <= self.cache_limit
            if reserve_for is not None and (fits or even_if_full):
                with self._done_lock:
                    self._reserved[reserve_for] = needed
            return fits

    # -- downloading -------------------------------------------------------------------------

    def _download(self, shard: int, stop: threading.Event | None) -> Path | None:
        info = self.shards[shard]
        attempts = self.retries + 1
        last: BaseException | None = None
        corrupt = False
        for attempt in range(1, attempts + 1):
            stored = self.local / f".{info.raw_name}.{os.getpid()}.{threading.get_ident()}.part"
            raw = stored.with_suffix(".raw")
            try:
                self._fetch(info, stored, stop)
                self._unpack(info, stored, raw)
                os.replace(raw, self.path(shard))
                LOGGER.debug(
                    "downloaded shard %s (%d bytes) from %s by pid %d",
                    info.name,
                    info.bytes,
                    self.remote.url,
                    os.getpid(),
                )
                return self.path(shard)
            except _Stopped:
                return None
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"shard {info.name} listed in the index is missing from the remote "
                    f"({self.remote.where(info.name)})"
                ) from None
            except _Corrupt as error:
                last, corrupt = error, True
            except (OSError, TimeoutError, EOFError) as error:
                last, corrupt = error, False
            finally:
                for path in (stored, raw):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            if attempt < attempts:
                LOGGER.warning(
                    "shard %s from %s: %s; downloading again (attempt %d of %d)",
                    info.name,
                    self.remote.url,
                    last,
                    attempt + 1,
                    attempts,
                )
                if stop is not None and stop.wait(min(0.05 * 2**attempt, 1.0)):
                    return None
                if stop is None:
                    time.sleep(min(0.05 * 2**attempt, 1.0))
        where = self.remote.where(info.name)
        if corrupt:
            raise SourceDataError(
                f"shard {where} is corrupt: {last} (downloaded {attempts} times); the remote "
                f"copy does not match its index: {self.remedy}"
            ) from last
        raise DownloadError(
            f"cannot download shard {where} after {attempts} attempts: "
            f"{type(last).__name__}: {last} (download_retries={self.retries}, "
            f"download_timeout={self.timeout} s)"
        ) from last

    def _fetch(self, info: ShardInfo, target: Path, stop: threading.Event | None) -> None:
        deadline = time.monotonic() + self.timeout
        digest = hashlib.sha256()
        size = 0
        with self.remote.open(info.name) as source, open(target, "wb") as out:
            while chunk := source.read(_READ_SIZE):
                if stop is not None and stop.is_set():
                    raise _Stopped
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the download took more than {self.timeout} s")
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        if size != info.bytes or (info.sha256 and digest.hexdigest() != info.sha256):
            raise _Corrupt(
                f"got {size} bytes with sha256 {digest.hexdigest()[:16]}..., index.json says "
                f"{info.bytes} bytes with sha256 {info.sha256[:16]}..."
            )

    def _unpack(self, info: ShardInfo, stored: Path, raw: Path) -> None:
        if self.compression is None:
            os.replace(stored, raw)
        else:
            try:
                with open(stored, "rb") as source, open(raw, "wb") as out:
                    if self.compression == "gzip":
                        reader: Any = gzip.GzipFile(fileobj=source)
                    elif self.compression == "bz2":
                        reader = bz2.BZ2File(source)
                    else:
                        reader = zstd_module().ZstdDecompressor().stream_reader(source)
                    with reader:
                        shutil.copyfileobj(reader, out, _READ_SIZE)
            except ImportError:
                raise
            except Exception as error:
                raise _Corrupt(f"cannot decompress ({self.compression}): {error}") from error
        if not info.raw_sha256:  # a format whose index has no sha256: the size is checked
            size = raw.stat().st_size
            if size != info.raw_bytes:
                raise _Corrupt(
                    f"the uncompressed file has {size} bytes, the index says {info.raw_bytes}"
                )
            return
        digest = hashlib.sha256()
        with open(raw, "rb") as file:
            while chunk := file.read(_READ_SIZE):
                digest.update(chunk)
        if digest.hexdigest() != info.raw_sha256:
            raise _Corrupt(
                f"the uncompressed file has sha256 {digest.hexdigest()[:16]}..., index.json says "
                f"{info.raw_sha256[:16]}..."
            )


class ReaderProgress:
    """How far the reader is: its next step in this epoch (written by the reader thread)."""

    __slots__ = ("step",)

    def __init__(self, step: int) -> None:
        self.step = step


class Prefetcher(threading.Thread):
    """Downloads the shards of the reader's next ``window`` samples, in the order it needs them
    (``shard_at(step)``, ``steps`` in the epoch); failures are kept for the reader to raise."""

    def __init__(
        self,
        cache: ShardCache,
        shard_at: Callable[[int], int],
        steps: int,
        window: int,
        progress: ReaderProgress,
    ) -> None:
        super().__init__(name=f"energy_loader-shard-prefetch-{os.getpid()}", daemon=True)
        self.cache = cache
        self.shard_at = shard_at
        self.steps = steps
        self.window = window
        self.progress = progress
        self.stop_event = threading.Event()

    def run(self) -> None:
        ensured: set[int] = set()
        step = self.progress.step
        stop = self.stop_event
        while not stop.is_set() and step < self.steps:
            step = max(step, self.progress.step)
            if step >= min(self.steps, self.progress.step + self.window):
                stop.wait(0.01)
                continue
            shard = self.shard_at(step)
            if shard not in ensured:
                try:
                    path = self.cache.ensure(shard, ahead=True, stop=stop)
                except Exception:  # a lock timeout: the reader will meet it too
                    path = self.cache.path(shard)
                if path is None:
                    stop.wait(0.02)  # no room yet: the reader has to finish a shard first
                    continue
                ensured.add(shard)
            step += 1

    def stop(self) -> None:
        """Ask the thread to stop and wait briefly for it."""
        self.stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2.0)
