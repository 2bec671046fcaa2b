"""The savable dataset protocol: recipes, epoch cursors, restore keys.

A :class:`SavableDataset` is a *recipe*: it describes a pipeline step and holds no progress
of its own beyond one live :class:`EpochCursor`, created on first use, that records where the
iteration stands (epoch, phase, position, buffers). ``save_state()`` reads the cursor,
``restore_state()`` replaces it, ``reset_state()`` drops it.

Samples travel between pipeline steps as ``(restore_key, sample)`` pairs (see
:meth:`SavableDataset.iter_keyed`) so that every sample, whatever its type, has a key; only the
outermost dataset attaches the key to the sample it hands out (:func:`attach_restore_key`).

Epochs. A cursor is *fresh* (never iterated), *running* (inside an epoch) or *ended* (its
iterator reported the end). Iterating a fresh cursor starts epoch 0, a running one continues
where it stands, an ended one starts the next epoch. A state saved after the last sample but
before the end was reported is *running* with nothing left: the first iteration after a restore
ends at once and the next starts the next epoch.

Thread-safety: a dataset and its cursor are used by one thread at a time (the thread that
iterates it). The loader takes worker checkpoints from that thread, between samples.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch.utils.data import IterableDataset

from .errors import StateFormatError
from .rng import seed_globals_for_sample, stable_hash
from .state.code_fingerprint import code_fingerprint
from .state.digests import RESTORE_KEY
from .state.fingerprint import CODE_SUFFIX
from .state.plain import StateReader
from .worker import WorkerContext, current_worker

__all__ = [
    "RESTORE_KEY",
    "BaseWrapperDataset",
    "EpochCursor",
    "Key",
    "SavableDataset",
    "SavableProtocol",
    "attach_restore_key",
    "callable_name",
    "code_fingerprint",
    "restore_key_of",
    "user_fn_fields",
]

Key = tuple[Any, ...]

FRESH, RUNNING, ENDED = "fresh", "running", "ended"
PHASES = (FRESH, RUNNING, ENDED)


@runtime_checkable
class SavableProtocol(Protocol):
    """What the loader needs of a pipeline: iterate, save, restore, describe."""

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]: ...
    def save_state(self) -> dict[str, Any]: ...
    def restore_state(self, state: dict[str, Any]) -> None: ...
    def reset_state(self) -> None: ...
    def config(self) -> dict[str, Any]: ...
    def restore_sample(self, key: Key) -> Any: ...


def is_stateful(value: Any) -> bool:
    """Whether ``value`` has torch's ``Stateful`` ``state_dict()`` and ``load_state_dict()``."""
    methods = (getattr(value, name, None) for name in ("state_dict", "load_state_dict"))
    return all(callable(method) for method in methods)


# Types whose instances take no attribute: a sample of one carries no restore key (asked
# first: a refused setattr or getattr raises and catches, ~1.5 us a batch of light samples).
_UNKEYED = frozenset({list, tuple, int, float, str, bytes, bool, type(None)})


def attach_restore_key(sample: Any, key: Key) -> Any:
    """Return ``sample`` carrying ``key``: as a dict entry, an attribute, or not at all.

    Dicts are copied (shallowly) so a source that hands out stored dicts is never modified.
    Samples that accept no attribute (ints, tuples, numpy arrays) are returned unchanged.
    """
    kind = type(sample)
    if kind is dict:
        out = dict(sample)
        out[RESTORE_KEY] = key
        return out
    if kind in _UNKEYED:
        return sample
    if isinstance(sample, dict):
        out = copy.copy(sample)
        out[RESTORE_KEY] = key
        return out
    with contextlib.suppress(AttributeError, TypeError):
        setattr(sample, RESTORE_KEY, key)
    return sample


def restore_key_of(sample: Any) -> Key | None:
    """The restore key a sample carries, or ``None``."""
    if type(sample) in _UNKEYED:
        return None
    if isinstance(sample, dict):
        return sample.get(RESTORE_KEY)
    return getattr(sample, RESTORE_KEY, None)


