"""Per-rank state files that a resized job reads partition by partition.

A ZIP archive of ``rank.json`` (the rank state without its config and partitions, with the
slots it holds and their sizes), ``partitions`` (stored: each partition's entry deflated on its
own) and ``config.json``, in that order, so that a rank restoring on another layout reads the
small header of each file it needs and the byte ranges of the partitions it now runs, not
whole files (layout: docs/state-format.md, "Per-rank state files"). A drop-in loader's state
goes whole into the header. ZIP's CRC-32 checks the header and config on every read, each
partition entry its own digest; a damaged file is a ``StateFormatError``, never a wrong state.
Nothing is unpickled; files are written atomically.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import StateFormatError
from .atomic import write_atomically
from .plain import StateReader, check_format, check_plain, json_leaf
from .rank_state import RANK_STATE_FORMAT, RankState, slot_key

RANK_FILE_FORMAT = "energy_loader.rank_file"
RANK_FILE_VERSION = 1

_HEADER = "rank.json"
_CONFIG = "config.json"
_PARTITIONS = "partitions"
# A fixed timestamp: the same state gives the same bytes.
_EPOCH = (1980, 1, 1, 0, 0, 0)
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
# A ZIP local file header (APPNOTE.TXT 4.3.7): signature, versions, flags, method, time, date,
# CRC-32, sizes, then the lengths of the name and the extra field that precede the data.
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIGNATURE = b"PK\x03\x04"
_CRC, _SIZE, _METHOD, _NAME_LENGTH, _EXTRA_LENGTH = 7, 8, 4, 10, 11


class ReadTally:
    """What reading rank files cost: the bytes taken from storage and the files opened (pass one to
    :func:`energy_loader.restore_state_rank_file` to measure a restore)."""

    __slots__ = ("bytes", "files")

    def __init__(self) -> None:
        self.bytes = 0
        self.files = 0

    def __repr__(self) -> str:
        return f"ReadTally(bytes={self.bytes}, files={self.files})"


class _CountingFile(io.RawIOBase):
    """An unbuffered file whose reads are added to a tally: every read is a system call, so
    the count is what came from storage, not what a buffer prefetched."""

    def __init__(self, path: Path, tally: ReadTally | None) -> None:
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self._tally = tally

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = self._file.readinto(buffer) or 0
        if self._tally is not None:
            self._tally.bytes += count
        return count

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
        super().close()


def write_rank_file(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write one rank's plain ``state`` (``save_state_rank()``'s) to ``path`` atomically; raises
    ``StateFormatError`` before touching the disk if it is not plain data."""
    if not isinstance(state, dict):
        raise TypeError(f"`state` must be a dict of plain data (got {type(state).__name__})")
    header: dict[str, Any] = {"format": RANK_FILE_FORMAT, "version": RANK_FILE_VERSION}
    members: list[tuple[str, bytes]] = []
    if state.get("format") == RANK_STATE_FORMAT:
        decoded = RankState.from_plain(state)  # checks that it is plain data, too
        config = _ENCODE(decoded.config).encode()
        # The rank state's own format tag and version go into the file's header, once.
        plain = decoded.to_plain(with_partitions=False)
        header["state_version"] = plain.pop("version")
        header["state"] = {k: v for k, v in plain.items() if k not in ("format", "config")}
        packed = [_deflate(_ENCODE(entry.to_plain()).encode()) for entry in decoded.partitions]
        header["slots"] = [decoded.slot_of(entry.partition) for entry in decoded.partitions]
        header["sizes"] = [len(data) for data in packed]
        members = [(_PARTITIONS, b"".join(packed)), (_CONFIG, config)]
    else:
        check_plain(state, "state")
        header["state"] = state
    members.insert(0, (_HEADER, _ENCODE(header).encode()))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members:
            info = zipfile.ZipInfo(name, _EPOCH)
            # The partitions are deflated one by one (to be read one by one), the rest whole.
            info.compress_type = zipfile.ZIP_STORED if name == _PARTITIONS else zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return write_atomically(path, buffer.getbuffer())


