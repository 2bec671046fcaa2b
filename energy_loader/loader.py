"""SavableDataLoader and BasicDataLoader: the main-process side.

:class:`SavableDataLoader` is a ``torch.utils.data.DataLoader`` whose workers run a
:class:`~energy_loader.worker_process.WorkerSideDataset`. The main process records, per
(logical) worker, the index of the last item the user received, whether that worker ended the
current epoch, and which worker is due next. ``save_state_rank()`` asks every worker, over its
command channel, for its newest checkpoint not after that item; the command threads answer
while the workers compute, so saving never waits for a sample. ``restore_state_rank()`` hands
each worker its checkpoint and replay count and rotates the workers so the one that was due
next is first. With ``num_workers=0`` the pipeline runs in the main process and its state is
read directly (nothing to replay).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import multiprocessing
import re
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import dill
from torch.utils.data import DataLoader

from .dataset import SavableDataset, require_bool, require_int
from .errors import StateFormatError, StateMismatchError, WorkerError
from .state.fingerprint import ConfigDifference, config_differences, describe_differences
from .state.rank_state import RankState, WorkerState
from .transport import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_INLINE_BYTES,
    Transport,
    decode,
    validate_transport_settings,
)
from .worker import WorkerConfig, active_worker
from .worker_process import CheckpointSettings, WorkerSideDataset

__all__ = ["BasicDataLoader", "SavableDataLoader"]

_STATE_DICT_KEY = "rank_state_json"
_WORKER_IN_MESSAGE = re.compile(r"worker process (\d+)")
_PIDS_IN_MESSAGE = re.compile(r"\b(\d{2,})\b")


def _identity(item: Any) -> Any:
    return item


def _resolve_config(
    dataset: Any, worker_config: WorkerConfig | None, num_workers: Any
) -> WorkerConfig:
    if not isinstance(dataset, SavableDataset):
        raise TypeError(
            "the loader runs a SavableDataset pipeline (e.g. IndexedSource(...) wrapped in "
            f"MapDataset/BatchDataset); got {type(dataset).__name__}"
        )
    if worker_config is None:
        return WorkerConfig.from_env(num_workers=require_int(num_workers, "num_workers", minimum=0))
    if not isinstance(worker_config, WorkerConfig):
        raise TypeError(
            f"`worker_config` must be a WorkerConfig (got {type(worker_config).__name__})"
        )
    if num_workers not in (0, worker_config.num_workers):
        raise ValueError(
            f"num_workers={num_workers} disagrees with worker_config.num_workers="
            f"{worker_config.num_workers}; pass one of them"
        )
    return worker_config


def _check_serializable(pipeline: SavableDataset) -> None:
    """Fail now, naming the culprit, if spawn/forkserver could not ship the pipeline."""
    try:
        dill.dumps(pipeline, recurse=True)
        return
    except Exception as error:
        whole = error
    for dataset in pipeline.walk():
        for name, value in vars(dataset).items():
            if isinstance(value, SavableDataset) or name.startswith("_cursor"):
                continue
            try:
                dill.dumps(value, recurse=True)
            except Exception as error:
                raise TypeError(
                    f"{type(dataset).__name__}.{name} ({value!r}) cannot be serialized with dill "
                    f"for the spawn/forkserver start method: {error}. Use the fork start method "
                    "or make it serializable"
                ) from error
    raise TypeError(f"the pipeline cannot be serialized with dill: {whole}") from whole


class _Progress:
    """What the main process knows about each logical worker's stream."""

    def __init__(self, workers: int) -> None:
        self.last_index = [-1] * workers
        self.done = [False] * workers
        self.next_worker = 0
        self.epoch_ended = False
        self.in_epoch = False

    def start_epoch(self) -> None:
        self.done = [False] * len(self.done)
        self.epoch_ended = False
        self.next_worker = 0


