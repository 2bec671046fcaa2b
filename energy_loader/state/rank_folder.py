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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import StateMismatchError
from .rank_file import RankFile, ReadTally

__all__ = ["RankFolder", "rank_file_name", "rank_state_files", "whole_states"]

# The name save_state_rank_file gives a rank's file: PREFIX_rank_00003_of_00008.pt.
_RANK_FILE = re.compile(r"(.+)_rank_(\d{5})_of_(\d{5})\.pt")


def rank_file_name(prefix: str, rank: int, world_size: int) -> str:
    """``loader_rank_00003_of_00008`` (without ``.pt``): a rank's name in a save."""
    return f"{prefix}_rank_{rank:05d}_of_{world_size:05d}"


class RankFolder:
    """One restoring rank's view of a folder of per-rank state files (a context manager that
    closes every file it opened).

    ``rank``/``world_size`` are the restoring rank's; ``prefix=None`` takes the prefix the
    files have. ``files`` lists the save's files in rank order (checked complete) on first use.
    """

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
        self._opened: dict[int, RankFile] = {}
        self._stack = contextlib.ExitStack()

    @property
    def own_path(self) -> Path:
        """This rank's file if the save had this world size."""
        return self.directory / (rank_file_name(self.prefix, self.rank, self.world_size) + ".pt")

    def has_own(self) -> bool:
        """Whether this rank's file of its own world size is there (a save on this layout)."""
        return self.own_path.is_file()

    def open_own(self) -> RankFile:
        return self._open_path(-1, self.own_path)

    def witness_path(self) -> Path:
        """One other rank's file of a save on this world size (rank 0's; rank 1's for rank
        0), found by name (no listing): its header tells a file of another save."""
        other = 0 if self.rank else 1
        return self.directory / (rank_file_name(self.prefix, other, self.world_size) + ".pt")

    def open_witness(self) -> RankFile:
        return self._open_path(-2, self.witness_path())

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
        """Saved rank ``saved_rank``'s file, opened once."""
        return self._open_path(saved_rank, self.files[saved_rank])

    def _open_path(self, key: int, path: Path) -> RankFile:
        if key not in self._opened:
            self._opened[key] = self._stack.enter_context(RankFile(path, self.tally))
        return self._opened[key]

    def close(self) -> None:
        self._stack.close()
        self._opened.clear()

    def __enter__(self) -> RankFolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def whole_states(
    folder: RankFolder,
    *,
    decode: Callable[[RankFile], Any],
    needed: Callable[[Any], list[int]],
    check: Callable[[list[Any]], None] | None,
) -> list[Any]:
    """The whole states a rank restores from on another world size: the lowest saved rank's
    (the job's position) and those ``needed(lowest)`` names, in rank order.

    One more state of the save is read too (a witness: rank 0's, or rank 1's for rank 0);
    ``check`` (when given) sees them all together and raises ``StateMismatchError`` for states of
    different saves; its message is prefixed with the folder.
    """
    states = {0: decode(folder.open(0))}
    for rank in needed(states[0]):
        if rank not in states:
            states[rank] = decode(folder.open(rank))
    count = len(folder.files)
    witness = ((folder.rank % count) or 1) if count > 1 else None
    seen = dict(states)
    if witness is not None and witness not in seen:
        seen[witness] = decode(folder.open(witness))
    if check is not None:
        try:
            check([seen[r] for r in sorted(seen)])
        except StateMismatchError as error:
            raise StateMismatchError(f"{folder.directory}: {error}") from None
    return [states[r] for r in sorted(states)]


def rank_state_files(
    directory: str | os.PathLike[str], prefix: str | None = "loader"
) -> list[Path]:
    """The state files of one :func:`save_state_rank_file` save in ``directory``, in rank order.

    ``prefix=None`` takes whatever prefix the files were saved with (several prefixes are a
    ``ValueError`` naming them). ``directory`` that is not a folder, or holds no such files, is
    a ``FileNotFoundError`` naming the file names expected; files of several world sizes, or
    an incomplete set, a ``StateMismatchError``. Nothing is read but the file names.
    """
    folder = Path(directory)
    if not folder.is_dir():
        what = "a file" if folder.exists() else "not there"
        raise FileNotFoundError(f"{folder} is {what}, not a folder of per-rank state files")
    files = _rank_files(folder, prefix)
    if not files:
        expected = f"{prefix or 'PREFIX'}_rank_NNNNN_of_NNNNN.pt"
        others = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
        holds = (
            "it is empty"
            if not others
            else f"it holds {len(others)} other entr{'y' if len(others) == 1 else 'ies'} "
            f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
        )
        raise FileNotFoundError(
            f"{folder} is a folder without per-rank state files: expected files named "
            f"{expected} (e.g. {prefix or 'loader'}_rank_00000_of_00002.pt, what "
            f"save_state_rank_file writes), but {holds}"
        )
    return files


def _rank_files(directory: Path, prefix: str | None) -> list[Path]:
    """The state files of one save in ``directory``, in rank order (checked complete).

    ``prefix=None``: the files of whichever single prefix the directory holds.
    """
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
