"""Changes made on purpose at a restore: a blend's weights, its sources, a shuffle buffer's size.

A loader built with ``changes=["BlendDataset.weights"]`` restores a state whose config differs
from its pipeline's there (and only there). Each partition replays its saved items with the
values it saved them with, then takes the new ones, so every unchanged part continues exactly
and the change applies from the restore on. A change is a plain record, ``{"stage": "BatchDataset
> BlendDataset", "field": "weights", "before": [0.5, 0.5]}``, that travels with each partition's
entry until the partition next takes a checkpoint (docs/long-jobs.md).

The fields that may change, as a refusal's differences name them:

- ``BlendDataset.weights``: new weights (0 takes a source out of the mix);
- ``BlendDataset.sources``: sources appended at the end (their weights with them), each starting
  at its beginning;
- ``ShuffleBufferDataset.size``: a larger buffer fills up, a smaller one drains down.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import StateFormatError
from .fingerprint import ConfigDifference, config_differences, pipeline_stages
from .plain import StateReader

# A declarable change: the stage type and its field, and the config fields it lets differ.
CHANGEABLE = {
    ("BlendDataset", "weights"): ("weights",),
    ("BlendDataset", "sources"): ("weights", "inners"),
    ("ShuffleBufferDataset", "size"): ("size",),
}


def require_changes(changes: Any, dataset: Any, pipeline: bool) -> tuple[str, ...]:
    """``changes`` as a tuple of ``"Stage.field"`` strings, each a change :data:`CHANGEABLE`
    names, for a loader over ``dataset`` (a savable ``pipeline`` or not); ``TypeError`` /
    ``ValueError`` naming what would be right otherwise."""
    if changes and not pipeline:
        raise ValueError(
            "`changes` declares changes to a savable pipeline's stages; this loader runs a "
            f"plain {type(dataset).__name__} (build it over a SavableDataset)"
        )
    known = ", ".join(f"{stage}.{field}" for stage, field in CHANGEABLE)
    if isinstance(changes, str) or not isinstance(changes, Sequence):
        raise TypeError(
            f"`changes` must be a list of the changes a restore may find, e.g. "
            f'["BlendDataset.weights"] (got {type(changes).__name__}); known: {known}'
        )
    for change in changes:
        if not isinstance(change, str) or _declared(change) not in CHANGEABLE:
            raise ValueError(f"`changes` holds {change!r}; a change is one of: {known}")
    return tuple(changes)


def _declared(change: str) -> tuple[str, str]:
    """``("BlendDataset", "weights")`` of ``"BatchDataset > BlendDataset.weights"``."""
    stage, _, field = change.rpartition(".")
    return stage.rpartition(" > ")[2].partition("[")[0], field


def _covers(change: str, stage_path: str, name: str) -> bool:
    stage, _, field = change.rpartition(".")
    kind = stage_path.rpartition(" > ")[2].partition("[")[0]
    same_stage = stage_path == stage or stage_path.endswith(" > " + stage) or kind == stage
    return same_stage and name in CHANGEABLE.get((kind, field), ())


def _stage_and_field(difference: ConfigDifference) -> tuple[str, str]:
    """The stage a difference is in (its path as :func:`pipeline_stages` names it) and the
    config field of that stage it is in."""
    names = [part for part in difference.field if isinstance(part, str)]
    name = names[-1] if names else ""
    if name == "inners":
        return difference.path, name
    return difference.path[: difference.path.rfind("." + name)], name


def declared_changes(
    saved: Any, now: Any, changes: Sequence[str]
) -> tuple[list[dict[str, Any]], list[ConfigDifference]]:
    """The change records ``changes`` cover between two pipeline configs, and the differences
    they do not cover (a restore refuses those). New sources must come after the saved ones."""
    records: dict[tuple[str, str], dict[str, Any]] = {}
    uncovered = []
    stages = dict(pipeline_stages(saved))
    for difference in config_differences(saved, now):
        path, name = _stage_and_field(difference)
        if not any(_covers(change, path, name) for change in changes):
            uncovered.append(difference)
            continue
        before = stages[path]
        if name == "inners":
            count = len(before["inners"])
            appended = difference.now[:count] if len(difference.now) > count else None
            if appended is None or config_differences(before["inners"], appended):
                uncovered.append(difference)  # not sources appended at the end
                continue
            records[path, "sources"] = {"stage": path, "field": "sources", "before": count}
        else:
            records[path, name] = {"stage": path, "field": name, "before": before[name]}
    return list(records.values()), uncovered


def stage_config(config: Any, stage: str, field: str) -> Any:
    """What a change record's stage holds now in ``config`` (``sources``: how many)."""
    found = dict(pipeline_stages(config))[stage]
    return len(found["inners"]) if field == "sources" else found.get(field)


