"""The drop-in loader's saved state: plain data, its own format name and version.

Layout (format version 5; versions 4, without ``proof.made``, 3, also without
``global_rngs`` and ``global_rngs_at_save`` and whose states saved before the first ``iter()``
pin nothing, and 2, without ``proof`` and ``checks.position``, still restore)::

    {
      "format": "energy_loader.dropin_state", "version": 5,
      "kind": "map" | "iterable",
      "rank": 0, "world_size": 1,
      "config": {...},            # what must match on restore (dataset, sampler, batching)
      # map-style:
      "started": true,            # false: saved before the first epoch began
      "epoch": 3,                 # the epoch the position is in (0-based)
      "used": 17,                 # batches (index-sampler units) of it handed out
      "job": {"seed": 123, "persistent": false, "id": 77, "sampler_seed": 123,
              "workers": true},  # see below
      "rng": ["<base64>", ...] | null,      # the sampler's generators at its first pull
      "rng_at_iter": [...] | null,          # ... when iter(sampler) itself drew
      "global_rngs": {"python": {"at_iter": null, "start": "<base64>"}} | null,
      "global_rngs_at_save": {"python": "<hex>"} | null,  # see below
      "sampler_state": {...} | null,        # a Stateful sampler's own state_dict()
      "distributed": {"epoch": 2, "offset": 0, "end": 1000, "world": 4, "units": 8,
                      "rank": 1} | null,
      "proof": {"last": "<hex>", "end": "<hex>", "made": "<hex>"},  # what a restore checks
      "checks": {"job": "<hex>", "rng": "<hex>", "rng_at_iter": "<hex>",
                 "global_rngs": "<hex>", "position": "<hex>"},
      # iterable:
      "pipeline": {...}           # the rank state of the pipeline it runs (rank_state format)
    }

``job`` holds what every epoch of the job derives from, fixed at the job's first ``iter()``
(:mod:`energy_loader.loader.dropin.job`): ``seed`` (a hash of the generator that drives the
loader -- its ``generator``, else torch's global one -- of data-parallel rank 0, shared by
every rank) gives each epoch's per-sample seeds; ``sampler_seed`` (the same hash of this
rank's own generator) the order, from the second epoch on, of a sampler that draws from
torch's global generator; ``id`` names the job (drawn at random on rank 0 and shared with
the seed when torch.distributed runs several ranks, null otherwise), kept across restores so
that the states of one save can be told from another run's; ``persistent`` says whether the
job draws torch's base seed once (persistent workers) or every epoch, so that a restore onto
another ``persistent_workers`` setting keeps the job's generator where the uninterrupted job
has it; ``workers`` whether its loader ran worker processes (torch's iterator then calls
``iter(sampler)`` twice as it starts), so that a restore onto another number of workers calls
it as often as the job did (a sampler whose ``iter()`` draws then draws as in the job). States
saved before ``id`` and ``sampler_seed`` existed have neither: they read as ``id`` null and
``sampler_seed`` equal to ``seed``; states saved before ``workers`` read as null (a restore
then calls ``iter(sampler)`` as its own iterator does).

A state saved before the first ``iter()`` (``started`` false) *pins* the job's start
(:mod:`.pin`): ``job.seed`` is the seed that ``iter()`` would take at the save, ``rng`` the
states of the generators that drive the sampler at the save (before ``iter(sampler)`` and
torch's base-seed draw), and ``global_rngs_at_save`` digests of python's and numpy's global
RNGs then (and torch's where ``rng`` does not hold it). Version 3 states saved there hold
no seed: the restore's first ``iter()`` draws one.

``global_rngs`` (:mod:`.global_rngs`): where the epoch's sampler drew from python's global
``random``, numpy's global RNG, or torch's global generator where ``rng`` does not hold it,
their states before ``iter(sampler)`` (``at_iter``) and
before its first pull (``start``), for those that call moved; ``global_rngs_at_save`` digests
of those generators' states when the state was saved, which a restore compares before its
first ``iter()``.

``distributed`` (under a ``DistributedSampler``) is where the epoch's permutation is dealt
from: the sampler's epoch, and the positions ``offset`` to ``end`` dealt to ``world`` ranks in
``units`` batches each (:class:`energy_loader.loader.dropin.dealing.Dealing`), so that any rank's
state restores every rank of any world size or batch size; ``rank`` is the sampler's rank
that saved it (the restore re-makes that rank's last batch to check itself).

``proof`` lets a restore check its own result (:mod:`.position`, :mod:`.values`): ``last`` is
a digest of the last batch's indices the saving loader handed out, ``made`` one of that
batch's values as collated (:func:`~energy_loader.state.digests.content_digest`, taken where
the batch was made; "" with ``verify_restore=False``), ``end`` (at an epoch's end) one of the
sampler's own generators after the epoch's last pull; "" where there is nothing to prove.
Version 4 states have no ``made``: they restore without the check of values.

``checks`` are digests of the fields a reader cannot check by their shape (a flipped byte in
a generator state is another valid state; so is a flipped digit in ``epoch`` or ``used``):
``position`` covers every field that places the stream (``rank``, ``world_size``,
``started``, ``epoch``, ``used``, ``sampler_state``, ``distributed``, ``proof``,
``global_rngs_at_save``); ``global_rngs`` has a digest of its own. A state
edited or damaged after saving is refused naming the field. A torch ``Generator`` state is
a 5 KB byte tensor, stored as a base64 string built once per epoch (not per save). Nothing
is pickled: the state passes ``json.dumps`` when the sampler's own state does, and
``torch.load(weights_only=True)`` always.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import attrs

from ...errors import StateFormatError, StateMismatchError
from ...state.digests import digest
from ...state.plain import StateReader
from ...state.rank_state import is_partition_entries
from .encoding import decode_generator_states, encode_generator_states
from .global_rngs import GlobalStart, no_global_start_check, read_digests

__all__ = [
    "DROPIN_STATE_FORMAT",
    "Proof",
    "DROPIN_STATE_VERSION",
    "JobStart",
    "MapState",
    "decode_generator_states",
    "describe_dropin_state",
    "encode_generator_states",
    "read_header",
    "summarize_dropin_state",
]

DROPIN_STATE_FORMAT = "energy_loader.dropin_state"
DROPIN_STATE_VERSION = 5
# Version 4 (no proof.made: restored without the check of values), version 3 (no global RNGs;
# a state saved before the first iter() pins nothing) and version 2 (no proof, no position
# digest: restored without the self-check) still restore.
_READABLE_VERSIONS = (2, 3, 4, DROPIN_STATE_VERSION)


@functools.lru_cache(maxsize=16)
def _job_check(
    seed: int | None,
    persistent: bool,
    id: int | None,
    sampler_seed: int | None,
    workers: bool | None,
) -> str:
    if workers is None:  # (a job saved before it recorded its workers: its digest then)
        return digest("job", seed, persistent, id, sampler_seed)
    return digest("job", seed, persistent, id, sampler_seed, workers)


def _legacy_job_check(seed: int | None, persistent: bool) -> str:
    """The digest of a ``job`` saved before it had ``id`` and ``sampler_seed``."""
    return digest("job", seed, persistent)


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
    if version not in _READABLE_VERSIONS:
        raise StateFormatError(
            f"state.version is {version}; this release reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))} (a state from a newer or older release?)"
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


@attrs.frozen
class Proof:
    """What a state carries to check its restore: ``last``, the digest of the last unit handed
    out ("" before the first); ``end``, at an epoch's end, the digest of the sampler's own
    generators after the epoch's last pull ("" elsewhere, or without own generators);
    ``made``, the digest of that last unit's values as collated ("" when not taken; None in
    a state of a version before it)."""

    last: str = ""
    end: str = ""
    made: str | None = ""


@attrs.frozen
class JobStart:
    """What every epoch of a drop-in job derives from, fixed at the job's first ``iter()``.

    ``seed``: each epoch's per-sample seeds, one per job (every rank's). ``sampler_seed``:
    this rank's own, from the second epoch on the order of a sampler that draws from torch's
    global generator (None: ``seed``). ``id``: the job's name, shared by its ranks (None:
    one process, or a job saved before ids). ``persistent``: whether the job draws torch's
    base seed once (persistent workers) or once an epoch. ``workers``: whether the job's
    loader ran worker processes, whose torch iterator calls ``iter(sampler)`` twice when it
    starts (None: saved before it was recorded), so that a restore on another number of
    workers calls it as often as the job (:meth:`iter_calls`).
    """

    seed: int | None  # None: saved before the job's first iter(), which draws it
    persistent: bool
    id: int | None = None
    sampler_seed: int | None = None
    workers: bool | None = None

    def iter_calls(self, epoch: int) -> int | None:
        """How many times the job's torch iterator calls ``iter(sampler)`` in a fresh epoch
        ``epoch``: twice where it starts worker processes (every epoch, or only the first
        with persistent workers), else once; None where the job did not record it."""
        if self.workers is None:
            return None
        return 2 if self.workers and (epoch == 0 or not self.persistent) else 1

    @property
    def order_seed(self) -> int | None:
        """The seed of the sampler's own stream of torch's global generator (epochs >= 1)."""
        return self.seed if self.sampler_seed is None else self.sampler_seed

    def check(self) -> str:
        return _job_check(self.seed, self.persistent, self.id, self.sampler_seed, self.workers)

    def to_plain(self) -> dict[str, Any]:
        plain = {
            "seed": self.seed,
            "persistent": self.persistent,
            "id": self.id,
            "sampler_seed": self.sampler_seed,
        }
        if self.workers is not None:
            plain["workers"] = self.workers
        return plain


@attrs.frozen
class MapState:
    """A map-style drop-in loader's position (see the module docstring)."""

    rank: int
    world_size: int
    config: dict[str, Any]
    started: bool
    epoch: int
    used: int
    job: JobStart | None
    rng: list[str] | None
    rng_at_iter: list[str] | None
    sampler_state: Any
    rng_check: str = ""
    rng_at_iter_check: str = ""
    # Under a DistributedSampler: the sampler's epoch and the epoch's dealing (dealing.Dealing)
    # as {"epoch", "offset", "end", "world", "units"}; None otherwise.
    distributed: dict[str, int] | None = None
    proof: Proof = attrs.field(factory=Proof)
    # Python's and numpy's global RNGs where the sampler drew from them (global_rngs.py): their
    # states before the epoch's first draws, and digests of their states at the save.
    global_rngs: GlobalStart | None = None
    global_rngs_at_save: dict[str, str] | None = None

    @property
    def pinned(self) -> bool:
        """Saved before the first ``iter()``, with the job's start pinned (:mod:`.pin`)."""
        return not self.started and self.job is not None and self.job.seed is not None

    def position_check(self, with_made: bool = True) -> str:
        """The digest of every field that places the stream (``checks.position``); without
        ``proof.made`` for a state of a version before it (``with_made`` false)."""
        sampler = None if self.sampler_state is None else _canonical(self.sampler_state)
        dealt = self.distributed
        at_save = self.global_rngs_at_save
        return digest(
            "position",
            self.rank,
            self.world_size,
            self.started,
            self.epoch,
            self.used,
            sampler,
            None if dealt is None else tuple(dealt.get(name) for name in _DEALT),
            self.proof.last,
            self.proof.end,
            # (absent from a version 3 state's digest, which had no such field)
            *(() if at_save is None else (tuple(at_save.items()),)),
            # (absent from a version 4 state's digest)
            *((self.proof.made or "",) if with_made else ()),
        )

    def global_rngs_check(self) -> str:
        start = self.global_rngs
        return no_global_start_check() if start is None else start.check()

    def to_plain(self) -> dict[str, Any]:
        job = self.job
        return {
            "format": DROPIN_STATE_FORMAT,
            "version": DROPIN_STATE_VERSION,
            "kind": "map",
            "rank": self.rank,
            "world_size": self.world_size,
            "config": self.config,
            "started": self.started,
            "epoch": self.epoch,
            "used": self.used,
            "job": None if job is None else job.to_plain(),
            "rng": self.rng,
            "rng_at_iter": self.rng_at_iter,
            "sampler_state": self.sampler_state,
            "distributed": self.distributed,
            "global_rngs": None if self.global_rngs is None else self.global_rngs.to_plain(),
            "global_rngs_at_save": self.global_rngs_at_save,
            "proof": {
                "last": self.proof.last,
                "end": self.proof.end,
                "made": self.proof.made or "",
            },
            "checks": {
                "job": "" if job is None else job.check(),
                "rng": self.rng_check or digest("rng", self.rng),
                "rng_at_iter": self.rng_at_iter_check or digest("rng_at_iter", self.rng_at_iter),
                "global_rngs": self.global_rngs_check(),
                "position": self.position_check(),
            },
        }

    def to_json(self) -> str:
        """:meth:`to_plain` as compact JSON, the fields fixed for an epoch (config, job,
        generator states, the dealing: ~7 KB) encoded once an epoch, the few that move
        written straight in. Raises ``TypeError`` for a sampler state JSON cannot hold."""
        key = (
            self.config,
            self.job,
            self.rng,
            self.rng_at_iter,
            self.distributed,
            self.global_rngs,
        )
        cached = _FRAGMENT_CACHE.get(id(self.config))
        if cached is not None and all(a is b for a, b in zip(cached[0], key)):
            fragment, checks = cached[1], cached[2]
        else:
            plain = self.to_plain()
            fragment = _encode({name: plain[name] for name in _EPOCH_CONSTANT})[1:-1]
            constant = {k: v for k, v in plain["checks"].items() if k != "position"}
            checks = _encode(constant)[1:-1]
            _FRAGMENT_CACHE.clear()  # one engine's epoch at a time is what pays to keep
            _FRAGMENT_CACHE[id(self.config)] = (key, fragment, checks)
        sampler = "null" if self.sampler_state is None else _encode(self.sampler_state)
        proof = self.proof
        started = "true" if self.started else "false"
        at_save = self.global_rngs_at_save
        at_save_json = "null"
        if at_save is not None:  # (names and hex digests: nothing to escape)
            at_save_json = "{" + ",".join(f'"{n}":"{d}"' for n, d in at_save.items()) + "}"
        return (
            f'{{"format":"{DROPIN_STATE_FORMAT}","version":{DROPIN_STATE_VERSION},'
            f'"kind":"map","rank":{int(self.rank)},"world_size":{int(self.world_size)},'
            f'"started":{started},"epoch":{int(self.epoch)},"used":{int(self.used)},'
            f'"sampler_state":{sampler},"global_rngs_at_save":{at_save_json},{fragment},'
            f'"proof":{{"last":"{proof.last}","end":"{proof.end}","made":"{proof.made or ""}"}},'
            f'"checks":{{{checks},"position":"{self.position_check()}"}}}}'
        )

    @classmethod
    def from_plain(cls, state: Any) -> MapState:
        """Decode and validate; ``StateFormatError`` names the first field that is wrong."""
        reader = read_header(state, "map")
        checks = reader.sub("checks")
        job = None
        if reader.raw("job") is not None:
            job = _job(reader.sub("job"), checks.str("job"))
        started = reader.bool("started")
        if started and (job is None or job.seed is None):
            raise StateFormatError("state.job.seed is null in a state saved after the first iter()")
        texts: dict[str, list[str] | None] = {}
        for name in ("rng", "rng_at_iter"):
            value = reader.raw(name)
            if value is not None:
                if not isinstance(value, list):
                    raise StateFormatError(f"state.{name} must be a list of base64 strings or null")
                decode_generator_states(value, f"state.{name}")  # size and encoding
            _verify(name, digest(name, value), checks.str(name))
            texts[name] = value
        version = reader.int("version")
        legacy = version < 3
        proof = Proof()
        if not legacy:
            saved = reader.sub("proof")
            made = saved.str("made") if version >= 5 else None
            if made and not _HEX16.fullmatch(made):
                raise StateFormatError(
                    f"state.proof.made is {made[:40]!r}: expected a digest of 16 hex digits "
                    'or "" (an edited or damaged state: restore from an intact copy)'
                )
            proof = Proof(saved.str("last"), saved.str("end"), made)
        global_start, at_save = None, None
        if version >= 4:
            plain = reader.raw("global_rngs")
            if plain is not None:
                global_start = GlobalStart.from_plain(plain, "state.global_rngs")
            at_save = read_digests(reader.raw("global_rngs_at_save"), "state.global_rngs_at_save")
            found = no_global_start_check() if global_start is None else global_start.check()
            _verify("global_rngs", found, checks.str("global_rngs"))
        decoded = cls(
            rank=reader.int("rank", minimum=0),
            world_size=reader.int("world_size", minimum=1),
            config=reader.raw("config"),
            started=started,
            epoch=reader.int("epoch", minimum=0),
            used=reader.int("used", minimum=0),
            job=job,
            rng=texts["rng"],
            rng_at_iter=texts["rng_at_iter"],
            sampler_state=reader.raw("sampler_state"),
            rng_check=checks.str("rng"),
            rng_at_iter_check=checks.str("rng_at_iter"),
            distributed=_distributed(reader),
            proof=proof,
            global_rngs=global_start,
            global_rngs_at_save=at_save,
        )
        if not legacy and decoded.position_check(version >= 5) != checks.str("position"):
            raise StateFormatError(
                "the state's position (rank, world_size, started, epoch, used, sampler_state, "
                "distributed, proof, global_rngs_at_save) does not match its digest in "
                "state.checks.position: the state was edited or damaged after it was saved "
                "(restore from an intact copy)"
            )
        return decoded