def callable_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function or callable object, for configs and messages."""
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__qualname__', repr(target))}"


def user_fn_fields(name: str, fn: Callable[..., Any] | None) -> dict[str, Any]:
    """A user function's entries in a ``config()``: ``{name: "module.qualname",
    name + "_code": <code_fingerprint>}`` (``{name: None}`` without one). A restore compares
    the names as config and the ``*_code`` fields apart: code that changed is reported, not
    taken for another pipeline (:mod:`energy_loader.state.fingerprint`)."""
    if fn is None:
        return {name: None}
    return {name: callable_name(fn), name + CODE_SUFFIX: code_fingerprint(fn)}


def apply_user_fn(
    fn: Callable[[Any], Any],
    sample: Any,
    key: Key,
    *,
    owner: SavableDataset,
    seeded: bool,
    scope: SavableDataset | None = None,
) -> Any:
    """Run a user function on one sample, the way every wrapper that runs user code does.

    With ``seeded`` the global RNGs are first seeded from (pipeline seed, ``scope``'s stream salt,
    ``key``); ``scope`` defaults to ``owner`` (:meth:`SavableDataset.share_sample_seeding`). An
    exception gets a note naming the function, the owner and the restore key.
    """
    if seeded:
        scope = owner if scope is None else scope
        seed_globals_for_sample(scope.context.seed, scope.stream_salt(), key)
    try:
        return fn(sample)
    except Exception as error:
        error.add_note(
            f"raised by {callable_name(fn)} in {type(owner).__name__} for restore key {key!r}"
        )
        raise


class EpochCursor(ABC):
    """Where one dataset's iteration stands, across epochs. Subclasses add their fields.

    ``run()`` is the one place that moves between phases; subclasses implement
    ``begin_epoch()`` (reset per-epoch fields), ``resume()`` (yield the rest of the current
    epoch from the fields, updating them *before* each yield), ``fields()`` and
    ``load_fields()`` (their part of the state).
    """

    def __init__(self, dataset: SavableDataset) -> None:
        self.dataset = dataset
        self.phase = FRESH
        self.epoch = 0

    def run(self) -> Iterator[tuple[Key, Any]]:
        """Continue the current epoch, or start the next one if the last has ended."""
        if self.phase == ENDED:
            self.epoch += 1
            self.begin_epoch()
        elif self.phase == FRESH:
            self.begin_epoch()
        self.phase = RUNNING
        yield from self.resume()
        self.phase = ENDED

    def finish(self) -> None:
        """End the current epoch early: the next ``run()`` starts the next epoch."""
        if self.phase == RUNNING:
            self.phase = ENDED

    def state(self) -> dict[str, Any]:
        return {"phase": self.phase, "epoch": self.epoch, **self.fields()}

    def load(self, reader: StateReader) -> None:
        self.phase = reader.str("phase", choices=PHASES)
        self.epoch = reader.int("epoch")
        self.load_fields(reader)

    @abstractmethod
    def begin_epoch(self) -> None:
        """Reset the per-epoch fields for epoch ``self.epoch``."""

    @abstractmethod
    def resume(self) -> Iterator[tuple[Key, Any]]:
        """Yield the rest of the current epoch as ``(key, sample)`` pairs."""

    @abstractmethod
    def fields(self) -> dict[str, Any]:
        """This cursor's own saved fields, plain data."""

    @abstractmethod
    def load_fields(self, reader: StateReader) -> None:
        """Set this cursor's own fields from a saved state (validated)."""


