"""The member index of a WebDataset tar shard (``<shard>.idx.json``): per sample its key and per
member ``[extension, header offset, data offset, size]``. See docs/sources/webdataset.md.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
from typing import Any, BinaryIO

from ..errors import SourceDataError
from ._download import parse_json

INDEX_SUFFIX = ".idx.json"
FORMAT = "energy_loader.tar_index"
VERSION = 1
_BLOCK = 512
_READ_SIZE = 1 << 20
_NAME = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


class _CountingReader:
    """A read-only file wrapper that hashes and counts what passes through it and remembers
    where the last non-zero byte was (to tell end-of-archive padding from damage)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.digest = hashlib.sha256()
        self.size = 0
        self.last_nonzero = -1

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        if data:
            self.digest.update(data)
            stripped = len(data.rstrip(b"\0"))
            if stripped:
                self.last_nonzero = self.size + stripped - 1
            self.size += len(data)
        return data


def build_index(file: BinaryIO, name: str, where: str) -> dict[str, Any]:
    """Scan one tar shard (a binary file object, read sequentially) into its index; ``name`` is
    recorded, ``where`` names it in errors. :class:`SourceDataError` for a damaged tar."""
    reader = _CountingReader(file)
    keys: list[str] = []
    members: list[list[Any]] = []
    end = 0
    try:
        with tarfile.open(fileobj=reader, mode="r|") as archive:  # type: ignore[call-overload]
            for info in archive:
                end = info.offset_data + -(-info.size // _BLOCK) * _BLOCK
                if not info.isfile():
                    continue
                named = _NAME.match(info.name)  # (key, extension)
                if named is None:
                    continue  # like WebDataset: files without an extension belong to no sample
                key, extension = named.groups()
                if not keys or keys[-1] != key:
                    keys.append(key)
                    members.append([])
                members[-1] += [extension, info.offset, info.offset_data, info.size]
        while reader.read(_READ_SIZE):  # the rest: end-of-archive padding, or damage
            pass
    except (tarfile.TarError, EOFError) as error:
        raise SourceDataError(
            f"{where} is not a readable tar file ({error}) after {len(keys)} samples (last "
            f"key {keys[-1] if keys else None!r}): it is truncated or damaged"
        ) from None
    if reader.last_nonzero >= end or reader.size % _BLOCK:
        raise SourceDataError(
            f"{where} is truncated or damaged: {reader.size} bytes, with data after the end of "
            f"its last complete member (byte {end}, after {len(keys)} samples, last key "
            f"{keys[-1] if keys else None!r})"
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "shard": name,
        "bytes": reader.size,
        "sha256": reader.digest.hexdigest(),
        "samples": len(keys),
        "keys": keys,
        "members": members,
    }


class TarIndex:
    """A parsed, validated index: per sample its key and members (see the module doc)."""

    __slots__ = ("bytes", "keys", "members", "samples", "sha256", "shard")

    def __init__(self, data: dict[str, Any]) -> None:
        self.shard: str = data["shard"]
        self.bytes: int = data["bytes"]
        self.sha256: str = data["sha256"]
        self.samples: int = data["samples"]
        self.keys: list[str] = data["keys"]
        self.members: list[list[Any]] = data["members"]

    def span(self, row: int) -> tuple[int, int]:
        """The byte range ``[start, stop)`` holding sample ``row``'s headers and data."""
        members = self.members[row]
        return members[1], members[-2] + members[-1]


def parse_index(data: bytes, where: str) -> TarIndex:
    """Parse and validate an index file's bytes (errors name ``where``)."""
    index = parse_json(data, where)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise SourceDataError(f"{where} is not a tar member index (no format {FORMAT!r})")
    if index.get("version") != VERSION:
        raise SourceDataError(
            f"{where} has version {index.get('version')!r}; this release reads {VERSION}: "
            "rebuild it with python -m energy_loader index"
        )
    keys, members = index.get("keys"), index.get("members")
    samples = index.get("samples")
    if (
        not isinstance(keys, list)
        or not isinstance(members, list)
        or not isinstance(samples, int)
        or not len(keys) == len(members) == samples
        or not isinstance(index.get("bytes"), int)
        or not isinstance(index.get("sha256"), str)
        or not isinstance(index.get("shard"), str)
        or any(not isinstance(entry, list) or not entry or len(entry) % 4 for entry in members)
    ):
        raise SourceDataError(
            f"{where} is damaged (keys, members, samples, bytes, sha256 do not agree): "
            "rebuild it with python -m energy_loader index"
        )
    return TarIndex(index)


def check_header(block: bytes, expected: str, where: str) -> None:
    """Raise :class:`SourceDataError` (naming ``where``, the sample) unless ``block`` is the tar
    header of member ``expected``."""
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as error:
        raise SourceDataError(
            f"{where}: no valid tar header where the index has member {expected!r} ({error}); "
            "the shard changed since it was indexed: rebuild the index with python -m "
            "energy_loader index"
        ) from None
    if info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE, tarfile.XGLTYPE):
        return  # the real name is in the extended header; the checksum matched
    if info.name != expected:
        raise SourceDataError(
            f"{where}: member {expected!r} is missing (the tar holds {info.name!r} there); the "
            "shard changed since it was indexed: rebuild the index with python -m energy_loader "
            "index"
        )
