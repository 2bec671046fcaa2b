"""The drop-in loader's saved state: plain data, its own format name and version (1).

The layout, field by field, is in docs/state-format.md ("Drop-in loaders"). In short: where
the epoch stands (``epoch``, ``used``), what it was dealt from (``job``, ``rng``,
``global_rngs``, ``distributed``), what a restore checks its own result against (``proof``),
the optional ``code`` (fingerprints of the dataset's class, ``collate_fn`` and
``worker_init_fn``), and one ``digest`` of every field but ``config`` and ``code`` (compared
with the running loader instead), so that a state edited or damaged after saving is a
``StateFormatError`` at load.

:data:`_FIELDS` is the one description of a map-style state's fields: :meth:`MapState.to_plain`,
:meth:`MapState.to_json` (the fields fixed for an epoch encoded once an epoch, the others at
each save) and the digest all read it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ...errors import StateFormatError, StateMismatchError
from ...state.changes import read_history
from ...state.code_fingerprint import PREFIX, code_fingerprint
from ...state.digests import digest
from ...state.fingerprint import CODE_SUFFIX
from ...state.plain import StateReader
from ...state.rank_state import is_partition_entries
from .encoding import decode_generator_states
from .global_rngs import GlobalStart, read_digests
from .sampling import EpochStart

DROPIN_STATE_FORMAT = "energy_loader.dropin_state"
DROPIN_STATE_VERSION = 1


def read_header(state: Any, kind: str) -> StateReader:
    """Check format, version and kind; the reader of the whole state."""
    if is_partition_entries(state):
        raise StateMismatchError(
            "the state was saved by a loader over a savable pipeline (its state_dict() holds "
            "partition entries); this loader runs a plain dataset as a drop-in: restore it "
            "into a loader over the same savable pipeline"
        )
    reader = StateReader(state, "state")
    if not reader.has("format"):
        raise StateFormatError(
            "state has no 'format' field: not a loader state from energy_loader (pass what "
            "loader.state_dict() or save_state_rank() returned)"
        )
    found = reader.raw("format")
    if found != DROPIN_STATE_FORMAT:
        if found == "energy_loader.rank_state":
            raise StateMismatchError(
                "the state was saved by a loader over a savable pipeline; this loader runs a "
                "plain dataset as a drop-in (pass the same kind of dataset the state was saved "
                "with)"
            )
        raise StateFormatError(
            f"state.format is {found!r}; expected {DROPIN_STATE_FORMAT!r} (a drop-in state)"
        )
    version = reader.int("version")
    if version != DROPIN_STATE_VERSION:
        raise StateFormatError(
            f"state.version is {version}; this release reads version {DROPIN_STATE_VERSION} "
            "of the drop-in state format only (a state written by another release: restore it "
            "with the release that saved it)"
        )
    saved_kind = reader.str("kind", choices=("map", "iterable"))
    if saved_kind != kind:
        raise StateMismatchError(
            f"the state was saved by a drop-in loader over a {saved_kind}-style dataset; this "
            f"one runs a {kind}-style dataset: restore it into a loader over the dataset that "
            "saved it"
        )
    return reader


def check_config(saved: Any, now: dict[str, Any]) -> None:
    """Raise ``StateMismatchError`` naming every field of ``now`` the saved config differs in."""
    if not isinstance(saved, dict):
        raise StateFormatError("state.config must be a dict")
    differences = [
        f"{name}: saved {saved.get(name)!r}, now {value!r}"
        for name, value in now.items()
        if saved.get(name) != value
    ]
    if differences:
        raise StateMismatchError(
            "the state belongs to another dataset or sampling setup: "
            + "; ".join(differences)
            + ". Build the loader with the dataset, sampler and batching that saved the state"
        )


def code_fingerprints(dataset: Any, collate_fn: Any, worker_init_fn: Any) -> dict[str, Any]:
    """``state.code``: the fingerprints of the dataset's class (its methods: ``__getitem__``,
    ``__len__``...), the loader's ``collate_fn`` and ``worker_init_fn`` (None without one)."""
    functions = {
        "dataset": type(dataset),
        "collate_fn": collate_fn,
        "worker_init_fn": worker_init_fn,
    }
    return {name: None if f is None else code_fingerprint(f) for name, f in functions.items()}