def _job(reader: StateReader, recorded: str) -> JobStart:
    """The ``job`` block, its digest verified (a block saved before ``id`` existed too)."""

    def optional_int(name: str) -> int | None:
        return None if reader.raw(name) is None else reader.int(name, minimum=0)

    persistent = reader.bool("persistent")
    if not reader.has("id"):  # saved by a release before job ids: read as it was
        job = JobStart(optional_int("seed"), persistent)
        _verify("job", _legacy_job_check(job.seed, persistent), recorded)
        return job
    seed, sampler_seed = optional_int("seed"), optional_int("sampler_seed")
    workers = reader.bool("workers") if reader.has("workers") else None
    job = JobStart(seed, persistent, optional_int("id"), sampler_seed, workers)
    _verify("job", job.check(), recorded)
    return job


def _distributed(reader: StateReader) -> dict[str, int] | None:
    if reader.raw("distributed") is None:
        return None
    fields = reader.sub("distributed")
    out = {name: fields.int(name) for name in ("epoch", "offset", "end", "units")}
    out["world"] = fields.int("world", minimum=1)
    out["rank"] = fields.int("rank", minimum=0) if fields.has("rank") else -1  # version 2: none
    if out["offset"] > out["end"]:
        raise StateFormatError("state.distributed.offset must be <= state.distributed.end")
    return out