class RankFile:
    """One rank file, opened to read only what a restore needs (a context manager).

    ``header``: the state without config and partitions (a drop-in's whole state: ``split`` false);
    ``slots``: ``{key: (offset, length)}``. Members are found from the front by their local headers
    (docs/design.md) and every CRC is checked, so a partition costs its own bytes and a file laid
    out otherwise is a ``StateFormatError``.
    """

    def __init__(self, path: str | os.PathLike[str], tally: ReadTally | None = None) -> None:
        self.path = Path(path)
        if tally is not None:
            tally.files += 1
        self._source: _CountingFile | None = _CountingFile(self.path, tally)
        self._partitions_at = 0  # where the partitions' data starts: after rank.json's
        self._config_at = 0  # the offset of config.json's local header: after the partitions
        self.slots: dict[str, tuple[int, int]] = {}
        self.split = False
        self.config_check = ""
        self.header: dict[str, Any] = {}
        try:
            name, data, header_end = self._read_member(0, _HEADER)
            if name != _HEADER:
                raise self._fail(f"its first member is {name!r}, not {_HEADER}")
            self._parse_header(data, header_end)
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str) -> StateFormatError:
        return StateFormatError(
            f"{self.path} is not a readable rank state file (truncated, corrupted, or not "
            f"written by energy_loader): {what}"
        )

    def _read_range(self, offset: int, length: int) -> bytes:
        assert self._source is not None  # only called while open
        self._source.seek(offset)
        data = self._source.read(length) or b""
        if len(data) != length:
            raise self._fail(f"{length} bytes at offset {offset} expected, {len(data)} there")
        return data

    def _read_member(self, offset: int, expected: str) -> tuple[str, bytes, int]:
        """The name and data (read and CRC-checked only when the name is ``expected``) of the member
        whose local header is at ``offset``, and where the next member begins."""
        fields = _LOCAL_HEADER.unpack(self._read_range(offset, _LOCAL_HEADER.size))
        if fields[0] != _LOCAL_SIGNATURE:
            raise self._fail(f"no ZIP member at offset {offset}")
        start = offset + _LOCAL_HEADER.size
        name = self._read_range(start, fields[_NAME_LENGTH]).decode("utf-8", "replace")
        if name != expected:
            return name, b"", -1
        method = fields[_METHOD]
        if method not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or fields[_EXTRA_LENGTH]:
            raise self._fail(f"member {name} has compression method {method} or extra fields")
        data_start = start + fields[_NAME_LENGTH]
        data = self._read_range(data_start, fields[_SIZE])
        if method == zipfile.ZIP_DEFLATED:
            data = _inflate(data, self._where(name))
        if zlib.crc32(data) != fields[_CRC]:
            raise StateFormatError(
                f"{self._where(name)} is damaged (the file was changed after writing): its "
                "CRC-32 does not match"
            )
        return name, data, data_start + fields[_SIZE]

    def _parse_header(self, data: bytes, end: int) -> None:
        where = self._where(_HEADER)
        record = json_leaf(data.decode("utf-8", "replace"), where)
        reader = StateReader(record, where)
        check_format(reader, RANK_FILE_FORMAT, RANK_FILE_VERSION, "rank state file")
        self.header = _dict(reader.raw("state"), f"{where}.state")
        self.split = reader.has("slots")
        if not self.split:
            return
        version = reader.int("state_version")
        self.header = {"format": RANK_STATE_FORMAT, "version": version, **self.header}
        checks = StateReader(self.header, f"{where}.state").sub("checks")
        self.config_check = checks.str("config")
        self._partitions_at = end + _LOCAL_HEADER.size + len(_PARTITIONS)
        slots, sizes = reader.list("slots"), reader.list("sizes")
        if len(slots) != len(sizes) or not all(
            isinstance(n, int) and n >= 0 for n in (*slots, *sizes)
        ):
            raise StateFormatError(
                f"{where}: 'slots' and 'sizes' must be lists of as many non-negative integers"
            )
        offset = 0
        for slot, size in zip(slots, sizes):
            self.slots[slot_key(slot)] = (offset, size)
            offset += size
        self._config_at = self._partitions_at + offset

    def _where(self, name: str) -> str:
        return f"{self.path}:{name}"

    def config(self) -> dict[str, Any]:
        """The pipeline config, read from this file (checked against ``config_check`` when
        the state is decoded)."""
        if not self.split:
            return _dict(StateReader(self.header, str(self.path)).raw("config"), "config")
        name, data, _ = self._read_member(self._config_at, _CONFIG)
        if name != _CONFIG:
            raise self._fail(f"{name!r} where {_CONFIG} was expected")
        where = self._where(_CONFIG)
        return _dict(json_leaf(data.decode("utf-8", "replace"), where), where)

    def partitions(self, keys: Iterable[str]) -> dict[str, Any]:
        """The partition entries of the slots ``keys``, each read by its byte range."""
        if not self.split:
            raise ValueError(f"{self.path} holds a whole state, not partitions by slot")
        out = {}
        for key in keys:
            if key not in self.slots:
                raise KeyError(f"{self.path} holds no {key!r} (it holds {sorted(self.slots)})")
            offset, length = self.slots[key]
            data = _inflate(self._read_range(self._partitions_at + offset, length), key)
            try:
                out[key] = json_leaf(data.decode("utf-8", "replace"), self._where(key))
            except StateFormatError as error:
                raise StateFormatError(
                    f"{error}: its bytes are damaged (the file was changed after writing)"
                ) from None
        return out

    def state(self) -> dict[str, Any]:
        """The whole plain state, as ``save_state_rank()`` returned it."""
        if not self.split:
            return self.header
        config = self.config()
        by_offset = sorted(self.slots, key=lambda key: self.slots[key][0])
        entries = self.partitions(by_offset)
        return {**self.header, "config": config, "partitions": [entries[k] for k in by_offset]}

    def close(self) -> None:
        """Close the file (the attributes read so far stay readable)."""
        if self._source is not None:
            self._source.close()
            self._source = None

    def __enter__(self) -> RankFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _deflate(data: bytes) -> bytes:
    """``data`` compressed with raw DEFLATE (no zlib header: ZIP's own method)."""
    packer = zlib.compressobj(6, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


def _inflate(data: bytes, where: str) -> bytes:
    try:
        return zlib.decompress(data, -15)
    except zlib.error as error:
        raise StateFormatError(
            f"{where} is damaged (the file was changed after writing): {error}"
        ) from None


def _dict(value: Any, path: str) -> dict[str, Any]:
    StateReader(value, path)  # a StateFormatError naming ``path`` unless a dict
    return dict(value)


def is_rank_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a rank state file of this format (a ZIP holding ``rank.json``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return _HEADER in archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def read_rank_file(path: str | os.PathLike[str], tally: ReadTally | None = None) -> dict[str, Any]:
    """The whole plain state in a rank file (what ``inspect`` prints)."""
    with RankFile(path, tally) as file:
        return file.state()
