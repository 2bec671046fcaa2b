"""The training process's global generators under a map-style drop-in: what the loader draws
from them, takes back, keeps apart and checks, so that they come out of a restore where the
uninterrupted run has them (the rules: docs/dropin.md, docs/restores.md).

Each decision that the engine (:mod:`.map_style`) and the index stream (:mod:`.stream`) carry
through an epoch has a named type here (this module imports neither):

- torch's base-seed draw (:class:`BaseSeedDraw`, :class:`BaseSeedFix`,
  :func:`job_draws_base_seed`): one per epoch of the job (or once with persistent workers),
  none in a restored epoch; the engine takes back or adds the difference;
- the sampler's own stream (:class:`PrivateGlobal`, :func:`epoch_stream_state`,
  :func:`pinned_stream`, :class:`StreamBaseDraw`): from the second epoch on, a sampler that
  draws from torch's global generator draws from a stream of (job seed, epoch);
- global RNGs a sampler draws from unseen (:class:`GlobalStart`, :class:`DrawnGlobals`,
  :class:`GlobalsAtSave`, :func:`digests_now`): their states before the epoch's first draws
  go into the state, and a digest at the save lets a restore refuse a program that has them
  elsewhere;
- a restore's replay: :func:`training_generators_kept` puts back what re-running moved.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import hashlib
import random
import struct
import warnings
from array import array
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from ...errors import StateFormatError, StateMismatchError
from ...rng import fold_key, stable_hash
from .encoding import NUMPY_WORDS, decode_global_state, encode_global_state

#: The global RNGs a loader may watch, in the order they are named everywhere.
NAMES = ("python", "numpy", "torch")
_WHAT = {
    "python": "python's global `random`",
    "numpy": "numpy's global RNG",
    "torch": "torch's global generator",
}
_CALLS = {
    "python": "`random.setstate(...)` of the `random.getstate()` saved with it",
    "numpy": "`np.random.set_state(...)` of the `np.random.get_state()` saved with it",
    "torch": "`torch.set_rng_state(...)` of the `torch.get_rng_state()` saved with it",
}


class SamplerGenerators(Protocol):
    """What this module needs of the generators that drive a sampler
    (:class:`~.sampling.SamplerRng`)."""

    uses_global: bool  # torch's global generator drives it
    draws: bool  # the sampler draws random numbers

    def put_own(self, states: list[torch.Tensor]) -> None: ...


# -- torch's base-seed draw ----------------------------------------------------------------------


class BaseSeedFix(enum.Enum):
    """What an ``iter()`` does about torch's base-seed draw from the loader's generator."""

    KEEP = "keep"  # torch draws exactly when the job draws
    TAKE_BACK = "take back"  # torch draws one the job does not: the generator is put back
    ADD = "add"  # the job draws one torch does not (a persistent iterator): it is drawn


def job_draws_base_seed(
    epoch_number: int, *, resumed: bool, persistent: bool, from_global: bool, in_stream: bool
) -> bool:
    """Whether the uninterrupted job draws torch's base seed from the loader's generator as this
    epoch's iterator is made: once an epoch (at epoch 0 only with persistent workers), not in a
    restored epoch, and not from the global generator after epoch 0 unless ``in_stream``."""
    if resumed or (from_global and epoch_number >= 1) or in_stream:
        return False
    return epoch_number == 0 or not persistent


@attrs.define
class BaseSeedDraw:
    """The engine's account of torch's base-seed draw, one ``iter()`` at a time: :meth:`settle`
    (before the epoch's first unit) undoes torch's extra draw or makes the one it skipped."""

    generator: torch.Generator
    fix: BaseSeedFix = BaseSeedFix.KEEP
    before: torch.Tensor | None = None

    def expect(self, *, torch_draws: bool, job_draws: bool) -> None:
        if torch_draws == job_draws:
            self.fix = BaseSeedFix.KEEP
        else:
            self.fix = BaseSeedFix.TAKE_BACK if torch_draws else BaseSeedFix.ADD
        self.before = None

    def note_before_draw(self) -> None:
        if self.fix is BaseSeedFix.TAKE_BACK and self.before is None:
            self.before = self.generator.get_state()

    def settle(self) -> None:
        fix, self.fix = self.fix, BaseSeedFix.KEEP
        if fix is BaseSeedFix.TAKE_BACK and self.before is not None:
            self.generator.set_state(self.before)
        elif fix is BaseSeedFix.ADD:
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        self.before = None


# -- the sampler's own stream of torch's global generator ---------------------------------------


class StreamBaseDraw(enum.Enum):
    """torch's base-seed draw that a pinned start's first epoch makes in its own stream."""

    NONE = "none"  # the stream takes no base-seed draw
    DUE = "due"  # torch draws it from the global generator after the stream it opens next
    OWED = "owed"  # torch drew it: the stream draws one before the sampler draws again


def epoch_stream_state(seed: int, epoch: int) -> torch.Tensor:
    """The state torch's global generator has, for the sampler only, at the start of epoch
    ``epoch`` >= 1 of a job whose loader has no ``generator`` (see :class:`PrivateGlobal`)."""
    value = fold_key(fold_key(stable_hash("dropin-sampler"), seed), epoch)
    return torch.Generator().manual_seed(value).get_state()


def draws_in_own_stream(rng: SamplerGenerators, epoch_number: int) -> bool:
    """Whether the sampler draws epoch ``epoch_number`` from a stream of its own: from the
    second epoch on, where it draws from torch's global generator."""
    return rng.uses_global and rng.draws and epoch_number >= 1


class PrivateGlobal:
    """torch's global generator, swapped for the epoch's own stream (the job's seed and epoch) while
    the sampler draws from epoch 1 on, so the order ignores the training's draws. ``base_draw``:
    torch's base-seed draw this stream takes instead (a pinned start)."""

    __slots__ = ("_user", "base_draw", "state")

    def __init__(self, state: torch.Tensor, base_draw: StreamBaseDraw = StreamBaseDraw.NONE):
        self.state = state
        self.base_draw = base_draw
        self._user: torch.Tensor | None = None

    def __enter__(self) -> PrivateGlobal:
        self._user = torch.default_generator.get_state()
        torch.default_generator.set_state(self.state)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.state = torch.default_generator.get_state()
        assert self._user is not None
        torch.default_generator.set_state(self._user)
        self._user = None

    def takes_base_draw(self) -> bool:
        return self.base_draw is not StreamBaseDraw.NONE

    def torch_opened_stream(self) -> None:
        """torch opened the task stream: it draws its base seed right after."""
        if self.base_draw is StreamBaseDraw.DUE:
            self.base_draw = StreamBaseDraw.OWED

    def pay_base_draw(self) -> None:
        """Draw, in this stream, the base seed torch drew from the training's generator."""
        if self.base_draw is StreamBaseDraw.OWED:
            with self:
                torch.empty((), dtype=torch.int64).random_()
            self.base_draw = StreamBaseDraw.NONE


# -- global RNGs a sampler draws from unseen ----------------------------------------------------


def watched(loader_drives_torch_global: bool) -> tuple[str, ...]:
    """The global RNGs a loader watches: python's and numpy's, and torch's unless the loader
    captures it already (:attr:`~.sampling.SamplerRng.uses_global`)."""
    return NAMES[:2] if loader_drives_torch_global else NAMES


def capture(names: Iterable[str]) -> dict[str, Any]:
    """The named states now (python's ``getstate()``, numpy's legacy tuple, torch's bytes)."""
    out: dict[str, Any] = {}
    for name in names:
        if name == "python":
            out[name] = random.getstate()
        elif name == "numpy":
            out[name] = np.random.get_state()
        else:
            out[name] = torch.default_generator.get_state()
    return out


def moved(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[str, ...]:
    """The names whose state differs between two captures of the same names."""
    out = []
    for name in before:
        a, b = before[name], after[name]
        if name == "python":
            same = a == b
        elif name == "numpy":
            same = a[2:] == b[2:] and np.array_equal(a[1], b[1])
        else:
            same = torch.equal(a, b)
        if not same:
            out.append(name)
    return tuple(out)


def put(states: Mapping[str, Any]) -> None:
    """Set the named global RNGs to ``states`` (as :func:`capture` took them)."""
    for name, state in states.items():
        if name == "python":
            random.setstate(state)
        elif name == "numpy":
            np.random.set_state(state)
        else:
            torch.default_generator.set_state(state)


class DrawnGlobals:
    """Which of the watched global RNGs a call moves: captured before it, compared after
    (:meth:`before_moved`)."""

    __slots__ = ("before",)

    def __init__(self, names: Iterable[str]) -> None:
        self.before = capture(names)

    def before_moved(self) -> dict[str, Any]:
        """The states before the call of those the call moved (by name)."""
        return {name: self.before[name] for name in moved(self.before, capture(self.before))}


@contextlib.contextmanager
def training_generators_kept(torch_global: bool, names: Iterable[str]) -> Iterator[None]:
    """Put torch's global generator (``torch_global``) and the named global RNGs back as they
    were, whatever the block draws or sets (a restore's re-run of the sampler)."""
    kept_torch = torch.default_generator.get_state() if torch_global else None
    kept = capture(names)
    try:
        yield
    finally:
        if kept_torch is not None:
            torch.default_generator.set_state(kept_torch)
        put(kept)


def _numpy_global() -> Any:
    """The ``RandomState`` behind ``np.random.*``'s functions."""
    return np.random.get_state.__self__  # type: ignore[attr-defined]


def _numpy_key_bytes() -> bytes:
    """numpy's global MT19937 key and position, read in place (~1 us; ``get_state()`` builds
    a dict and an array, ~20-70 us). The cached gaussian is left out: a digest of the key
    tells a restored state from another; only a state one cached gaussian apart slips by."""
    try:
        address = _numpy_global()._bit_generator.ctypes.state_address
        return ctypes.string_at(address, 4 * NUMPY_WORDS + 4)
    except (AttributeError, TypeError, ValueError):  # another numpy's internals
        state: Any = np.random.get_state()
        return bytes(state[1].astype("<u4").tobytes()) + struct.pack("<i", state[2])


def _hex(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def _python_digest() -> str:
    """A digest of python's global ``random`` state: its words, index and cached gaussian
    (``getstate()``'s 625 ints packed by ``array``, ~20 us; python offers no cheaper read)."""
    _, internal, gauss = random.getstate()
    return _hex(array("I", internal).tobytes() + repr(gauss).encode())


def digests_now(names: Iterable[str]) -> dict[str, str]:
    """A digest of each named global RNG's state now (what a save records, and what a restore
    compares with)."""
    out = {}
    for name in names:
        if name == "python":
            out[name] = _python_digest()
        elif name == "numpy":
            out[name] = _hex(_numpy_key_bytes())
        else:
            out[name] = _hex(torch.default_generator.get_state().numpy().tobytes())
    return out


class GlobalStart:
    """Where the global RNGs a sampler drew from stood before its first draws of an epoch:
    ``at_iter`` before ``iter(sampler)``, ``start`` before its first pull (those that moved, by
    name); a restore puts them back at the same points."""

    __slots__ = ("_plain", "at_iter", "names", "start")

    def __init__(
        self,
        at_iter: Mapping[str, Any],
        start: Mapping[str, Any],
        *,
        plain: dict[str, dict[str, str | None]] | None = None,
    ) -> None:
        self.at_iter = dict(at_iter)
        self.start = dict(start)
        # The global RNGs the sampler drew from, in NAMES order.
        self.names = tuple(name for name in NAMES if name in self.at_iter or name in self.start)
        self._plain = plain

    def to_plain(self) -> dict[str, dict[str, str | None]]:
        """``{"python": {"at_iter": "<base64>" | None, "start": ...}, ...}``."""
        if self._plain is None:
            self._plain = {
                name: {
                    part: None if name not in states else encode_global_state(name, states[name])
                    for part, states in (("at_iter", self.at_iter), ("start", self.start))
                }
                for name in self.names
            }
        return self._plain

    @classmethod
    def from_plain(cls, value: Any, path: str) -> GlobalStart:
        """Decode and validate (``StateFormatError`` naming the field)."""
        if not isinstance(value, dict) or not value or not set(value) <= set(NAMES):
            raise StateFormatError(
                f"{path} must map some of {', '.join(map(repr, NAMES))} to their states"
            )
        at_iter: dict[str, Any] = {}
        start: dict[str, Any] = {}
        for name, parts in value.items():
            if not isinstance(parts, dict) or set(parts) != {"at_iter", "start"}:
                raise StateFormatError(f"{path}.{name} must hold 'at_iter' and 'start'")
            if parts["at_iter"] is None and parts["start"] is None:
                raise StateFormatError(f"{path}.{name} holds no state")
            for part, states in (("at_iter", at_iter), ("start", start)):
                if parts[part] is not None:
                    states[name] = decode_global_state(name, parts[part], f"{path}.{name}.{part}")
        return cls(at_iter, start, plain={n: dict(value[n]) for n in NAMES if n in value})


def read_digests(value: Any, path: str) -> dict[str, str] | None:
    """``state.global_rngs_at_save`` validated: null, or digests by name."""
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= set(NAMES):
        raise StateFormatError(f"{path} must map some of {', '.join(map(repr, NAMES))} to digests")
    for name, text in value.items():
        if not isinstance(text, str) or len(text) != 16:
            raise StateFormatError(f"{path}.{name} must be a 16-digit hex digest")
    return {name: value[name] for name in NAMES if name in value}


def elsewhere(at_save: Mapping[str, str]) -> tuple[str, ...]:
    """The names whose state now differs from the digests a save recorded."""
    now = digests_now(at_save)
    return tuple(name for name in at_save if now[name] != at_save[name])


def refusal(names: Iterable[str], chain: str) -> StateMismatchError:
    """The refusal of a restore whose sampler draws from global RNGs left elsewhere."""
    names = tuple(names)
    what = " and ".join(_WHAT[name] for name in names)
    calls = [_CALLS[name] for name in names]
    return StateMismatchError(
        f"the sampler {chain} draws its order from {what}, which the restarted program has "
        "elsewhere than the saving program had it when it saved this state: the epochs from "
        "here on would draw other orders. Put it back before iterating, with the loader's "
        f"state from the same checkpoint ({'; '.join(calls)}), or give the sampler a "
        "generator of its own (a `random.Random(seed)` seeded from the epoch, or a torch "
        "generator through the loader's `generator=`). Pass verify_restore=False to the "
        "loader to continue with other orders anyway (docs/restores.md)"
    )


def _moved_since_pin(names: Iterable[str], chain: str) -> str:
    """The warning of a loader whose sampler drew its first order from global RNGs that moved
    between a save before its first ``iter()`` and that ``iter()``."""
    what = " and ".join(_WHAT[name] for name in names)
    return (
        f"the sampler {chain} drew its first order from {what}, which moved between the "
        "loader's save before this first iter() and the iter(): a restore of that state "
        "cannot draw this order again (it refuses where the restarted program has it "
        "elsewhere, and draws another order where it restored the RNG state saved then). Save "
        "the loader's state right before the first iter(), or give the sampler a generator of "
        "its own"
    )


@attrs.frozen
class GlobalsAtSave:
    """The check of the global RNGs a sampler draws from against a save's digests of them: ``names``
    (moved since the save) must not be drawn from; a restore refuses (``refuses``) as soon as it
    sees the sampler draw from one, the saving loader of a pin warns instead."""

    names: tuple[str, ...]
    refuses: bool

    @classmethod
    def compare(cls, at_save: Mapping[str, str], *, refuses: bool) -> GlobalsAtSave:
        return cls(elsewhere(at_save), refuses)

    def check(self, drawn: Iterable[str], chain: str) -> None:
        """Refuse or warn where the sampler draws from an RNG found elsewhere (``drawn``:
        those it draws from; ``chain``: the sampler, for the message)."""
        found = [name for name in self.names if name in drawn]
        if not found:
            return
        if self.refuses:
            raise refusal(found, chain)
        warnings.warn(_moved_since_pin(found, chain), stacklevel=3)


def check_restored_epoch(
    drawn: GlobalStart | None, at_save: Mapping[str, str] | None, chain: str
) -> None:
    """:class:`GlobalsAtSave` for a restored started epoch, whose state says which global RNGs
    its sampler drew from (``drawn``)."""
    if drawn is None or at_save is None:
        return
    compared = {name: at_save[name] for name in drawn.names if name in at_save}
    GlobalsAtSave.compare(compared, refuses=True).check(drawn.names, chain)


def pinned_stream(
    states: list[torch.Tensor] | None,
    moved: bool,
    rng: SamplerGenerators,
    *,
    base_from_global: bool,
) -> PrivateGlobal | None:
    """The first epoch of a pinned job (:mod:`.pin`): set moved generators to the pinned ``states``
    and return the stream a global-generator sampler draws from; None: draw as it stands."""
    if states is None or not moved:
        return None
    rng.put_own(states)
    if not rng.uses_global:
        return None
    draw = StreamBaseDraw.DUE if base_from_global else StreamBaseDraw.NONE
    return PrivateGlobal(states[0], draw)