_HEX16 = re.compile("[0-9a-f]{16}")
_EPOCH_CONSTANT = ("config", "job", "rng", "rng_at_iter", "distributed", "global_rngs")
# The distributed fields, in the order the position digest takes them.
_DEALT = ("epoch", "offset", "end", "world", "units", "rank")
_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
# id(config) -> ((config, job, rng, rng_at_iter, distributed, global_rngs), their JSON without
# its braces, the constant checks likewise); identity-checked on use.
_FRAGMENT_CACHE: dict[int, tuple[tuple[Any, ...], str, str]] = {}


def _canonical(value: Any) -> str:
    """Plain data as canonical JSON (tuples and lists alike, keys sorted), for a digest that
    holds across a JSON or ``torch.save`` round trip."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    except (TypeError, ValueError):
        return repr(value)


def _verify(name: str, actual: str, recorded: str) -> None:
    if actual != recorded:
        raise StateFormatError(
            f"state.{name} does not match its digest in state.checks.{name}: the state was "
            "edited or damaged after it was saved (restore from an intact copy)"
        )


def summarize_dropin_state(state: Any) -> dict[str, Any]:
    """A drop-in state as a small JSON-able summary (validated first), for ``inspect``."""
    reader = StateReader(state, "state")
    kind = reader.str("kind", choices=("map", "iterable")) if reader.has("kind") else "map"
    config = reader.raw("config") if reader.has("config") else {}
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
        job_seed=None if decoded.job is None else decoded.job.seed,
        job_id=None if decoded.job is None else decoded.job.id,
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
        seed = summary["job_seed"]
        lines.append(
            "job seed: drawn at the first iter()"
            if seed is None
            else f"job seed: {seed} (per-sample seeds derive from it, the epoch and the index)"
        )
    lines.append("dataset and sampling:")
    lines += [f"  {name}: {value}" for name, value in config.items()]
    return "\n".join(lines)
