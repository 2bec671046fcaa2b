"""Fingerprints of the files a source reads, so that a restore notices data rewritten in place
(other values, the same layout) and names the file that changed.

A file source records one string in its config under :data:`DATA_FIELD`: the kind, the number
of files, and for each of at most :data:`GROUPS` groups of consecutive files a digest of their
relative names, sizes and content with their total size (``"sampled 9/1 1f2e3d4c:4096 ..."``:
9 files, one a group); :func:`data_changes` names the first group that differs. A local file
counts whole up to ``BLOCK * BLOCKS`` bytes, else by ``BLOCKS`` evenly spread blocks of
``BLOCK`` (cached in the process by path, size, mtime_ns and inode); a remote one by its index's
size and hash. No absolute path or mtime enters. Made once per source (its first ``config()``).
What it sees and misses: docs/restores.md, "Data files that changed since the save". Not here:
the rest of the config (:mod:`.fingerprint`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from .fingerprint import DATA_FIELD, pipeline_stages

GROUPS = 64
BLOCK = 4096
BLOCKS = 16

# (path, size, mtime_ns, inode) -> sampled digest, for this process; cleared past the limit.
_SAMPLED: dict[tuple[str, int, int, int], bytes] = {}
_SAMPLED_LIMIT = 1_000_000
_SETTLED_NS = 2_000_000_000


@attrs.frozen
class FileEntry:
    """One file as the fingerprint counts it: its name relative to the dataset, its size and
    a digest of its content (sampled) or of what its index lists for it."""

    name: str
    size: int
    digest: bytes


def _sampled(read: Callable[[int, int], bytes], size: int) -> bytes:
    """The digest of ``size`` bytes read by ``read(length, offset)``, whole or in blocks."""
    digest = hashlib.blake2b(digest_size=8)
    if size <= BLOCK * BLOCKS:
        digest.update(read(size, 0))
    else:
        step = (size - BLOCK) / (BLOCKS - 1)
        for block in range(BLOCKS):
            digest.update(read(BLOCK, round(block * step)))
    return digest.digest()


def local_entry(root: str, name: str) -> FileEntry:
    """``root/name`` with its sampled content digest (cached by path, size, mtime, inode)."""
    path = os.path.join(root, name)
    stat = os.stat(path)
    key = (path, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    digest = _SAMPLED.get(key)
    if digest is None:
        fd = os.open(path, os.O_RDONLY)
        try:
            digest = _sampled(lambda length, offset: os.pread(fd, length, offset), stat.st_size)
        finally:
            os.close(fd)
        # Only a file settled for a while is cached: one written again within its clock's
        # tick keeps its mtime (git's "racily clean" rule).
        if time.time_ns() - stat.st_mtime_ns > _SETTLED_NS:
            if len(_SAMPLED) >= _SAMPLED_LIMIT:
                _SAMPLED.clear()
            _SAMPLED[key] = digest
    return FileEntry(name, stat.st_size, digest)


def content_entry(name: str, data: bytes) -> FileEntry:
    """A file whose bytes are at hand (an index read already), sampled as a local file is."""
    return FileEntry(name, len(data), _sampled(lambda n, at: data[at : at + n], len(data)))


def _listed_entry(name: str, size: int, listed: str) -> FileEntry:
    return FileEntry(name, size, hashlib.blake2b(listed.encode(), digest_size=8).digest())


def relative_names(paths: Sequence[str]) -> tuple[Path, list[str]]:
    """The folder holding local ``paths`` and each path's name relative to it."""
    root = Path(os.path.commonpath([os.path.dirname(path) for path in paths]))
    return root, [os.path.relpath(path, root) for path in paths]


@attrs.frozen
class DataFiles:
    """The files of one source, fingerprinted; :attr:`plain` is what its config records.

    ``kind``: ``"sampled"`` (local files, content read) or ``"listed"`` (a remote index's
    sizes and hashes); fingerprints of different kinds are not compared."""

    kind: str
    entries: tuple[FileEntry, ...]
    plain: str = attrs.field(init=False)

    @classmethod
    def local(
        cls, root: str | os.PathLike[str], names: Iterable[str], *index: FileEntry
    ) -> DataFiles:
        """The local files ``names`` under ``root``, their content sampled, then ``index``
        (the index read already: a changed file is named before its index)."""
        top = os.fspath(root)  # once: a Path made per file was most of a cold fingerprint's time
        return cls("sampled", (*(local_entry(top, name) for name in names), *index))

    @classmethod
    def listed(cls, files: Iterable[tuple[str, int, str]], *index: FileEntry) -> DataFiles:
        """Remote files as their index lists them, then ``index``: ``(name, size, hash)``,
        the hash a sha256 or an etag, ``""`` where none is listed (the size alone counts)."""
        return cls("listed", (*(_listed_entry(*file) for file in files), *index))

    @plain.default
    def _plain(self) -> str:
        per = self._per()
        groups = [self._group(start, per) for start in range(0, len(self.entries), per)]
        return f"{self.kind} {len(self.entries)}/{per} " + " ".join(groups)

    def _per(self) -> int:
        return max(1, -(-len(self.entries) // GROUPS))

    def _group(self, start: int, per: int) -> str:
        digest = hashlib.blake2b(digest_size=4)
        files = self.entries[start : start + per]
        for entry in files:
            digest.update(f"{entry.name}\0{entry.size}\0".encode() + entry.digest)
        return f"{digest.hexdigest()}:{sum(entry.size for entry in files)}"

    def first_change(self, saved: str) -> str | None:
        """What differs first between the fingerprint ``saved`` and these files, naming the
        file (or the range of files) and how (size or content); None if nothing differs or
        ``saved`` is of another kind (say, a local copy's, restored from the remote)."""
        if saved == self.plain:
            return None
        kind, count, *groups = saved.split(" ")
        if kind != self.kind:
            return None
        per, mine = self._per(), self.plain.split(" ")[2:]
        if count != f"{len(self.entries)}/{per}":
            return f"{count.split('/')[0]} files saved, {len(self.entries)} now"
        changed = [(i, o, n) for i, (o, n) in enumerate(zip(groups, mine)) if o != n]
        if not changed:
            return "its fingerprint differs"
        number, old, new = changed[0]
        files = self.entries[number * per : (number + 1) * per]
        what = "size" if len(files) == 1 else "total size"
        old_size, new_size = old.partition(":")[2], new.partition(":")[2]
        how = f"{what} saved {old_size} bytes, now {new_size}"
        if old_size == new_size:
            how = f"content changed (same {what}, {new_size} bytes)"
        where = files[0].name
        if len(files) > 1:
            where = f"one of the {len(files)} files {files[0].name} ... {files[-1].name}"
        return f"{where}: {how}"


def data_changes(saved: Any, now: Any, datasets: Iterable[Any]) -> list[str]:
    """``"<stage>: <first change>"`` for each source whose data files differ from those the saved
    config records (``datasets``: ``pipeline.walk()``, in ``now``'s order); nothing for a config
    saved without fingerprints."""
    before = {path: stage.get(DATA_FIELD) for path, stage in pipeline_stages(saved)}
    out = []
    for (path, stage), dataset in zip(pipeline_stages(now), datasets):
        old = before.get(path)
        if not isinstance(old, str) or DATA_FIELD not in stage or old == stage[DATA_FIELD]:
            continue
        try:
            change = dataset.data_files().first_change(old)
        except ValueError:  # not a fingerprint this release wrote
            change = "its fingerprint differs"
        if change is not None:
            out.append(f"{path}: {change}")
    return out
