"""Fingerprints of user code, to tell at a restore what changed since the save.

:func:`code_fingerprint` walks a function as it runs: bytecode, defaults, closure, a partial's
arguments, a callable object's class and attributes, ``__wrapped__``, and the globals its code
reads (user functions and classes walked in turn, plain data up to a size by value, the rest by
type); installed libraries and builtins are named, not walked (docs/restores.md, "Code that
changed since the save"). The fingerprint is ``"2:"`` and one ``label=digest`` per part
(``mymod.augment defaults``, ``mymod.SCALE``...), so a restore names what differs
(:func:`changed_parts`); no path, line number or address enters, and sets are sorted, so the same
code anywhere gives the same value. Without ``"2:"`` it is an older release's (bytecode alone):
not comparable (:func:`comparable`). Not here: comparing configs (:mod:`.fingerprint`), warning
or refusing (``loader/checks.py``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
import types
from collections.abc import Callable
from typing import Any

PREFIX = "2:"
_MAX_DEPTH = 8  # functions and classes followed below the one fingerprinted
_MAX_OBJECTS = 200  # objects walked per fingerprint
_MAX_PARTS = 24  # parts named in the fingerprint (the rest share one digest)
_DATA_BUDGET = 4096  # items (and 64-character chunks of strings) of one plain value
_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})
_SKIPPED = {"__annotations__", "__dict__", "__doc__", "__module__", "__orig_bases__"}
_SKIPPED |= {"__parameters__", "__qualname__", "__slotnames__", "__weakref__"}  # (copyreg's)
_ROOTS = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
_LIBRARY_ROOTS = tuple(os.path.join(os.path.realpath(p), "") for p in sorted(_ROOTS))


def code_fingerprint(fn: Callable[..., Any]) -> str:
    """``fn``'s fingerprint (see the module docstring): ``"2:label=digest;..."``."""
    walk = _Walk()
    walk.follow(fn, 0)
    named = list(walk.parts.items())
    if len(named) > _MAX_PARTS:
        named = [*named[: _MAX_PARTS - 1], ("more", [c for _, c in named[_MAX_PARTS - 1 :]])]
    return PREFIX + ";".join(f"{label}={_digest(content)}" for label, content in named)


def comparable(fingerprint: Any) -> bool:
    """Whether a saved fingerprint is of this form (an older release's is not compared)."""
    return isinstance(fingerprint, str) and fingerprint.startswith(PREFIX)


def changed_parts(saved: str, now: str) -> list[str]:
    """The labels whose digests differ between two fingerprints (or are in one only)."""
    old, new = (dict(p.rpartition("=")[::2] for p in f[2:].split(";") if p) for f in (saved, now))
    return [label for label in {**old, **new} if old.get(label) != new.get(label)]


def _digest(content: Any) -> str:
    return hashlib.blake2b(repr(content).encode(), digest_size=4).hexdigest()