def code_config(code: dict[str, Any]) -> dict[str, Any]:
    """``state.code`` as a config whose ``*_code`` fields a restore compares
    (:func:`~energy_loader.loader.checks.report_code_changes` names ``DataLoader.collate_fn``);
    an absent function as the fingerprint of nothing, so that one added or removed is named."""
    fields = {name + CODE_SUFFIX: fp or PREFIX for name, fp in code.items()}
    return {"type": "DataLoader", **fields}


@attrs.frozen
class Proof:
    """What a state carries to check its restore: ``last``, the digest of the last unit handed
    out ("" before the first); ``end``, at an epoch's end, the digest of the sampler's own
    generators after the epoch's last pull ("" elsewhere, or without own generators);
    ``made``, the digest of that last unit's values as collated ("" when not taken)."""

    last: str = ""
    end: str = ""
    made: str = ""

    def to_plain(self) -> dict[str, str]:
        return {"last": self.last, "end": self.end, "made": self.made}


@attrs.frozen
class JobStart:
    """What every epoch of a drop-in job derives from, fixed at the job's first ``iter()``.

    ``seed``: each epoch's per-sample seeds, one per job (every rank's). ``sampler_seed``:
    this rank's own, from the second epoch on the order of a sampler that draws from torch's
    global generator. ``id``: the job's name, shared by its ranks (None: one process).
    ``persistent``: whether the job draws torch's base seed once (persistent workers) or once
    an epoch. ``workers``: whether the job's loader ran worker processes, whose torch iterator
    calls ``iter(sampler)`` twice when it starts, so that a restore on another number of
    workers calls it as often as the job (:meth:`iter_calls`).
    """

    seed: int
    persistent: bool
    id: int | None
    sampler_seed: int
    workers: bool

    @classmethod
    def new(cls, seed: int, *, persistent: bool, workers: bool) -> JobStart:
        """A job of one process (no id yet), its order seeded as its per-sample seeds."""
        return cls(seed, persistent, None, seed, workers)

    def iter_calls(self, epoch: int) -> int:
        """How many times the job's torch iterator calls ``iter(sampler)`` in a fresh epoch
        ``epoch``: twice where it starts worker processes (every epoch, or only the first
        with persistent workers), else once."""
        return 2 if self.workers and (epoch == 0 or not self.persistent) else 1

    def to_plain(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "persistent": self.persistent,
            "id": self.id,
            "sampler_seed": self.sampler_seed,
            "workers": self.workers,
        }