class SavableDataset(IterableDataset[Any], ABC):
    """An iterable dataset that can save and restore its position exactly.

    Subclasses either provide an :class:`EpochCursor` through ``_new_cursor()`` (sources and
    wrappers that keep progress) or, for wrappers that buffer nothing, override
    ``iter_keyed``/``save_state``/``restore_state`` to pass through to the inner dataset.

    Iterating the dataset directly (``for sample in ds``) runs one epoch in the current
    process as worker 0 of 1 (or as the loader's worker when a loader iterates it) and yields
    samples carrying their restore keys.
    """

    _context: WorkerContext | None
    _ordinal: int
    _cursor: EpochCursor | None

    def __init__(self) -> None:
        self._context = None
        self._ordinal = 0
        self._cursor = None

    # -- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._context is None:
            self.bind(current_worker())
        for key, sample in self.iter_keyed():
            yield attach_restore_key(sample, key)

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        """Yield ``(restore_key, sample)`` pairs: the rest of this epoch or the next one."""
        return self._live_cursor().run()

    def finish_epoch(self) -> None:
        """End the current epoch now (a wrapper that stops early calls this on its inner)."""
        self._live_cursor().finish()

    # -- state -----------------------------------------------------------------------------

    def save_state(self) -> dict[str, Any]:
        """The state as of the last sample yielded: plain data, small, independent of size."""
        return self._live_cursor().state()

    def restore_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next iteration. Raises ``StateFormatError``."""
        self._restore_from(StateReader(state, "state"))

    def _restore_from(self, reader: StateReader) -> None:
        cursor = self._new_cursor()
        cursor.load(reader)
        self._cursor = cursor

    def reset_state(self) -> None:
        """Forget all progress: the next iteration starts epoch 0."""
        self._cursor = None

    def _live_cursor(self) -> EpochCursor:
        if self._cursor is None:
            self._cursor = self._new_cursor()
        return self._cursor

    def _new_cursor(self) -> EpochCursor:
        raise TypeError(
            f"{type(self).__name__} must implement _new_cursor() or override iter_keyed(), "
            "save_state() and restore_state()"
        )

    # -- description -------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """A plain dict describing this dataset and its inner ones (type, parameters, fns)."""
        out: dict[str, Any] = {"type": type(self).__name__, **self._config_fields()}
        children = self.children()
        if len(children) == 1:
            out["inner"] = children[0].config()
        elif children:
            out["inners"] = [child.config() for child in children]
        return out

    def _config_fields(self) -> dict[str, Any]:
        """This dataset's own parameters as plain data (no inner datasets)."""
        return {}

    def children(self) -> Sequence[SavableDataset]:
        """The inner datasets this one reads from (empty for sources)."""
        return ()

    def walk(self) -> Iterator[SavableDataset]:
        """This dataset and every dataset below it, in pre-order."""
        yield self
        for child in self.children():
            yield from child.walk()

    @abstractmethod
    def restore_sample(self, key: Key) -> Any:
        """Rebuild the sample that carried ``key`` (without the key attached)."""

    def can_restore_sample(self) -> bool:
        """Whether :meth:`restore_sample` works for this pipeline."""
        return all(child.can_restore_sample() for child in self.children())

    def share_sample_seeding(self, owner: SavableDataset) -> bool:
        """Offer this dataset's per-sample reads the seeding of ``owner``, the wrapper right
        above it; returns whether this dataset takes it.

        A map or filter asks its inner dataset when built. One that seeds its own reads (an
        ``IndexedSource`` over a dataset object) and accepts reads under ``owner``'s seed, which
        ``owner`` then does not repeat: one seeding covers both, still a function of the key and
        ``owner``'s position. A dataset takes one owner's offer; the default takes none.
        """
        return False

    def validate_key(self, key: Key) -> None:
        """Raise ``ValueError`` if ``key`` cannot be a restore key of this pipeline.

        Buffers call it on the keys of a state being restored, so a damaged key is reported
        at restore time rather than when the sample is rebuilt in a worker. The default
        checks with the only inner dataset; sources and wrappers that shape keys override it.
        """
        children = self.children()
        if len(children) == 1:
            children[0].validate_key(key)

    # -- the fluent form: each method imports its wrapper (the wrappers import this module) ---

    def map(self, fn: Callable[[Any], Any], *, seed_per_sample: bool = True) -> SavableDataset:
        """``MapDataset(self, fn)``."""
        from .wrappers.map import MapDataset

        return MapDataset(self, fn, seed_per_sample=seed_per_sample)

    def filter(
        self, predicate: Callable[[Any], bool], *, seed_per_sample: bool = True
    ) -> SavableDataset:
        """``FilterDataset(self, predicate)``."""
        from .wrappers.filter import FilterDataset

        return FilterDataset(self, predicate, seed_per_sample=seed_per_sample)

    def shuffle_buffer(self, size: int) -> SavableDataset:
        """``ShuffleBufferDataset(self, size)``."""
        from .wrappers.shuffle_buffer import ShuffleBufferDataset

        return ShuffleBufferDataset(self, size)

    def batch(
        self,
        batch_size: int,
        *,
        collate_fn: Callable[[Sequence[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> SavableDataset:
        """``BatchDataset(self, batch_size, ...)``."""
        from .wrappers.batch import BatchDataset

        return BatchDataset(self, batch_size, collate_fn=collate_fn, drop_last=drop_last)

    def repeat(self, repeats: int | None = None) -> SavableDataset:
        """``RepeatDataset(self, repeats)``: endless by default."""
        from .wrappers.repeat import RepeatDataset

        return RepeatDataset(self, repeats)

    def limit(self, length: int) -> SavableDataset:
        """``LimitDataset(self, length)``."""
        from .wrappers.limit import LimitDataset

        return LimitDataset(self, length)

    def gc(self, *, every_n_iter: int = 64, freeze: bool = True) -> SavableDataset:
        """``GcDataset(self, ...)``."""
        from .wrappers.gc import GcDataset

        return GcDataset(self, every_n_iter=every_n_iter, freeze=freeze)

    def log_samples(self, *, log_dir: str | None = None) -> SavableDataset:
        """``LogSampleDataset(self, log_dir=...)``."""
        from .wrappers.log_sample import LogSampleDataset

        return LogSampleDataset(self, log_dir=log_dir)

    def blend(
        self, *others: tuple[SavableDataset, float], weight: float = 1.0, on_exhausted: str = "end"
    ) -> SavableDataset:
        """``BlendDataset((self, weight), *others, on_exhausted=...)``."""
        from .wrappers.blend import BlendDataset

        return BlendDataset((self, weight), *others, on_exhausted=on_exhausted)

    def concat(self, *others: SavableDataset) -> SavableDataset:
        """``ConcatDataset(self, *others)``."""
        from .wrappers.concat import ConcatDataset

        return ConcatDataset(self, *others)

    def epochize(self, length: int) -> SavableDataset:
        """``EpochizeDataset(self, length)``."""
        from .wrappers.epochize import EpochizeDataset

        return EpochizeDataset(self, length)

    def pack(self, max_len: int, **options: Any) -> SavableDataset:
        """``PackingDataset(self, max_len, **options)`` (buffer_size, too_long, ...)."""
        from .wrappers.packing import PackingDataset

        return PackingDataset(self, max_len, **options)

    def group_batch(
        self, key_fn: Callable[[Any], Any], batch_size: int, **options: Any
    ) -> SavableDataset:
        """``GroupBatchDataset(self, key_fn, batch_size, **options)``."""
        from .wrappers.group_batch import GroupBatchDataset

        return GroupBatchDataset(self, key_fn, batch_size, **options)

    def unbatch(self, micro_batch_size: int | None = None) -> SavableDataset:
        """``UnbatchDataset(self, micro_batch_size)``: samples, or micro-batches of that size."""
        from .wrappers.unbatch import UnbatchDataset

        return UnbatchDataset(self, micro_batch_size)

    # -- where it runs ---------------------------------------------------------------------

    def bind(self, context: WorkerContext) -> None:
        """Tell this pipeline which worker it runs as, and number its components.

        Each dataset gets the context and its ordinal among its class's datasets in pre-order (two
        identical shuffled sources draw different streams). The loader calls it in every worker;
        iterating a dataset directly binds it to :func:`~energy_loader.current_worker`.
        """
        counts: dict[str, int] = {}
        for dataset in self.walk():
            name = type(dataset).__name__
            dataset._context = context
            dataset._ordinal = counts.get(name, 0)
            counts[name] = dataset._ordinal + 1

    @property
    def context(self) -> WorkerContext:
        """The worker context this dataset was bound to (worker 0 of 1 if never bound)."""
        return self._context if self._context is not None else current_worker()

    def stream_salt(self) -> int:
        """A per-component salt: class name and ordinal, stable across runs (cached)."""
        salt = self.__dict__.get("_salt")
        if salt is None or salt[0] != self._ordinal:
            salt = (self._ordinal, stable_hash(type(self).__name__, self._ordinal))
            self._salt = salt
        return salt[1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cursor"] = None
        return state


class BaseWrapperDataset(SavableDataset):
    """A dataset that reads from one inner dataset.

    Wrappers that buffer nothing (map, filter, ...) set ``passes_state_through = True`` and
    their state *is* the inner dataset's state. Wrappers that keep progress provide a
    :class:`WrapperCursor`, whose state nests the inner state under ``"inner"``.
    """

    passes_state_through: ClassVar[bool] = False

    def __init__(self, dataset: SavableDataset) -> None:
        super().__init__()
        if not isinstance(dataset, SavableDataset):
            raise TypeError(
                f"{type(self).__name__} wraps a SavableDataset (a source such as "
                f"IndexedSource, or another wrapper); got {type(dataset).__name__}"
            )
        self.dataset = dataset

    def children(self) -> Sequence[SavableDataset]:
        return (self.dataset,)

    # Pass-through defaults (used when passes_state_through is True).

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        if self.passes_state_through:
            return self.dataset.iter_keyed()
        return super().iter_keyed()

    def finish_epoch(self) -> None:
        if self.passes_state_through:
            self.dataset.finish_epoch()
        else:
            super().finish_epoch()

    def save_state(self) -> dict[str, Any]:
        if self.passes_state_through:
            return self.dataset.save_state()
        return super().save_state()

    def _restore_from(self, reader: StateReader) -> None:
        if self.passes_state_through:
            self.dataset._restore_from(reader)
        else:
            super()._restore_from(reader)

    def reset_state(self) -> None:
        super().reset_state()
        self.dataset.reset_state()

    def restore_sample(self, key: Key) -> Any:
        return self.dataset.restore_sample(key)


class WrapperCursor(EpochCursor):
    """A cursor of a one-inner wrapper: its own fields plus the inner state under ``inner``.

    ``inner_done``: the inner epoch ended in this one, so a wrapper restored while draining (a
    last partial batch) does not start the inner dataset's next epoch.
    """

    dataset: BaseWrapperDataset

    def __init__(self, dataset: BaseWrapperDataset) -> None:
        super().__init__(dataset)
        self.inner_done = False

    def begin_epoch(self) -> None:
        self.inner_done = False

    def inner_samples(self) -> Iterator[tuple[Key, Any]]:
        """The inner dataset's samples for this wrapper's epoch; marks ``inner_done``."""
        if self.inner_done:
            return
        yield from self.dataset.dataset.iter_keyed()
        self.inner_done = True

    def finish(self) -> None:
        if self.phase == RUNNING and not self.inner_done:
            self.dataset.dataset.finish_epoch()
            self.inner_done = True
        super().finish()

    def state(self) -> dict[str, Any]:
        out = super().state()
        out["inner_done"] = self.inner_done
        out["inner"] = self.dataset.dataset.save_state()
        return out

    def load(self, reader: StateReader) -> None:
        super().load(reader)
        self.inner_done = reader.bool("inner_done")
        self.dataset.dataset._restore_from(reader.sub("inner"))


def bad_state(path: str, message: str) -> StateFormatError:
    """A ``StateFormatError`` for a field that parsed but makes no sense."""
    return StateFormatError(f"{path}: {message}")
