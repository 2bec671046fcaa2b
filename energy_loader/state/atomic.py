"""Atomic file writes: a crash at any instant leaves the old file or the new one, never a mix.

The data goes to a temporary file in the target's directory, which is flushed and fsync'ed,
renamed over the target (atomic on POSIX file systems) and followed by an fsync of the
directory so the rename itself is durable. On any error the temporary file is removed and an
existing target is untouched.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make the renames and new entries in ``directory`` durable (POSIX: fsync the directory), e.g.
    after renaming a whole directory into place."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(
    path: str | os.PathLike[str],
    write: bytes | bytearray | memoryview | Callable[[BinaryIO], object],
) -> Path:
    """Write ``write`` (bytes-like, or a function that writes to a binary file) to ``path``.

    Temporary files are named ``.{name}.*.tmp`` next to the target. Example::

        write_atomically(path, lambda f: torch.save({"model": model.state_dict()}, f))
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as stream:
            if isinstance(write, (bytes, bytearray, memoryview)):
                stream.write(write)
            else:
                write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    fsync_directory(target.parent)
    return target