@attrs.frozen
class MapState:
    """A map-style drop-in loader's position (see the module docstring). ``start`` holds how
    the epoch's index stream began: ``rng``, ``rng_at_iter`` and ``global_rngs``, decoded."""

    rank: int
    world_size: int
    config: dict[str, Any]
    started: bool
    epoch: int
    used: int
    job: JobStart
    start: EpochStart
    sampler_state: Any = None
    # Under a DistributedSampler: the sampler's epoch and the epoch's dealing (dealing.Dealing)
    # as {"epoch", "offset", "end", "world", "units", "rank"}; None otherwise.
    distributed: dict[str, int] | None = None
    proof: Proof = attrs.field(factory=Proof)
    # Digests of the global RNGs the sampler drew from (global_rngs.py) at the save.
    global_rngs_at_save: dict[str, str] | None = None
    # The user code's fingerprints ({"dataset", "collate_fn", "worker_init_fn"}), fixed for
    # the loader's life; None in a state saved without them.
    code: dict[str, Any] | None = None
    # What loader.skip() left out, oldest first (energy_loader.state.changes).
    history: tuple[dict[str, Any], ...] = ()

    def digest(self) -> str:
        """``state.digest``: of every field but format, version, kind, config and code."""
        moving = _values(self, _MOVING)
        return _record_digest(_epoch_part(self)[1], _canonical(moving))

    def to_plain(self) -> dict[str, Any]:
        plain: dict[str, Any] = {
            "format": DROPIN_STATE_FORMAT,
            "version": DROPIN_STATE_VERSION,
            "kind": "map",
        }
        plain.update(_values(self, _FIELDS))
        plain["digest"] = self.digest()
        return plain

    def to_json(self) -> str:
        """:meth:`to_plain` as compact JSON, the fields fixed for an epoch (config, job,
        generator states, the dealing: ~7 KB) encoded once an epoch, the few that move
        written at each save. Raises ``TypeError`` for a sampler state JSON cannot hold."""
        fragment, epoch_digest = _epoch_part(self)
        moving = _encode_sorted(_values(self, _MOVING))
        return (
            f'{{"format":"{DROPIN_STATE_FORMAT}","version":{DROPIN_STATE_VERSION},'
            f'"kind":"map",{moving[1:-1]},{fragment},'
            f'"digest":"{_record_digest(epoch_digest, moving)}"}}'
        )

    @classmethod
    def from_plain(cls, state: Any) -> MapState:
        """Decode and validate: ``StateFormatError`` names the first field of the wrong shape,
        or says the fields do not match ``state.digest``."""
        reader = read_header(state, "map")
        rng, rng_states = _generator_states(reader, "rng")
        at_iter, at_iter_states = _generator_states(reader, "rng_at_iter")
        plain_globals = reader.raw("global_rngs")
        start = EpochStart(
            reader.int("epoch", minimum=0),
            rng_states,
            at_iter_states,
            encoded=(rng, at_iter),
            global_start=None
            if plain_globals is None
            else GlobalStart.from_plain(plain_globals, "state.global_rngs"),
        )
        decoded = cls(
            rank=reader.int("rank", minimum=0),
            world_size=reader.int("world_size", minimum=1),
            config=reader.raw("config"),
            started=reader.bool("started"),
            epoch=start.epoch,
            used=reader.int("used", minimum=0),
            job=_job(reader.sub("job")),
            start=start,
            sampler_state=reader.raw("sampler_state"),
            distributed=_distributed(reader),
            proof=_proof(reader.sub("proof")),
            global_rngs_at_save=read_digests(
                reader.raw("global_rngs_at_save"), "state.global_rngs_at_save"
            ),
            code=_code(reader),
            history=read_history(reader),
        )
        if decoded.digest() != reader.str("digest"):
            raise StateFormatError(
                f"the fields {', '.join(f'state.{f.name}' for f in _FIELDS if f.digested)} do "
                "not match state.digest: the state was edited or damaged after it was saved. "
                "Restore from an intact copy of the checkpoint"
            )
        return decoded


@attrs.frozen
class _Field:
    """One field of a map-style state: ``value`` gives its plain value; ``per_epoch``: fixed
    through an epoch (encoded, and hashed, once an epoch); ``digested``: covered by
    ``state.digest``; ``optional``: written only when not empty."""

    name: str
    value: Callable[[MapState], Any]
    per_epoch: bool = False
    digested: bool = True
    optional: bool = False


def _values(state: MapState, fields: tuple[_Field, ...]) -> dict[str, Any]:
    """The plain values of ``fields`` of ``state``, less the optional ones that are empty."""
    values = {field.name: field.value(state) for field in fields}
    return {f.name: values[f.name] for f in fields if values[f.name] or not f.optional}


