"""The drop-in loader's saved state: plain data, its own format name and version.

Layout (format version 2)::

    {
      "format": "energy_loader.dropin_state", "version": 2,
      "kind": "map" | "iterable",
      "rank": 0, "world_size": 1,
      "config": {...},            # what must match on restore (dataset, sampler, batching)
      # map-style:
      "started": true,            # false: saved before the first epoch began
      "epoch": 3,                 # the epoch the position is in (0-based)
      "used": 17,                 # batches (index-sampler units) of it handed out
      "job": {"seed": 123, "persistent": false},  # fixed at the job's first iter()
      "rng": ["<base64>", ...] | null,      # the sampler's generators at its first pull
      "rng_at_iter": [...] | null,          # ... when iter(sampler) itself drew
      "sampler_state": {...} | null,        # a Stateful sampler's own state_dict()
      "distributed": {"epoch": 2, "offset": 0, "end": 1000, "world": 4, "units": 8} | null,
      "checks": {"job": "<hex>", "rng": "<hex>", "rng_at_iter": "<hex>"},
      # iterable:
      "pipeline": {...}           # the rank state of the pipeline it runs (rank_state format)
    }

``job`` holds what every epoch of the job derives from: ``seed`` (a hash of the generator
that drives the loader -- its ``generator``, else torch's global one -- at the job's first
``iter()``) gives each epoch's per-sample seeds and, from the second epoch on, the order of
a sampler that draws from torch's global generator; ``persistent`` says whether the job draws
torch's base seed once (persistent workers) or every epoch, so that a restore onto another
``persistent_workers`` setting keeps the job's generator where the uninterrupted job has it.

``distributed`` (under a ``DistributedSampler``) is where the epoch's permutation is dealt
from: the sampler's epoch, and the positions ``offset`` to ``end`` dealt to ``world`` ranks in
``units`` batches each (:class:`energy_loader.loader.planner.Dealing`), so that any rank's
state restores every rank of any world size or batch size.

``checks`` are digests of the fields a reader cannot check by their shape (a flipped byte in
a generator state is another valid state): a state edited or damaged after saving is refused
naming the field. A torch ``Generator`` state is a 5 KB byte tensor, stored as a base64 string
built once per epoch (not per save). Nothing is pickled: the state passes ``json.dumps`` when
the sampler's own state does, and ``torch.load(weights_only=True)`` always.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from typing import Any

import attrs
import torch

from ...errors import StateFormatError, StateMismatchError
from ...state.plain import StateReader
from ...state.rank_state import is_partition_entries

__all__ = [
    "DROPIN_STATE_FORMAT",
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
DROPIN_STATE_VERSION = 2

# The byte size of a CPU generator's state (mt19937 plus its normal-distribution cache).
GENERATOR_STATE_BYTES = int(torch.Generator().get_state().numel())


def encode_generator_states(states: list[torch.Tensor]) -> list[str]:
    """Generator states (uint8 tensors) as base64 strings."""
    return [base64.b64encode(state.numpy().tobytes()).decode("ascii") for state in states]


def decode_generator_states(texts: list[Any], path: str) -> list[torch.Tensor]:
    """The inverse of :func:`encode_generator_states`; raises ``StateFormatError``."""
    out = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise StateFormatError(f"{path}[{index}] must be a base64 string")
        try:
            raw = base64.b64decode(text.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError) as error:
            raise StateFormatError(f"{path}[{index}] is not valid base64: {error}") from None
        if len(raw) != GENERATOR_STATE_BYTES:
            raise StateFormatError(
                f"{path}[{index}] holds {len(raw)} bytes; a torch generator state has "
                f"{GENERATOR_STATE_BYTES} (truncated or not a generator state)"
            )
        out.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return out


def digest(*parts: Any) -> str:
    """A short hex digest of plain values (their ``repr``), for ``checks``."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


@functools.lru_cache(maxsize=16)
def _job_check(seed: int | None, persistent: bool) -> str:
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
    if version != DROPIN_STATE_VERSION:
        raise StateFormatError(
            f"state.version is {version}; this release reads version {DROPIN_STATE_VERSION} "
            "(a state from a newer or older release?)"
        )
    saved_kind = reader.str("kind", choices=("map", "iterable"))
    if saved_kind != kind:
        raise StateMismatchError(
            f"the state was saved by a drop-in loader over a {saved_kind}-style dataset; this "
            f"one runs a {kind}-style dataset"
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
            "the state belongs to another dataset or sampling setup: " + "; ".join(differences)
        )


