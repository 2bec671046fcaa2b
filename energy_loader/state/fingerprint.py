"""Compare pipeline configurations and say exactly what differs.

A saved state records the ``config()`` of the pipeline that produced it. Restoring compares it
with the new pipeline's config; each difference is reported with a readable path made of the
dataset types on the way down, e.g. ``BatchDataset.batch_size: saved 32, now 16`` or
``BatchDataset > MapDataset.fn: saved tokenize, now detokenize``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from .code_fingerprint import comparable

# A config field that holds a user function's code fingerprint ends so (``fn_code``): it is
# compared apart from the rest (code that changed is reported, not another pipeline).
CODE_SUFFIX = "_code"
# A file source's fingerprint of its data files (:mod:`.data_fingerprint`): compared apart
# from the rest too (data rewritten in place is reported, not another pipeline).
DATA_FIELD = "data_files"


@attrs.frozen
class ConfigDifference:
    """One field that differs between the saved and the current configuration."""

    path: str
    field: tuple[str | int, ...]
    saved: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.path}: saved {_show(self.saved)}, now {_show(self.now)}"


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_MISSING = object()


def config_differences(
    saved: Any, now: Any, *, path: str = "", field: tuple[str | int, ...] = (), code: bool = False
) -> list[ConfigDifference]:
    """Every leaf where ``saved`` and ``now`` differ (lists and tuples compare alike), but
    the user functions' code fingerprints (``*_code`` fields: :func:`code_differences`) and
    the sources' data fingerprints (:data:`DATA_FIELD`:
    :func:`~energy_loader.state.data_fingerprint.data_changes`)."""
    if isinstance(saved, Mapping) and isinstance(now, Mapping):
        if saved.get("type") is not None and saved.get("type") == now.get("type"):
            type_name = str(saved["type"])
            path = f"{path} > {type_name}" if path else type_name
        out: list[ConfigDifference] = []
        for name in sorted(set(saved) | set(now), key=str):
            if name == "type" and saved.get("type") == now.get("type"):
                continue
            if _is_code(name) and not code:
                continue  # code fingerprints: code_differences()
            if name == DATA_FIELD:
                continue  # data fingerprints: data_changes()
            child_path = path if name in ("inner", "inners") else f"{path}.{name}"
            pair = saved.get(name, _MISSING), now.get(name, _MISSING)
            out.extend(config_differences(*pair, path=child_path, field=(*field, name), code=code))
        return out
    both_lists = isinstance(saved, (list, tuple)) and isinstance(now, (list, tuple))
    if both_lists and len(saved) == len(now):
        out = []
        for index, (a, b) in enumerate(zip(saved, now)):
            out.extend(
                config_differences(a, b, path=f"{path}[{index}]", field=(*field, index), code=code)
            )
        return out
    if saved == now and type(saved) is type(now):
        return []
    return [ConfigDifference(path or "config", field, saved, now)]


def code_differences(saved: Any, now: Any) -> list[ConfigDifference]:
    """The user functions whose code differs between two configs of one pipeline (their
    ``*_code`` fingerprints; a config saved before fingerprints has none, and one saved by a
    release before :mod:`.code_fingerprint`'s form is not comparable: nothing is reported for
    either). Call it where :func:`config_differences` found nothing else."""
    found = config_differences(saved, now, code=True)
    return [d for d in found if d.field and _is_code(d.field[-1]) and comparable(d.saved)]


def _is_code(name: Any) -> bool:
    return isinstance(name, str) and name.endswith(CODE_SUFFIX)


def describe_differences(differences: list[ConfigDifference]) -> str:
    """One line per difference, for an error message."""
    return "; ".join(str(d) for d in differences)


def pipeline_stages(config: Any, path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Each stage of a pipeline config, outermost first, with its path as the differences
    name it (``BatchDataset > MapDataset``; ``BlendDataset[1] > MapDataset`` under a stage of
    several inner pipelines)."""
    if not isinstance(config, Mapping):
        return
    type_name = config.get("type")
    if type_name is not None:
        path = f"{path} > {type_name}" if path else str(type_name)
    yield path, config
    yield from pipeline_stages(config.get("inner"), path)
    for index, child in enumerate(config.get("inners") or ()):
        yield from pipeline_stages(child, f"{path}[{index}]")


# IndexedSource.from_fn(length, fn) records fn's code as ``from_fn_code`` and its name as the
# source's ``data``; it records ``seed_per_sample`` only when on (its states saved before the
# option keep their config), so its function runs unseeded where the field is absent.
FROM_FN = "from_fn"


@attrs.frozen
class UserFunction:
    """A user function a pipeline config records (a ``*_code`` field): the stage that runs
    it (``path``, ending in the stage's ``type``), the argument it was passed as, its name,
    and whether it runs without per-sample seeds (``seed_per_sample=False``), so that the
    random numbers it draws are not re-made by a restore."""

    path: str
    stage: str
    argument: str
    name: Any
    unseeded: bool

    def __str__(self) -> str:
        """As a restore's refusal lists it: ``BatchDataset > MapDataset.fn (mymodule.augment)``."""
        unseeded = ", seed_per_sample=False" if self.unseeded else ""
        return f"{self.path}.{self.argument} ({self.name}{unseeded})"

    def call(self) -> str:
        """As the user built it: ``MapDataset(mymodule.augment)``,
        ``IndexedSource.from_fn(mymodule.make_sample)``."""
        if self.argument == FROM_FN:
            return f"{self.stage}.{FROM_FN}({self.name})"
        return f"{self.stage}({self.name})"


def user_functions(config: Any) -> list[UserFunction]:
    """The user functions of a pipeline config, outermost stage first: each ``*_code``
    field's function (a map's ``fn``, a filter's ``predicate``, ``IndexedSource.from_fn``'s
    function...)."""
    found: list[UserFunction] = []
    for path, stage in pipeline_stages(config):
        seeded = stage.get("seed_per_sample")
        for name in stage:
            if _is_code(name):
                argument = name[: -len(CODE_SUFFIX)]
                from_fn = argument == FROM_FN
                found.append(
                    UserFunction(
                        path=path,
                        stage=str(stage.get("type", "?")),
                        argument=argument,
                        name=stage.get("data") if from_fn else stage.get(argument),
                        unseeded=seeded is not True if from_fn else seeded is False,
                    )
                )
    return found


def user_code(config: Any) -> tuple[list[str], list[str]]:
    """What in a pipeline config can make other values from the same restore key: the user
    functions (:func:`user_functions`, ``BatchDataset > MapDataset.fn (mymodule.augment)``,
    marked where it runs with ``seed_per_sample=False``), and the sources, which read the data
    (the stages without an inner one), outermost first."""
    functions = [str(function) for function in user_functions(config)]
    sources = [
        path or "the source"
        for path, stage in pipeline_stages(config)
        if "inner" not in stage and "inners" not in stage
    ]
    return functions, sources