# The fields of a map-style state, in the order to_plain() writes them.
_FIELDS = (
    _Field("rank", lambda s: s.rank),
    _Field("world_size", lambda s: s.world_size),
    _Field("started", lambda s: s.started),
    _Field("epoch", lambda s: s.epoch),
    _Field("used", lambda s: s.used),
    _Field("sampler_state", lambda s: s.sampler_state),
    _Field("proof", lambda s: s.proof.to_plain()),
    _Field("global_rngs_at_save", lambda s: s.global_rngs_at_save),
    _Field("history", lambda s: list(s.history), optional=True),
    _Field("config", lambda s: s.config, per_epoch=True, digested=False),
    _Field("job", lambda s: s.job.to_plain(), per_epoch=True),
    _Field("rng", lambda s: s.start.encoded()[0], per_epoch=True),
    _Field("rng_at_iter", lambda s: s.start.encoded()[1], per_epoch=True),
    _Field("global_rngs", lambda s: s.start.global_plain(), per_epoch=True),
    _Field("distributed", lambda s: s.distributed, per_epoch=True),
    _Field("code", lambda s: s.code, per_epoch=True, digested=False),
)
_MOVING = tuple(field for field in _FIELDS if not field.per_epoch)
_PER_EPOCH = tuple(field for field in _FIELDS if field.per_epoch)
_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_encode_sorted = json.JSONEncoder(separators=(",", ":"), allow_nan=False, sort_keys=True).encode
# id(config) -> (the objects the per-epoch fields come from, their JSON without its braces,
# their digest); identity-checked on use. One engine's epoch at a time is what pays to keep.
_EPOCH_PARTS: dict[int, tuple[tuple[Any, ...], str, str]] = {}


def _epoch_part(state: MapState) -> tuple[str, str]:
    """The per-epoch fields of ``state`` as JSON without its braces, and their digest:
    computed once an epoch (the generator states alone are ~7 KB of base64)."""
    start = state.start
    key = (state.config, state.job, start, start.global_start, state.distributed, state.code)
    cached = _EPOCH_PARTS.get(id(state.config))
    if cached is not None and all(a is b for a, b in zip(cached[0], key)):
        return cached[1], cached[2]
    plain = {field.name: field.value(state) for field in _PER_EPOCH}
    fragment = _encode(plain)[1:-1]
    hashed = {field.name: plain[field.name] for field in _PER_EPOCH if field.digested}
    part_digest = digest("dropin-epoch", _canonical(hashed))
    _EPOCH_PARTS.clear()
    _EPOCH_PARTS[id(state.config)] = (key, fragment, part_digest)
    return fragment, part_digest


def _record_digest(epoch_digest: str, moving: str) -> str:
    """``state.digest``: the per-epoch fields' digest and the other fields' canonical JSON."""
    return digest("dropin-state", epoch_digest, moving)


def _canonical(value: Any) -> str:
    """Plain data as canonical JSON (tuples and lists alike, keys sorted), for a digest that
    holds across a JSON or ``torch.save`` round trip; ``repr`` for what JSON cannot hold."""
    try:
        return _encode_sorted(value)
    except (TypeError, ValueError):
        try:
            return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
        except (TypeError, ValueError):
            return repr(value)


def _generator_states(
    reader: StateReader, name: str
) -> tuple[list[str] | None, list[torch.Tensor] | None]:
    """Field ``name``: generator states as saved (base64) and decoded (size checked)."""
    texts = reader.raw(name)
    if texts is None:
        return None, None
    if not isinstance(texts, list):
        raise StateFormatError(f"state.{name} must be a list of base64 strings or null")
    return texts, decode_generator_states(texts, f"state.{name}")


def _job(reader: StateReader) -> JobStart:
    return JobStart(
        seed=reader.int("seed", minimum=0),
        persistent=reader.bool("persistent"),
        id=None if reader.raw("id") is None else reader.int("id", minimum=0),
        sampler_seed=reader.int("sampler_seed", minimum=0),
        workers=reader.bool("workers"),
    )


