"""A folder of per-rank state files, as one restoring rank reads it.

:func:`energy_loader.save_state_rank_file` writes ``PREFIX_rank_00003_of_00008.pt`` per rank
(:mod:`energy_loader.state.rank_file` is one file's format). A :class:`RankFolder` is what a
restoring rank knows of such a folder: the names of its files (listed once, checked
complete), its own file, and the files it opens, each opened once and closed together. The
engine decides which files and which bytes it needs (a pipeline reads the slots it runs, a
drop-in loader whole states); this module only names, lists and opens.

Not here: decoding and checking states (the engines), process groups (none are needed).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..errors import StateMismatchError
from .rank_file import RankFile, ReadTally

# The name save_state_rank_file gives a rank's file: PREFIX_rank_00003_of_00008.pt.
_RANK_FILE = re.compile(r"(.+)_rank_(\d{5})_of_(\d{5})\.pt")


def rank_file_name(prefix: str, rank: int, world_size: int) -> str:
    """``loader_rank_00003_of_00008`` (without ``.pt``): a rank's name in a save."""
    return f"{prefix}_rank_{rank:05d}_of_{world_size:05d}"


class RankFolder:
    """One restoring rank's view of a folder of per-rank state files; a context manager closing
    every file it opened. ``files``: the save's files in rank order, checked complete."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        prefix: str | None,
        rank: int,
        world_size: int,
        tally: ReadTally | None = None,
    ) -> None:
        self.directory = Path(directory)
        if prefix is None:
            match = _RANK_FILE.fullmatch(rank_state_files(self.directory, None)[0].name)
            prefix = match.group(1) if match else "loader"
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.tally = tally
        self._files: list[Path] | None = None
        self._opened: dict[Path, RankFile] = {}
        self._stack = contextlib.ExitStack()

    @property
    def own_path(self) -> Path:
        """This rank's file if the save had this world size."""
        return self.path_of(self.rank, self.world_size)

    def path_of(self, saved_rank: int, saved_world_size: int) -> Path:
        """Where saved rank ``saved_rank``'s file of a save on ``saved_world_size`` ranks is."""
        return self.directory / (rank_file_name(self.prefix, saved_rank, saved_world_size) + ".pt")

    def has_own(self) -> bool:
        """Whether this rank's file of its own world size is there (a save on this layout)."""
        return self.own_path.is_file()

    def open_own(self) -> RankFile:
        return self._open_path(self.own_path)

    def open_saved(self, saved_rank: int, saved_world_size: int) -> RankFile:
        """Saved rank ``saved_rank``'s file of a save on ``saved_world_size`` ranks, found by
        its name (no listing of the folder), opened once."""
        path = self.path_of(saved_rank, saved_world_size)
        if not path.is_file():
            return self.open(saved_rank)  # names the missing file, or the set's problem
        return self._open_path(path)

    def witness_rank(self, saved_world_size: int, read: Collection[int]) -> int | None:
        """The lowest rank not read, whose file a restore reading only one (``read``) checks besides
        so a stray file of another save is refused; None when two or more are read, or one rank
        saved."""
        if len(read) > 1:
            return None
        return next((r for r in range(saved_world_size) if r not in read), None)

    @property
    def files(self) -> list[Path]:
        """The save's files in rank order (``FileNotFoundError`` naming the expected names or
        this rank's file; ``StateMismatchError`` for an incomplete or mixed set)."""
        if self._files is None:
            files = _rank_files(self.directory, self.prefix)
            if not files:
                _raise_missing(self.own_path, self.prefix)
            self._files = files
        return self._files

    def open(self, saved_rank: int) -> RankFile:
        """Saved rank ``saved_rank``'s file, as the folder lists it, opened once."""
        return self._open_path(self.files[saved_rank])

    def _open_path(self, path: Path) -> RankFile:
        if path not in self._opened:
            self._opened[path] = self._stack.enter_context(RankFile(path, self.tally))
        return self._opened[path]

    def close(self) -> None:
        self._stack.close()
        self._opened.clear()

    def __enter__(self) -> RankFolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def rank_state_files(
    directory: str | os.PathLike[str], prefix: str | None = "loader"
) -> list[Path]:
    """The state files of one :func:`save_state_rank_file` save in ``directory``, in rank order.

    Reads only the file names. ``prefix=None`` takes the files' one prefix (several: a
    ``ValueError``); no folder or no files: ``FileNotFoundError`` naming the names expected; several
    world sizes or an incomplete set: ``StateMismatchError``.
    """
    folder = Path(directory)
    if not folder.is_dir():
        what = "a file" if folder.exists() else "not there"
        raise FileNotFoundError(f"{folder} is {what}, not a folder of per-rank state files")
    files = _rank_files(folder, prefix)
    if not files:
        expected = f"{prefix or 'PREFIX'}_rank_NNNNN_of_NNNNN.pt"
        others = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
        holds = "it is empty"
        if others:
            holds = f"it holds {len(others)} other entr{'y' if len(others) == 1 else 'ies'} "
            holds += f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
        raise FileNotFoundError(
            f"{folder} is a folder without per-rank state files: expected files named "
            f"{expected} (e.g. {prefix or 'loader'}_rank_00000_of_00002.pt, what "
            f"save_state_rank_file writes), but {holds}"
        )
    return files


def _rank_files(directory: Path, prefix: str | None) -> list[Path]:
    """The state files of one save in ``directory``, in rank order (checked complete);
    ``prefix=None``: whichever single prefix the directory holds."""
    found: dict[str, dict[int, dict[int, Path]]] = {}
    for candidate in directory.glob(f"{'*' if prefix is None else prefix}_rank_*_of_*.pt"):
        match = _RANK_FILE.fullmatch(candidate.name)
        if match and (prefix is None or match.group(1) == prefix):
            by_size = found.setdefault(match.group(1), {})
            by_size.setdefault(int(match.group(3)), {})[int(match.group(2))] = candidate
    if not found:
        return []
    if len(found) > 1:
        raise ValueError(
            f"{directory} holds the per-rank state files of several prefixes {sorted(found)}; "
            "name the prefix they were saved with"
        )
    (sizes,) = found.values()
    if len(sizes) > 1:
        raise StateMismatchError(
            f"{directory} holds state files of several world sizes {sorted(sizes)}, where one "
            "save writes files of one world size; keep the files of each save in a directory "
            "of their own"
        )
    ((size, files),) = sizes.items()
    missing = [r for r in range(size) if r not in files]
    if missing:
        raise StateMismatchError(
            f"{directory} holds state files of world size {size} but not those of ranks "
            f"{missing}: an incomplete save. Restore from a save whose every rank file is "
            "there (copy the missing files back, or restore an earlier save)"
        )
    return [files[r] for r in range(size)]


def _raise_missing(path: Path, prefix: str) -> None:
    others = sorted(p.name for p in path.parent.glob(f"{prefix}_rank_*_of_*.pt"))
    if others:
        raise StateMismatchError(
            f"{path.name} is not in {path.parent}, which holds {len(others)} state files of "
            f"another layout ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); "
            "restore with the data-parallel world size they were saved with"
        )
    raise FileNotFoundError(
        f"no loader state file {path.name} in {path.parent}; save_state_rank_file writes it"
    )