@attrs.frozen
class JobStart:
    """What every epoch of a drop-in job derives from, fixed at the job's first ``iter()``.

    ``seed``: each epoch's per-sample seeds, and from the second epoch on the order of a
    sampler that draws from torch's global generator. ``persistent``: whether the job draws
    torch's base seed once (persistent workers) or once an epoch.
    """

    seed: int | None  # None: saved before the job's first iter(), which draws it
    persistent: bool

    def check(self) -> str:
        return _job_check(self.seed, self.persistent)


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
    # Under a DistributedSampler: the sampler's epoch and the epoch's dealing (planner.Dealing)
    # as {"epoch", "offset", "end", "world", "units"}; None otherwise.
    distributed: dict[str, int] | None = None

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
            "job": None if job is None else {"seed": job.seed, "persistent": job.persistent},
            "rng": self.rng,
            "rng_at_iter": self.rng_at_iter,
            "sampler_state": self.sampler_state,
            "distributed": self.distributed,
            "checks": {
                "job": "" if job is None else job.check(),
                "rng": self.rng_check or digest("rng", self.rng),
                "rng_at_iter": self.rng_at_iter_check or digest("rng_at_iter", self.rng_at_iter),
            },
        }

    def to_json(self) -> str:
        """:meth:`to_plain` as compact JSON, the fields fixed for an epoch (config, job,
        generator states, the dealing: ~7 KB) encoded once an epoch, the few that move
        written straight in. Raises ``TypeError`` for a sampler state JSON cannot hold."""
        key = (self.config, self.job, self.rng, self.rng_at_iter, self.distributed)
        cached = _FRAGMENT_CACHE.get(id(self.config))
        if cached is not None and all(a is b for a, b in zip(cached[0], key)):
            fragment = cached[1]
        else:
            plain = self.to_plain()
            fragment = _encode({name: plain[name] for name in _EPOCH_CONSTANT})[1:]
            _FRAGMENT_CACHE.clear()  # one engine's epoch at a time is what pays to keep
            _FRAGMENT_CACHE[id(self.config)] = (key, fragment)
        sampler = "null" if self.sampler_state is None else _encode(self.sampler_state)
        started = "true" if self.started else "false"
        return (
            f'{{"format":"{DROPIN_STATE_FORMAT}","version":{DROPIN_STATE_VERSION},'
            f'"kind":"map","rank":{int(self.rank)},"world_size":{int(self.world_size)},'
            f'"started":{started},"epoch":{int(self.epoch)},"used":{int(self.used)},'
            f'"sampler_state":{sampler},{fragment}'
        )

    @classmethod
    def from_plain(cls, state: Any) -> MapState:
        """Decode and validate; ``StateFormatError`` names the first field that is wrong."""
        reader = read_header(state, "map")
        checks = reader.sub("checks")
        job = None
        if reader.raw("job") is not None:
            job_reader = reader.sub("job")
            seed = None if job_reader.raw("seed") is None else job_reader.int("seed")
            job = JobStart(seed, job_reader.bool("persistent"))
            _verify("job", job.check(), checks.str("job"))
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
        return cls(
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
        )


def _distributed(reader: StateReader) -> dict[str, int] | None:
    if reader.raw("distributed") is None:
        return None
    fields = reader.sub("distributed")
    out = {name: fields.int(name) for name in ("epoch", "offset", "end", "units")}
    out["world"] = fields.int("world", minimum=1)
    if out["offset"] > out["end"]:
        raise StateFormatError("state.distributed.offset must be <= state.distributed.end")
    return out


_EPOCH_CONSTANT = ("config", "job", "rng", "rng_at_iter", "distributed", "checks")
_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
# id(config) -> ((config, job, rng, rng_at_iter, distributed), their JSON without its opening
# brace); identity-checked on use.
_FRAGMENT_CACHE: dict[int, tuple[tuple[Any, ...], str]] = {}


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