def _name(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    module = "__main__" if module == "__mp_main__" else module  # a spawned worker's main
    return f"{module}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


@functools.lru_cache(maxsize=1024)
def _is_library(module: str | None, file: str | None) -> bool:
    if module is None or module == "builtins" or module.split(".")[0] == "energy_loader":
        return True
    if file is None:  # a notebook's or interactive session's main module is user code
        return module not in ("__main__", "__mp_main__")
    path = os.path.realpath(file)
    return path.startswith(_LIBRARY_ROOTS) or "site-packages" in path or "dist-packages" in path


def _is_user(obj: Any) -> bool:
    """Whether ``obj`` (a function, class or module) is user code, to be walked."""
    if isinstance(obj, types.ModuleType):
        return not _is_library(obj.__name__, getattr(obj, "__file__", None))
    globals_ = getattr(obj, "__globals__", None)
    if isinstance(globals_, dict):
        return not _is_library(globals_.get("__name__"), globals_.get("__file__"))
    name = getattr(obj, "__module__", None)
    module = sys.modules.get(name or "")
    return _is_user(module) if module else name != "builtins"  # unregistered: walked


class _Walk:
    """One fingerprint's walk: its parts by label, in the order first met."""

    def __init__(self) -> None:
        self.parts: dict[str, list[Any]] = {}
        self.seen: dict[int, str] = {}  # id -> label, for this walk only (never digested)
        self.keep: list[Any] = []  # what ``seen`` names stays alive through the walk

    def add(self, label: str, content: Any) -> None:
        self.parts.setdefault(label, []).append(content)

    def follow(self, obj: Any, depth: int) -> str:
        """Walk ``obj`` once; the label that names it in its referrer's part."""
        if id(obj) in self.seen:
            return self.seen[id(obj)]
        if isinstance(obj, functools.partial):
            label = f"partial({_name(obj.func)})"
        elif hasattr(obj, "__qualname__"):  # a function, class, method or builtin
            label = _name(obj)
        else:
            label = _name(type(obj)) + " instance"
        if depth > _MAX_DEPTH or len(self.seen) >= _MAX_OBJECTS:
            return label
        self.seen[id(obj)] = label
        self.keep.append(obj)
        if isinstance(obj, functools.partial):
            args = [self.describe(a, depth) for a in obj.args]
            kwargs = sorted((k, self.describe(v, depth)) for k, v in obj.keywords.items())
            self.add(label + " arguments", (args, kwargs, self.follow(obj.func, depth + 1)))
        elif isinstance(obj, types.MethodType):
            self.add(label, (self.describe(obj.__self__, depth), self.follow(obj.__func__, depth)))
        elif isinstance(obj, types.FunctionType):
            self._function(obj, label, depth)
        elif isinstance(obj, type):
            self._class(obj, label, depth) if _is_user(obj) else self.add(label, "library")
        elif _is_user(type(obj)):  # a callable object: its class and its attributes
            attrs = self.pairs(sorted(getattr(obj, "__dict__", {}).items()), depth)
            self.add(label, (self.follow(type(obj), depth + 1), attrs))
        else:
            self.add(label, "library")
        return label

    def _function(self, fn: types.FunctionType, label: str, depth: int) -> None:
        if not _is_user(fn):
            self.add(label, "library")
            return
        entry = self.parts.setdefault(label, [])  # named before what it uses
        code, names, scope = _code_parts(fn.__code__), _names_read(fn.__code__), fn.__globals__
        module = str(scope.get("__name__")).replace("__mp_main__", "__main__")
        read = [name for name in names if name in scope]
        used = [(n, self.describe(scope[n], depth, f"{module}.{n}", names)) for n in read]
        entry.append((code, used))
        if fn.__defaults__ or fn.__kwdefaults__:
            defaults = [self.describe(v, depth) for v in fn.__defaults__ or ()]
            keywords = self.pairs(sorted((fn.__kwdefaults__ or {}).items()), depth)
            self.add(label + " defaults", (defaults, keywords))
        if fn.__closure__:
            cells = [self.describe(_cell(c), depth) for c in fn.__closure__]
            self.add(label + " closure", (fn.__code__.co_freevars, cells))
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            self.add(label + " wraps", self.follow(wrapped, depth + 1))

    def _class(self, cls: type, label: str, depth: int) -> None:
        bases = [self.describe(b, depth) for b in cls.__bases__]
        members = []
        for name, value in sorted(vars(cls).items()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                value = [value.fget, value.fset, value.fdel]
            if name not in _SKIPPED:
                members.append((name, self.describe(value, depth)))
        self.add(label, (bases, members))

    def pairs(self, items: Any, depth: int) -> list[tuple[Any, Any]]:
        return [(k, self.describe(v, depth)) for k, v in items]

    def describe(
        self, value: Any, depth: int, label: str | None = None, names: tuple[str, ...] = ()
    ) -> Any:
        """How a part refers to ``value``: plain data by value (its own part where it has a
        ``label``: a global), user code by the label of its walk, anything else by its type
        name (a library's function or module by its name)."""
        data = _plain(value, [_DATA_BUDGET])
        if data is not None:
            if label is None:
                return data
            self.add(label, data)
            return "data"
        if isinstance(value, types.ModuleType):
            if _is_user(value):  # its functions this code reads as attributes
                for name in names:
                    member = getattr(value, name, None)
                    if isinstance(member, (type, types.FunctionType)) and _is_user(member):
                        self.follow(member, depth + 1)
            return "module " + value.__name__
        kind = type(value)
        if kind in (list, tuple, dict) and len(value) <= 64 and depth <= _MAX_DEPTH:
            items = value.items() if kind is dict else enumerate(value)  # (of functions...)
            pairs = [(_plain(k, [64]), self.describe(v, depth + 1)) for k, v in items]
            return sorted(pairs, key=repr)
        if isinstance(value, functools.partial):
            return self.follow(value, depth + 1)
        if isinstance(value, (type, types.FunctionType, types.MethodType)):
            return self.follow(value, depth + 1) if _is_user(value) else _name(value)
        if _is_user(kind):  # an object of a user class: its class and attributes
            return self.follow(value, depth + 1)
        return _name(value) if isinstance(value, types.BuiltinFunctionType) else _name(kind)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _plain(value: Any, budget: list[int], nested: int = 0) -> Any:
    """``value`` as a deterministic structure (a str, or a tuple of them) if it is plain data
    within ``budget`` (items, and 64-character pieces of strings), else None."""
    kind = type(value)
    budget[0] -= 1 + (len(value) // 64 if kind in (str, bytes) else 0)
    if budget[0] < 0 or nested > 32:
        return None
    if kind in _SCALARS:
        return repr(value)
    if kind not in (list, tuple, set, frozenset, dict):
        return None
    items = [_plain(v, budget, nested + 1) for v in (value.items() if kind is dict else value)]
    if any(i is None for i in items):
        return None
    return (kind.__name__, items if kind in (list, tuple) else sorted(items, key=repr))


def _code_parts(code: types.CodeType) -> tuple[Any, ...]:
    consts = tuple(
        _code_parts(c) if isinstance(c, types.CodeType) else _plain(c, [_DATA_BUDGET]) or repr(c)
        for c in code.co_consts
    )
    return (code.co_code, consts, code.co_names)


def _names_read(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` and the code nested in it (lambdas, comprehensions) read."""
    names = dict.fromkeys(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(_names_read(const)))
    return tuple(names)