def _proof(reader: StateReader) -> Proof:
    made = reader.str("made")
    if made and not _HEX16.fullmatch(made):
        raise StateFormatError(
            f"state.proof.made is {made[:40]!r}: expected a digest of 16 hex digits "
            'or "" (an edited or damaged state: restore from an intact copy)'
        )
    return Proof(reader.str("last"), reader.str("end"), made)


def _code(reader: StateReader) -> dict[str, Any] | None:
    code = reader.raw("code") if reader.has("code") else None
    if code is not None and not (
        isinstance(code, dict) and all(v is None or isinstance(v, str) for v in code.values())
    ):
        raise StateFormatError("state.code must be a dict of fingerprints (strings or null)")
    return code


def _distributed(reader: StateReader) -> dict[str, int] | None:
    if reader.raw("distributed") is None:
        return None
    fields = reader.sub("distributed")
    out = {name: fields.int(name) for name in ("epoch", "offset", "end", "units")}
    out["world"] = fields.int("world", minimum=1)
    out["rank"] = fields.int("rank", minimum=0)
    if out["offset"] > out["end"]:
        raise StateFormatError("state.distributed.offset must be <= state.distributed.end")
    return out


_HEX16 = re.compile("[0-9a-f]{16}")


def summarize_dropin_state(state: Any) -> dict[str, Any]:
    """A drop-in state as a small JSON-able summary (validated first), for ``inspect``."""
    reader = StateReader(state, "state")
    kind = reader.str("kind", choices=("map", "iterable"))
    config = reader.raw("config")
    summary: dict[str, Any] = {"format": DROPIN_STATE_FORMAT, "kind": kind}
    if kind == "iterable":
        read_header(state, "iterable")
        summary.update(rank=reader.int("rank"), world_size=reader.int("world_size"))
        summary.update(config=config)
        return summary
    decoded = MapState.from_plain(state)
    per_epoch = config.get("batches_per_epoch") if isinstance(config, dict) else None
    summary.update(
        rank=decoded.rank,
        world_size=decoded.world_size,
        started=decoded.started,
        epoch=decoded.epoch,
        batches_handed_out=decoded.used,
        batches_per_epoch=per_epoch,
        epoch_over=bool(decoded.started and per_epoch is not None and decoded.used == per_epoch),
        job_seed=decoded.job.seed,
        job_id=decoded.job.id,
        config=config,
    )
    if per_epoch:
        summary["fraction_through"] = decoded.used / per_epoch
    return summary


def describe_dropin_state(state: Any) -> str:
    """A multi-line description of a drop-in state (validated first), for ``inspect``."""
    summary = summarize_dropin_state(state)
    config = summary["config"] if isinstance(summary["config"], dict) else {}
    lines = [
        f"format {DROPIN_STATE_FORMAT} version {DROPIN_STATE_VERSION} "
        f"(the drop-in loader over a {summary['kind']}-style dataset)",
        f"rank {summary['rank']} of {summary['world_size']}",
    ]
    if summary["kind"] == "map":
        if not summary["started"]:
            lines.append("saved before the first iter(): the next one starts epoch 0")
        elif summary["epoch_over"]:
            lines.append(
                f"epoch {summary['epoch']} over ({summary['batches_handed_out']:,} batches "
                f"handed out); the next iter() starts epoch {summary['epoch'] + 1}"
            )
        else:
            of = summary["batches_per_epoch"]
            lines.append(
                f"epoch {summary['epoch']}, {summary['batches_handed_out']:,} of "
                f"{'?' if of is None else f'{of:,}'} batches handed out"
            )
        lines.append(
            f"job seed: {summary['job_seed']} (per-sample seeds derive from it, the epoch and "
            "the index)"
        )
    lines.append("dataset and sampling:")
    lines += [f"  {name}: {value}" for name, value in config.items()]
    return "\n".join(lines)