def draws_other_sources(change: dict[str, Any]) -> bool:
    """Whether a change (with its ``after``) adds a source or takes a weight to or from 0."""
    if change["field"] != "weights":
        return change["field"] == "sources"
    before, after = change["before"], change["after"]
    return [w > 0 for w in before] != [w > 0 for w in after[: len(before)]]


def merged(pending: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> tuple[Any, ...]:
    """The changes a partition's replay undoes: those still pending from an earlier restore
    (their values are the older ones) and the new ones on other fields."""
    held = {(c["stage"], c["field"]) for c in pending}
    return (*pending, *(c for c in new if (c["stage"], c["field"]) not in held))


def read_changes(reader: StateReader) -> tuple[dict[str, Any], ...]:
    """A partition entry's pending changes (``()`` when it has none), validated."""
    if not reader.has("changes"):
        return ()
    out = []
    for index, value in enumerate(reader.list("changes")):
        change = StateReader(value, f"{reader.path}.changes[{index}]")
        field = change.str("field", choices=("weights", "sources", "size"))
        before: Any
        if field == "weights":
            before = [float(w) for w in change.list("before") if _is_weight(w, change.path)]
        else:
            before = change.int("before", minimum=1)
        record = {"stage": change.str("stage"), "field": field, "before": before}
        if change.has("after"):  # in a history entry: what the restore changed it to
            record["after"] = change.raw("after")
        out.append(record)
    return tuple(out)


def _is_weight(value: Any, path: str) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise StateFormatError(f"{path}.before holds {value!r}, not a weight (a number >= 0)")
    return True


def _stage(pipeline: Any, path: str) -> Any:
    """The dataset of ``pipeline`` at a stage path (as :func:`pipeline_stages` names them)."""

    def walk(dataset: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        here = f"{prefix} > {type(dataset).__name__}" if prefix else type(dataset).__name__
        yield here, dataset
        children = dataset.children()
        for index, child in enumerate(children):
            yield from walk(child, here if len(children) == 1 else f"{here}[{index}]")

    for found, dataset in walk(pipeline, ""):
        if found == path:
            return dataset
    raise StateFormatError(f"a saved change names the stage {path!r}, which the pipeline lacks")


@contextlib.contextmanager
def values_before(pipeline: Any, changes: Sequence[dict[str, Any]]) -> Iterator[None]:
    """Within: the pipeline's changed stages hold the values the changes replaced (a blend's
    new sources weigh 0 and have no saved state), so a replay re-makes what was handed out.
    After: the pipeline's own values again, which the next items use."""
    kept = []
    for change in changes:
        stage, field, before = _stage(pipeline, change["stage"]), change["field"], change["before"]
        if field == "weights":
            padded = [*before, *[0.0] * (len(stage.weights) - len(before))]
            kept.append((stage, "weights", stage.weights, tuple(padded[: len(stage.weights)])))
        elif field == "sources":
            kept.append((stage, "saved_sources", None, before))
        else:
            kept.append((stage, "size", stage.size, before))
    try:
        for stage, name, _, value in kept:
            setattr(stage, name, value)
        yield
    finally:
        for stage, name, value, _ in kept:
            setattr(stage, name, value)


def read_history(reader: StateReader) -> tuple[dict[str, Any], ...]:
    """A rank state's history (``()`` when it has none), validated: each entry an epoch and a
    step (items the rank had handed out in it) with ``skip`` (items left out) or ``changes``."""
    if not reader.has("history"):
        return ()
    out = []
    for index, value in enumerate(reader.list("history")):
        entry = StateReader(value, f"{reader.path}.history[{index}]")
        place: dict[str, Any] = {"epoch": entry.int("epoch"), "step": entry.int("step")}
        if entry.has("skip"):
            out.append({**place, "skip": entry.int("skip", minimum=1)})
        else:
            out.append({**place, "changes": list(read_changes(entry))})
    return tuple(out)


def describe(entry: dict[str, Any]) -> str:
    """One history entry as ``inspect`` and ``replay`` print it."""
    where = f"epoch {entry['epoch']}, step {entry['step']}"
    if "skip" in entry:
        return f"{where}: skipped {entry['skip']} item(s) (steps {entry['step']} to " + (
            f"{entry['step'] + entry['skip'] - 1} of the epoch's stream)"
        )
    changed = "; ".join(
        f"{c['stage']}.{c['field']} {c['before']} -> {c.get('after')}" for c in entry["changes"]
    )
    return f"{where}: restored with changes to {changed}"