class _LoaderIterator:
    """Wraps torch's iterator: strips numbering and end markers, records progress."""

    def __init__(self, loader: SavableDataLoader, inner: Iterator[Any], generation: int) -> None:
        self._loader = loader
        self._inner = inner
        self._generation = generation

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        if self._generation != loader._generation:
            raise RuntimeError(
                "this iterator belongs to a loader state that was since restored or reset; "
                "call iter(loader) again"
            )
        progress, workers = loader._progress, len(loader._progress.done)
        decoding = loader._transport is not None
        while True:
            try:
                with loader._main_process_context():
                    worker, index, is_end, sample = next(self._inner)
                if decoding and not is_end:
                    sample = decode(sample)
            except StopIteration:
                progress.in_epoch = False
                progress.epoch_ended = True
                progress.next_worker = 0
                raise
            except WorkerError:
                raise
            except Exception as error:
                if loader.num_workers == 0:
                    raise
                failure = loader._worker_error(error)
                loader._fail(failure)
                raise failure from error
            progress.last_index[worker] = index
            progress.next_worker = (worker + 1) % workers
            if is_end:
                progress.done[worker] = True
                continue
            return sample

    def __len__(self) -> int:
        return len(self._loader)


class SavableDataLoader(DataLoader):
    """A torch DataLoader over a savable pipeline that saves its exact position.

    Example::

        loader = SavableDataLoader(pipeline, num_workers=2)
        for step, batch in enumerate(loader):
            train_step(batch)
            if step % 500 == 0:
                torch.save({"model": model.state_dict(), "data": loader.state_dict()}, path)

        loader = SavableDataLoader(build_pipeline(), num_workers=2)
        loader.load_state_dict(torch.load(path, weights_only=True)["data"])

    Checkpoints. Each worker checkpoints its pipeline every ``checkpoint_every_n_samples``
    items (items are what the pipeline yields: batches, for a batched pipeline) and at most
    every ``checkpoint_every_sec`` seconds; a restore replays fewer than
    ``checkpoint_every_n_samples`` items per worker. ``n_checkpoints`` (default: enough for
    ``prefetch_factor * num_workers`` items in flight per worker) bounds the checkpoints each
    worker keeps; a value too small to cover the items in flight is a ``ValueError``.

    Epochs. ``iter(loader)`` continues the current epoch if it has not ended (also after a
    ``break``: nothing in flight is lost), otherwise starts the next. Workers are persistent.

    Transport. With workers and ``transport_codec=True`` (the default) each item crosses to
    the main process through :mod:`energy_loader.transport` instead of torch's per-tensor
    shared memory: pickled in one payload with its tensors and arrays out of band, inline
    below ``transport_inline_bytes`` and through a per-worker shared-memory arena of
    ``transport_arena_bytes`` (address space, touched only as needed) above. Decoded items
    equal the originals; tensors come back contiguous. ``transport_codec=False`` uses torch's
    transport.
    """

    _savable = True

    def __init__(
        self,
        dataset: SavableDataset,
        *,
        num_workers: int = 0,
        worker_config: WorkerConfig | None = None,
        prefetch_factor: int | None = 2,
        pin_memory: bool = False,
        checkpoint_every_n_samples: int = 16,
        checkpoint_every_sec: float | None = 1.0,
        n_checkpoints: int | None = None,
        gc_collect_every_n_steps: int | None = None,
        gc_freeze_at_start: bool = True,
        multiprocessing_context: str | Any = None,
        worker_reply_timeout: float = 60.0,
        transport_codec: bool = True,
        transport_inline_bytes: int = DEFAULT_INLINE_BYTES,
        transport_arena_bytes: int = DEFAULT_ARENA_BYTES,
    ) -> None:
        config = _resolve_config(dataset, worker_config, num_workers)
        workers = config.num_workers
        settings = _checkpoint_settings(
            workers,
            prefetch_factor,
            checkpoint_every_n_samples,
            checkpoint_every_sec,
            n_checkpoints,
            gc_collect_every_n_steps,
            gc_freeze_at_start,
        )
        if (
            isinstance(worker_reply_timeout, bool)
            or not isinstance(worker_reply_timeout, (int, float))
            or worker_reply_timeout <= 0
        ):
            raise ValueError(
                "`worker_reply_timeout` must be a positive number of seconds "
                f"(got {worker_reply_timeout!r})"
            )
        validate_transport_settings(transport_codec, transport_inline_bytes, transport_arena_bytes)
        self._transport = (
            Transport(transport_inline_bytes, transport_arena_bytes)
            if transport_codec and workers
            else None
        )
        self._mp_context = _resolve_mp_context(multiprocessing_context) if workers else None
        if self._mp_context is not None and self._mp_context.get_start_method() != "fork":
            _check_serializable(dataset)
        self._pipeline = dataset
        self._worker_config = config
        self._worker_side = WorkerSideDataset(dataset, config, settings, savable=self._savable)
        self._reply_timeout = float(worker_reply_timeout)
        self._progress = _Progress(max(1, workers))
        self._generation = 0
        self._failure: WorkerError | None = None
        self._request_ids = itertools.count()
        self._parent_channels: list[Connection] = []
        dataset.bind(config.context(0))
        self._config_cache = dataset.config()
        dataset.reset_state()
        super().__init__(
            self._worker_side,
            batch_size=None,
            num_workers=workers,
            collate_fn=_identity,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if workers else None,
            persistent_workers=workers > 0,
            multiprocessing_context=self._mp_context,
        )

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> _LoaderIterator:  # type: ignore[override]
        progress = self._progress
        # A break mid-epoch (torch would drop what is in flight) or a new epoch after a
        # restore that rotated the workers: restart the workers exactly where we stand.
        rotated = progress.epoch_ended and self._worker_side.offset != 0
        if self.num_workers > 0 and self._iterator is not None and (progress.in_epoch or rotated):
            self.restore_state_rank(self.save_state_rank())
        if progress.epoch_ended:
            progress.start_epoch()
        if self.num_workers > 0 and self._iterator is None:
            self._open_channels()
        progress.in_epoch = True
        return _LoaderIterator(self, super().__iter__(), self._generation)

    def __len__(self) -> int:
        """Items per epoch for this rank, when every stage's length is known."""
        pipeline, config = self._pipeline, self._worker_config
        total = 0
        try:
            for worker in range(max(1, config.num_workers)):
                pipeline.bind(config.context(worker))
                total += len(pipeline)  # type: ignore[arg-type]
        finally:
            pipeline.bind(config.context(0))
        return total

    def _main_process_context(self) -> Any:
        if self.num_workers == 0:
            return active_worker(self._worker_config.context(0))
        return _NULL_CONTEXT

    def _open_channels(self) -> None:
        context = self._mp_context or multiprocessing.get_context()
        pairs = [context.Pipe(duplex=True) for _ in range(self.num_workers)]
        self._parent_channels = [parent for parent, _ in pairs]
        self._worker_side.channels = [child for _, child in pairs]
        self._open_transport()

    def _open_transport(self) -> None:
        if self._transport is not None:
            self._worker_side.transport = self._transport.open(self.num_workers)

    def _shutdown_workers(self) -> None:
        if self._iterator is not None:
            self._iterator._shutdown_workers()  # type: ignore[attr-defined]
            self._iterator = None
        for channel in self._parent_channels:
            channel.close()
        self._parent_channels = []
        self._worker_side.channels = None
        if self._transport is not None:
            self._transport.close()
        self._worker_side.transport = None

    def _live_workers(self) -> list[Any]:
        iterator = self._iterator
        return list(getattr(iterator, "_workers", [])) if iterator is not None else []

    def _worker_error(self, error: BaseException) -> WorkerError:
        text = str(error)
        physical = None
        match = _WORKER_IN_MESSAGE.search(text)
        if match is not None:
            physical = int(match.group(1))
        else:  # "DataLoader worker (pid(s) 4771) exited unexpectedly": find it by pid
            pids = {int(p) for p in _PIDS_IN_MESSAGE.findall(text)}
            workers = self._live_workers()
            physical = next((i for i, w in enumerate(workers) if w.pid in pids), None)
        logical = None
        if physical is not None:
            logical = (physical + self._worker_side.offset) % self.num_workers
        who = f"worker {logical}" if logical is not None else "a worker"
        return WorkerError(
            f"{who} of the data loader failed: {type(error).__name__}: {text}",
            worker_id=logical,
            original_traceback=text,
        )

    # -- saving ----------------------------------------------------------------------------

    def _fail(self, failure: WorkerError) -> None:
        """Stop the workers now and refuse to save until a restore or reset.

        Stopping here, not when the loader is garbage collected, matters: the traceback keeps
        the loader alive in a reference cycle, and torch's shutdown from the cycle collector
        waits 5 s for each worker. Refusing to save matters more: the workers' positions died
        with them, and a fresh-looking state would silently restart the epoch.
        """
        self._failure = failure
        self._shutdown_workers()

    def save_state_rank(self) -> dict[str, Any]:
        """This rank's exact position as plain data (json-able, weights_only-loadable).

        Raises ``WorkerError`` after a worker failed, until ``restore_state_rank`` (from the
        last state saved before the failure) or ``reset_state``.
        """
        if self._failure is not None:
            raise WorkerError(
                f"cannot save: {self._failure} -- the position of this loader was lost with "
                "its workers; restore it from the last saved state (or reset_state())",
                worker_id=self._failure.worker_id,
                original_traceback=self._failure.original_traceback,
            )
        progress = self._progress
        workers = self._current_worker_states()
        state = RankState(
            rank=self._worker_config.rank,
            world_size=self._worker_config.world_size,
            num_workers=self.num_workers,
            config=self._config_cache,
            epoch_ended=progress.epoch_ended,
            next_worker=progress.next_worker,
            workers=tuple(workers),
        )
        return state.to_plain()

    def _current_worker_states(self) -> list[WorkerState]:
        progress, side = self._progress, self._worker_side
        count = max(1, self.num_workers)
        if self.num_workers == 0:
            runner = side._runner
            if runner is None or not runner.started:
                return [self._pending_state(0)]
            return [WorkerState(self._pipeline.save_state(), 0, progress.done[0])]
        if self._iterator is None:
            return [self._pending_state(w) for w in range(count)]
        request = next(self._request_ids)
        for logical in range(count):
            physical = (logical - side.offset) % count
            self._parent_channels[physical].send(
                ("get_checkpoint", request, progress.last_index[logical])
            )
        states = []
        for logical in range(count):
            physical = (logical - side.offset) % count
            checkpoint, skip = self._await_reply(physical, logical, request)
            states.append(WorkerState(checkpoint, skip, progress.done[logical]))
        return states

    def _pending_state(self, logical: int) -> WorkerState:
        """The state of a worker that has not started: its restore state, or fresh."""
        restore = self._worker_side.restore_for(logical)
        if restore is not None:
            return restore
        return WorkerState(self._fresh_checkpoint(), 0, False)

    def _fresh_checkpoint(self) -> dict[str, Any]:
        self._pipeline.reset_state()
        return self._pipeline.save_state()

    def _await_reply(self, physical: int, logical: int, request: int) -> Any:
        channel = self._parent_channels[physical]
        deadline = time.monotonic() + self._reply_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(
                    f"worker {logical} did not answer a checkpoint request within "
                    f"{self._reply_timeout:.0f} s (worker_reply_timeout)",
                    worker_id=logical,
                )
            if channel.poll(min(0.05, remaining)):
                try:
                    status, reply_id, payload = channel.recv()
                except (EOFError, OSError) as error:
                    raise WorkerError(
                        f"worker {logical} closed its command channel", worker_id=logical
                    ) from error
                if reply_id != request:
                    continue
                if status != "ok":
                    raise WorkerError(
                        f"worker {logical} failed to answer a checkpoint request:\n{payload}",
                        worker_id=logical,
                        original_traceback=payload,
                    )
                return payload
            workers = self._live_workers()
            if physical < len(workers) and not workers[physical].is_alive():
                raise WorkerError(
                    f"worker {logical} (pid {workers[physical].pid}) died with exit code "
                    f"{workers[physical].exitcode} before answering a checkpoint request",
                    worker_id=logical,
                )

    # -- restoring -------------------------------------------------------------------------

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        """Continue exactly from ``state`` at the next ``iter()``.

        Raises ``StateFormatError`` for something that is not a valid state and
        ``StateMismatchError`` for a state of another pipeline or layout; in both cases the
        loader is left as it was. Running workers are stopped and restarted.
        """
        decoded = RankState.from_plain(state)
        scale = self._check_compatible(decoded)
        # After a reported end every worker starts the next epoch, whatever it had flagged.
        workers = tuple(
            WorkerState(w.checkpoint, w.skip * scale, w.done and not decoded.epoch_ended)
            for w in decoded.workers
        )
        self._validate_checkpoints(workers)
        self._shutdown_workers()
        side, progress = self._worker_side, self._progress
        side.restores = workers
        side.offset = 0 if decoded.epoch_ended or self.num_workers == 0 else decoded.next_worker
        side.drop_runner()
        progress.last_index = [-1] * len(workers)
        progress.done = [w.done for w in workers]
        progress.next_worker = decoded.next_worker
        progress.epoch_ended = decoded.epoch_ended
        progress.in_epoch = not decoded.epoch_ended
        self._failure = None
        self._generation += 1

    def _check_compatible(self, state: RankState) -> int:
        """Raise ``StateMismatchError`` unless ``state`` fits; returns the replay scale."""
        config = self._worker_config
        layout = []
        for name, saved, now in (
            ("rank", state.rank, config.rank),
            ("world_size", state.world_size, config.world_size),
            ("num_workers", state.num_workers, self.num_workers),
        ):
            if saved != now:
                layout.append(f"{name}: saved {saved}, now {now}")
        if layout:
            raise StateMismatchError(
                "the state was saved with a different layout: " + "; ".join(layout)
            )
        differences = config_differences(state.config, self._config_cache)
        scale = _batch_size_scale(differences, self._config_cache)
        if scale is None:
            raise StateMismatchError(
                "the state belongs to a different pipeline: " + describe_differences(differences)
            )
        return scale

    def _validate_checkpoints(self, workers: tuple[WorkerState, ...]) -> None:
        """Decode every worker checkpoint in the main process so errors surface here."""
        pipeline, config = self._pipeline, self._worker_config
        runner = self._worker_side._runner
        current = (
            pipeline.save_state() if self.num_workers == 0 and runner and runner.started else None
        )
        try:
            for logical, worker in enumerate(workers):
                pipeline.bind(config.context(logical))
                try:
                    pipeline.restore_state(worker.checkpoint)
                except StateFormatError as error:
                    raise StateFormatError(f"workers[{logical}].checkpoint: {error}") from None
        finally:
            pipeline.reset_state()
            pipeline.bind(config.context(0))
            if current is not None:
                pipeline.restore_state(current)

    def reset_state(self) -> None:
        """Forget all progress: the next ``iter()`` starts epoch 0 from scratch."""
        self._shutdown_workers()
        self._worker_side.restores = None
        self._worker_side.offset = 0
        self._worker_side.drop_runner()
        self._progress = _Progress(max(1, self.num_workers))
        self._failure = None
        self._generation += 1

    # -- across ranks ------------------------------------------------------------------------

    @property
    def worker_config(self) -> WorkerConfig:
        """The rank/worker layout this loader runs with."""
        return self._worker_config

    def save_state_global(self, dst_rank: int = 0) -> list[dict[str, Any]] | None:
        """Gather every rank's state to ``dst_rank``: a list there, ``None`` elsewhere.

        A collective: every rank of the data-parallel group must call it.
        """
        from .distributed import save_state_global

        return save_state_global(self, dst_rank)

    def restore_state_global(
        self, states: list[dict[str, Any]] | None, *, src_rank: int | None = None
    ) -> None:
        """Restore every rank from the list of all ranks' states.

        Either every rank passes the full list (``src_rank=None``), or only ``src_rank``
        passes it and it is scattered. A collective over the data-parallel group in both forms
        when torch.distributed is initialised: a state that does not fit on any rank raises on
        every rank.
        """
        from .distributed import restore_state_global

        restore_state_global(self, states, src_rank=src_rank)

    # -- torch.distributed.checkpoint Stateful protocol --------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as ``{"rank_state_json": "<the state as JSON>"}``.

        ``torch.distributed.checkpoint`` stores a state dict leaf by leaf, deduplicates leaves
        that several ranks save under one key, and loads into the *shape* of a fresh loader's
        state, which a shuffle buffer's state does not keep. One string leaf avoids all three
        (and is ~5x smaller on disk). ``torch.save`` and ``json`` take it as is.
        """
        return {_STATE_DICT_KEY: json.dumps(self.save_state_rank(), separators=(",", ":"))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output (or a plain ``save_state_rank()`` state)."""
        if isinstance(state_dict, dict) and set(state_dict) == {_STATE_DICT_KEY}:
            text = state_dict[_STATE_DICT_KEY]
            if not isinstance(text, str):
                raise StateFormatError(
                    f"state_dict[{_STATE_DICT_KEY!r}] must be a JSON string, got "
                    f"{type(text).__name__}"
                )
            try:
                state_dict = json.loads(text)
            except json.JSONDecodeError as error:
                raise StateFormatError(
                    f"state_dict[{_STATE_DICT_KEY!r}] is not valid JSON (truncated?): {error}"
                ) from None
        self.restore_state_rank(state_dict)

    # -- the rest --------------------------------------------------------------------------

    def restore_sample(self, key: Any) -> Any:
        """Rebuild the sample (or batch) that carried ``key``."""
        from .dataset import attach_restore_key
        from .state.plain import to_key

        key = to_key(key)
        with active_worker(self._worker_config.context(0)):
            return attach_restore_key(self._pipeline.restore_sample(key), key)

    def config(self) -> dict[str, Any]:
        """The pipeline's configuration plus the loader's layout."""
        config = self._worker_config
        return {
            "pipeline": self._config_cache,
            "rank": config.rank,
            "world_size": config.world_size,
            "num_workers": self.num_workers,
            "seed": config.seed,
        }

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._shutdown_workers()


