"""Global RNGs the loader does not drive, under a map-style drop-in's sampler.

A sampler may draw its order from python's global ``random`` (``random.shuffle`` in its
``__iter__``), from numpy's global RNG (``np.random.permutation``), or from torch's global
generator while the loader believes it does not (a sampler without a ``generator`` attribute
under a loader given ``generator=``): generators the training process draws from too, whose
states the loader does not capture (:class:`~.sampling.SamplerRng` covers the generators it
knows of). The engine (:mod:`.map_style`) compares their states around the sampler's first
draws of each epoch (``iter(sampler)``, and its first pull), and where those draws moved one:

- its states before those draws (:class:`GlobalStart`) go into every state saved in that
  epoch, so a restore re-runs the sampler from them, and puts the training process's states
  back after (:func:`put`);
- a digest of its state *at each save* (:func:`digests_now`) goes in too. The next epochs
  draw their orders from wherever the training process's generator stands then, so a restore
  continues them only if the restarted program put that state back (``random.setstate`` of
  the ``random.getstate()`` it saved with the checkpoint, ``np.random.set_state`` likewise).
  The restore compares at its first ``iter()``, before anything moves, and refuses
  otherwise with :func:`refusal`.

A state saved before the first ``iter()`` holds the digests of all of them (what the sampler
draws from is not known yet); the restore then refuses only if its sampler draws from one that
is elsewhere than at the save.

Costs (docs/benchmarks.md): at each epoch's start, captures of their states before and after
the sampler's first draws (0.1-0.8 ms an epoch, most of it numpy's ``get_state()``); at a save,
nothing unless the sampler draws from one of them, then a digest of its state (python's
``getstate()``, ~20 us; numpy's key read in place through its ``ctypes`` interface, ~3 us;
torch's ~3 us).

Not here: torch's generators (:mod:`.sampling`), the state's layout (:mod:`.state`).
"""

from __future__ import annotations

import ctypes
import hashlib
import random
import struct
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ...errors import StateFormatError, StateMismatchError
from ...state.digests import digest
from .encoding import decode_bytes, decode_generator_states, encode_bytes, encode_generator_states

__all__ = [
    "NAMES",
    "GlobalStart",
    "capture",
    "digests_now",
    "elsewhere",
    "moved",
    "moved_since_pin",
    "put",
    "refusal",
    "watched",
]

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
_NUMPY_WORDS = 624
_NUMPY_BYTES = 4 * _NUMPY_WORDS + 16  # key, then pos, has_gauss (uint32) and the gaussian


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


def _numpy_global() -> Any:
    """The ``RandomState`` behind ``np.random.*``'s functions."""
    return np.random.get_state.__self__  # type: ignore[attr-defined]


def _numpy_key_bytes() -> bytes:
    """numpy's global MT19937 key and position, read in place (~1 us; ``get_state()`` builds
    a dict and an array, ~20-70 us). The cached gaussian is left out: a digest of the key
    tells a restored state from another; only a state one cached gaussian apart slips by."""
    try:
        address = _numpy_global()._bit_generator.ctypes.state_address
        return ctypes.string_at(address, 4 * _NUMPY_WORDS + 4)
    except (AttributeError, TypeError, ValueError):  # another numpy's internals
        state: Any = np.random.get_state()
        return bytes(state[1].astype("<u4").tobytes()) + struct.pack("<i", state[2])


def _python_bytes(state: Any) -> bytes:
    version, internal, gauss = state
    head = struct.pack("<II", int(version), len(internal))
    words = struct.pack(f"<{len(internal)}I", *internal)
    tail = b"\x00" + bytes(8) if gauss is None else b"\x01" + struct.pack("<d", gauss)
    return head + words + tail


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


def _encode(name: str, state: Any) -> str:
    if name == "python":
        raw = _python_bytes(state)
    elif name == "torch":
        return encode_generator_states([state])[0]
    else:
        kind, key, pos, has_gauss, gaussian = state
        if kind != "MT19937":
            raise ValueError(f"numpy's global RNG is a {kind}, not MT19937")
        raw = bytes(np.asarray(key, dtype="<u4").tobytes())
        raw += struct.pack("<IId", int(pos), int(has_gauss), float(gaussian))
    return encode_bytes(raw)


def _decode(name: str, text: Any, path: str) -> Any:
    if name == "torch":
        return decode_generator_states([text], path)[0]
    raw = decode_bytes(text, path)
    if name == "numpy":
        if len(raw) != _NUMPY_BYTES:
            raise StateFormatError(
                f"{path} holds {len(raw)} bytes; numpy's global RNG state has {_NUMPY_BYTES}"
            )
        key = np.frombuffer(raw[: 4 * _NUMPY_WORDS], dtype="<u4").astype(np.uint32)
        pos, has_gauss, gaussian = struct.unpack("<IId", raw[4 * _NUMPY_WORDS :])
        if pos > _NUMPY_WORDS:
            raise StateFormatError(f"{path}: position {pos} is past the key's {_NUMPY_WORDS}")
        return ("MT19937", key, pos, has_gauss, gaussian)
    if len(raw) < 17 or (len(raw) - 17) % 4:
        raise StateFormatError(f"{path} holds {len(raw)} bytes: not a python random state")
    version, count = struct.unpack("<II", raw[:8])
    if 8 + 4 * count + 9 != len(raw):
        raise StateFormatError(f"{path} holds {len(raw)} bytes, not {count} words and a tail")
    internal = struct.unpack(f"<{count}I", raw[8 : 8 + 4 * count])
    flag, gauss = raw[8 + 4 * count], struct.unpack("<d", raw[-8:])[0]
    state = (version, internal, None if flag == 0 else gauss)
    try:
        random.Random().setstate(state)
    except (ValueError, TypeError) as error:
        raise StateFormatError(f"{path} is not a python random state: {error}") from None
    return state


class GlobalStart:
    """Where the global RNGs a sampler drew from stood before its first draws of an epoch.

    ``at_iter``: their states before ``iter(sampler)``, for those that call moved; ``start``:
    before the sampler's first pull, for those that pull moved (by name; the others are
    absent). A restore puts ``at_iter`` before ``iter(sampler)`` and ``start`` after it, as it
    does with torch's generator states. The plain form and its digest are built once.
    """

    __slots__ = ("_check", "_plain", "at_iter", "names", "start")

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
        self._check: str | None = None

    def to_plain(self) -> dict[str, dict[str, str | None]]:
        """``{"python": {"at_iter": "<base64>" | None, "start": ...}, ...}``."""
        if self._plain is None:
            self._plain = {
                name: {
                    part: None if name not in states else _encode(name, states[name])
                    for part, states in (("at_iter", self.at_iter), ("start", self.start))
                }
                for name in self.names
            }
        return self._plain

    def check(self) -> str:
        """The digest of :meth:`to_plain` (``state.checks.global_rngs``)."""
        if self._check is None:
            plain = self.to_plain()
            self._check = digest(
                "global_rngs", tuple((n, plain[n]["at_iter"], plain[n]["start"]) for n in plain)
            )
        return self._check

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
                    states[name] = _decode(name, parts[part], f"{path}.{name}.{part}")
        return cls(at_iter, start, plain={n: dict(value[n]) for n in NAMES if n in value})


def no_global_start_check() -> str:
    """``state.checks.global_rngs`` of a state whose sampler drew from neither."""
    return digest("global_rngs", None)


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


def moved_since_pin(names: Iterable[str], chain: str) -> str:
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
