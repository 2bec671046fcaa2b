"""Checkpoint files: atomic writes, checksums, the last ``keep`` files, safe loading.

A checkpoint file is a ``torch.save`` of a plain dict::

    {"format": "energy_loader.checkpoint", "version": 1,
     "sha256": "<hex digest of the canonical JSON of payload>", "payload": <plain data>}

Writing goes to a temporary file in the same directory, which is flushed and fsync'ed, renamed
over the target (atomic on POSIX) and followed by an fsync of the directory, so a crash at any
moment leaves either the old file or the new one, never a torn one. Loading uses
``torch.load(weights_only=True)``: a file that smuggles a pickled object is refused, not run.
The checksum catches files damaged after the fact (a truncated copy, a flipped byte).

:class:`CheckpointDirectory` numbers files by training step, keeps the newest ``keep``, and
``load_latest()`` skips (and reports) damaged ones, falling back to the previous good file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import StateFormatError, first_line
from .atomic import write_atomically
from .plain import StateReader, check_format, check_plain

CHECKPOINT_FORMAT = "energy_loader.checkpoint"
CHECKPOINT_VERSION = 1

_LOGGER = logging.getLogger("energy_loader.checkpoint")


def _digest(payload: Any) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def save_checkpoint(path: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plain data, e.g. a loader state) to ``path`` atomically.

    Raises ``StateFormatError`` before touching the disk if ``payload`` is not plain data; on an I/O
    error the temporary file is removed and an existing ``path`` is left as it was.
    """
    target = Path(path)
    if not isinstance(payload, dict):
        raise TypeError(f"`payload` must be a dict of plain data (got {type(payload).__name__})")
    check_plain(payload, "payload")
    record = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "sha256": _digest(payload),
        "payload": payload,
    }
    # Serialise in memory first (states are small), so that a failing disk surfaces as the
    # OSError it is (ENOSPC, EFBIG, EIO) rather than as an error inside torch's zip writer.
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return write_atomically(target, buffer.getbuffer())


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a file written by :func:`save_checkpoint`; returns the payload. Raises
    ``FileNotFoundError`` if missing, ``StateFormatError`` if not an intact checkpoint."""
    source = Path(path)
    try:
        record = torch.load(source, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise
    except Exception as error:
        raise StateFormatError(
            f"{source} is not a readable checkpoint file (truncated, corrupted, or not written "
            f"by energy_loader): {first_line(error) or type(error).__name__}"
        ) from error
    reader = StateReader(record, str(source))
    check_format(reader, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, "checkpoint file")
    payload = reader.raw("payload")
    try:
        actual = _digest(payload)
    except (TypeError, ValueError) as error:
        raise StateFormatError(f"{source}: the payload is not plain data ({error})") from error
    if actual != reader.str("sha256"):
        raise StateFormatError(f"{source}: checksum mismatch, the file was damaged after writing")
    return payload


class CheckpointDirectory:
    """Numbered checkpoint files in one directory: ``{prefix}-{step:012d}.pt``.

    Example::

        checkpoints = CheckpointDirectory("runs/42/loader", keep=3)
        checkpoints.save({"step": step, "loader": loader.state_dict()}, step=step)
        ...
        found = checkpoints.load_latest()      # (step, payload) or None
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int = 3, prefix: str = "checkpoint"
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"`keep` must be a positive integer (got {keep!r})")
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise ValueError(f"`prefix` must be a plain file-name prefix (got {prefix!r})")
        self.directory = Path(directory)
        self.keep = keep
        self.prefix = prefix
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.pt")

    def path_for(self, step: int) -> Path:
        """The file name for ``step``."""
        return self.directory / f"{self.prefix}-{step:012d}.pt"

    def steps(self) -> list[int]:
        """The steps that have a file, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (self._pattern.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, payload: dict[str, Any], *, step: int) -> Path:
        """Write the checkpoint of ``step`` atomically, then drop all but the newest ``keep``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"`step` must be a non-negative integer (got {step!r})")
        path = save_checkpoint(self.path_for(step), payload)
        for old in self.steps()[: -self.keep]:
            with contextlib.suppress(FileNotFoundError):
                self.path_for(old).unlink()
        # Temporary files of writers that were killed mid-write (one writer per directory).
        for stale in self.directory.glob(f".{self.prefix}-*.pt.*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        return path

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest intact checkpoint as ``(step, payload)``, or ``None``; damaged ones are
        skipped with a warning on the ``energy_loader.checkpoint`` logger."""
        for step in reversed(self.steps()):
            try:
                return step, load_checkpoint(self.path_for(step))
            except (StateFormatError, FileNotFoundError) as error:
                _LOGGER.warning("skipping damaged checkpoint: %s", error)
        return None
