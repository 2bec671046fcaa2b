"""The exception hierarchy.

Every error the library raises on purpose derives from :class:`EnergyLoaderError` (argument
errors also from ``ValueError``/``TypeError``); saved-state and worker errors have classes of
their own because callers handle "wrong pipeline", "not a state" and "the pipeline crashed"
differently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .worker import WorkerConfig

__all__ = [
    "CodeChangedWarning",
    "DataChangedWarning",
    "DownloadError",
    "EnergyLoaderError",
    "SourceDataError",
    "StreamError",
    "StateFormatError",
    "StateMismatchError",
    "WorkerError",
    "WorkerStateMismatchError",
    "first_line",
    "missing_slots_error",
]


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message ("" if it has none): what a one-line report of
    it (a command's exit message, a wrapping error) shows."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


class EnergyLoaderError(Exception):
    """Base class of every error raised by energy_loader on purpose."""


class StateFormatError(EnergyLoaderError, ValueError):
    """The object given as a saved state is not one: wrong type, truncated, unknown version.

    The message names the path inside the state (``workers[1].checkpoint.pos``) and what was
    expected there.
    """


class StateMismatchError(EnergyLoaderError, ValueError):
    """The saved state is well formed but belongs to a different pipeline or layout.

    Raised when configuration, world size, rank or worker count differ from the saving run's,
    or the restore does not re-make what it handed out. The message names where, what was
    saved and what is found now (``path: saved X, now Y``), and what to do.
    """


class WorkerError(EnergyLoaderError, RuntimeError):
    """A worker process failed: it raised, was killed, or stopped answering.

    ``worker_id`` names the worker (``None`` when torch did not say which one) and
    ``original_traceback`` carries the worker's formatted traceback when there is one.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int | None = None,
        original_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.original_traceback = original_traceback


class WorkerStateMismatchError(WorkerError, StateMismatchError):
    """A worker found that the state it restored does not continue the saved stream: the
    items it replayed from a partition's checkpoint are not the ones the saving loader
    handed out. Both a :class:`WorkerError` (it happened in a worker process, whose
    traceback it carries) and a :class:`StateMismatchError` (what it means)."""


class SourceDataError(EnergyLoaderError, ValueError):
    """The data a source reads is inconsistent: bad metadata or index, wrong sample counts,
    a chunk or shard that does not decode, a shard whose hash stays wrong after re-downloads.

    The message names the file or shard and what would fix it. A missing file is a plain
    ``FileNotFoundError`` with the same kind of message.
    """


class DownloadError(EnergyLoaderError, OSError):
    """A shard or index could not be fetched from the remote (after the configured retries
    and within the configured timeout), or the node's download lock could not be taken.
    """


class StreamError(EnergyLoaderError, RuntimeError):
    """A stream source's ``fetch_fn`` or ``is_exhausted`` raised or returned something
    invalid, or no batch arrived within ``fetch_timeout``.
    """


class CodeChangedWarning(UserWarning):
    """A restore continues with user code (a map function, a filter's predicate, a
    ``collate_fn``, ...) that differs from the code that saved the state: a fixed bug, most
    often. The loader continues (``on_code_change="warn"``, the default) and says which
    function changed; items made from here on may differ from what the saving run would have
    made. ``on_code_change="refuse"`` raises a :class:`StateMismatchError` instead."""


class DataChangedWarning(UserWarning):
    """A restore continues over data files that differ from those that saved the state: a
    file rewritten in place, its layout unchanged. With ``on_data_change="warn"`` (the default)
    the loader continues at the saved position in the new data, naming source and file;
    ``"refuse"`` raises :class:`StateMismatchError`. A changed layout is refused either way."""


def missing_slots_error(
    config: WorkerConfig, missing: list[str], saved_partitions: int, where: str
) -> StateMismatchError:
    """The refusal for slots a rank runs that the saved leaves or files lack (``where``
    completes the sentence: what lacks them, and what to do)."""
    return StateMismatchError(
        f"rank {config.rank} of world_size={config.world_size} runs slots "
        f"{missing[:4]}{' ...' if len(missing) > 4 else ''} of the saved "
        f"num_partitions={saved_partitions}, which {where}"
    )