class BasicDataLoader(SavableDataLoader):
    """Runs a savable pipeline with the same sharding and seeding, but saves nothing.

    For evaluation: no numbering, no checkpoints, no command threads. ``save_state_rank``
    and the other state methods raise ``TypeError``.
    """

    _savable = False

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.num_workers == 0:
            return _basic_main_process(self)
        if self._iterator is None:
            self._open_transport()
        inner = DataLoader.__iter__(self)
        return inner if self._transport is None else map(decode, inner)

    def save_state_rank(self) -> dict[str, Any]:
        raise TypeError("BasicDataLoader does not save state; use SavableDataLoader")

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        raise TypeError("BasicDataLoader does not restore state; use SavableDataLoader")


def _basic_main_process(loader: BasicDataLoader) -> Iterator[Any]:
    inner = DataLoader.__iter__(loader)
    while True:
        with loader._main_process_context():
            try:
                sample = next(inner)
            except StopIteration:
                return
        yield sample


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_CONTEXT = _NullContext()


def _resolve_mp_context(value: Any) -> Any:
    if value is None:
        return multiprocessing.get_context()
    if isinstance(value, str):
        try:
            return multiprocessing.get_context(value)
        except ValueError:
            raise ValueError(
                f"`multiprocessing_context` must be 'fork', 'spawn' or 'forkserver' (got {value!r})"
            ) from None
    if hasattr(value, "get_start_method"):
        return value
    raise TypeError(
        "`multiprocessing_context` must be a start method name or a multiprocessing context "
        f"(got {type(value).__name__})"
    )


def _checkpoint_settings(
    workers: int,
    prefetch_factor: Any,
    every_n: Any,
    every_sec: Any,
    n_checkpoints: Any,
    gc_every_n: Any,
    gc_freeze: Any,
) -> CheckpointSettings:
    if workers:
        require_int(prefetch_factor, "prefetch_factor", minimum=1)
    elif prefetch_factor not in (None, 2):
        raise ValueError("`prefetch_factor` only applies with num_workers > 0")
    require_int(every_n, "checkpoint_every_n_samples", minimum=1)
    if every_sec is not None and (
        isinstance(every_sec, bool) or not isinstance(every_sec, (int, float)) or every_sec <= 0
    ):
        raise ValueError(
            "`checkpoint_every_sec` must be a positive number of seconds or None "
            f"(got {every_sec!r})"
        )
    if gc_every_n is not None:
        require_int(gc_every_n, "gc_collect_every_n_steps", minimum=1)
    require_bool(gc_freeze, "gc_freeze_at_start")
    # Items a worker may have made that the user has not received: torch keeps up to
    # prefetch_factor * num_workers tasks outstanding, all on one worker once the others have
    # ended their epoch; plus one for the pin-memory thread.
    in_flight = (prefetch_factor or 0) * workers + 1
    needed = math.ceil(in_flight / every_n) + 2
    if n_checkpoints is None:
        n_checkpoints = needed
    require_int(n_checkpoints, "n_checkpoints", minimum=1)
    if n_checkpoints < needed:
        raise ValueError(
            f"n_checkpoints={n_checkpoints} cannot cover the {in_flight} items that may be in "
            f"flight per worker (prefetch_factor={prefetch_factor} x num_workers={workers} + 1) "
            f"at checkpoint_every_n_samples={every_n}; use n_checkpoints >= {needed}"
        )
    return CheckpointSettings(
        every_n=every_n,
        every_sec=None if every_sec is None else float(every_sec),
        capacity=n_checkpoints,
        in_flight=in_flight,
        gc_every_n=gc_every_n,
        gc_freeze=gc_freeze,
    )


def _batch_size_scale(differences: list[ConfigDifference], config: dict[str, Any]) -> int | None:
    """1 when nothing differs; the saved/now batch-size ratio when only that differs.

    A smaller batch size that divides the saved one is accepted when the batch is the
    outermost stage that keeps state (only pass-through wrappers above it), so a replay of
    ``k`` saved batches is a replay of ``k * ratio`` new ones.
    """
    if not differences:
        return 1
    if len(differences) != 1:
        return None
    (difference,) = differences
    if not difference.field or difference.field[-1] != "batch_size":
        return None
    saved, now = difference.saved, difference.now
    if not (isinstance(saved, int) and isinstance(now, int)) or now <= 0 or saved % now:
        return None
    node = config
    for name in difference.field[:-1]:
        if node.get("type") not in _PASS_THROUGH_TYPES or name != "inner":
            return None
        node = node[name]
    if node.get("type") != "BatchDataset":
        return None
    return saved // now


_PASS_THROUGH_TYPES = ("MapDataset", "FilterDataset", "GcDataset")
