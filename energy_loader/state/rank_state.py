"""The saved state of one rank's loader: attrs classes and their plain-data codec (version 1).

The layout, field by field, is in docs/state-format.md. In short: the job's layout (rank,
workers, partitions), where the rank stands in the epoch (``delivered``, ``start``,
``next_worker``, the equal-steps count), each partition's rolling checkpoint with the items to
replay from it, and the proof (``last``, ``made``: the restore re-makes the last item handed
out and compares). ``checks.position``, each entry's ``check`` and ``checks.config`` make a
field edited or damaged after the save a ``StateFormatError`` at load.

Any change to this shape bumps :data:`RANK_STATE_VERSION`, keeps a reader of the versions
released before it, and adds states of the new version to ``tests/state_corpus``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ..errors import StateFormatError, StateMismatchError
from .changes import read_changes, read_history
from .digests import KeyDigest, checkpoint_digest, compact_json, digest
from .plain import StateReader, check_plain, is_keyed_by, json_leaf

RANK_STATE_FORMAT = "energy_loader.rank_state"
# The drop-in loader's format (energy_loader.loader.dropin.state), named in a refusal only.
_DROPIN_STATE_FORMAT = "energy_loader.dropin_state"
RANK_STATE_VERSION = 1
# Each pipeline config's digest, by the config object (the planner keeps one per pipeline).
_CONFIG_CHECKS: dict[int, tuple[Any, str]] = {}
# The header's fields, in the order written and digested (``checks.position``).
_LAYOUT = ("rank", "world_size", "num_workers", "num_partitions", "seed")
_PLACE = ("epoch", "in_epoch", "epoch_ended", "delivered", "start", "next_worker")
_STEPS = ("job_left", "items_left", "extra", "pieces")


@attrs.frozen
class PartitionState:
    """One partition's position: a pipeline checkpoint plus items to replay on top of it.

    ``last`` (the last item's key, or its digest) and ``made`` (its values' digest) are the
    restore's proof, ``None`` where there is none (docs/state-format.md).
    """

    partition: int
    checkpoint: dict[str, Any]
    skip: int = 0
    done: bool = False
    last: Any = None
    checkpoint_check: str | None = attrs.field(default=None, eq=False)
    made: str | None = None
    # Of the items to replay, how many the pipeline may lack: a restore with smaller batches
    # (scale k) re-makes an epoch's short last batch as fewer than k batches. Never saved.
    replay_slack: int = attrs.field(default=0, eq=False)
    # Changes declared at a restore that the replay undoes (energy_loader.state.changes): the
    # checkpoint predates them. Saved until the partition takes its next checkpoint.
    changes: tuple[dict[str, Any], ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        # Snapshots travel from each worker every few items: the fields alone, by position.
        return PartitionState, attrs.astuple(self, recurse=False)

    def check(self) -> str:
        """The digest of this entry, as ``to_plain`` writes it."""
        checkpoint = self.checkpoint_check or checkpoint_digest(self.checkpoint)
        fields = (self.partition, checkpoint, self.skip, self.done, self.last, self.made)
        return digest("partition", *fields, *((self.changes,) if self.changes else ()))

    def to_plain(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "checkpoint": self.checkpoint,
            "skip": self.skip,
            "done": self.done,
            "last": self.last,
            "made": self.made,
            **({"changes": list(self.changes)} if self.changes else {}),
            "check": self.check(),
        }

    @classmethod
    def from_reader(cls, reader: StateReader) -> PartitionState:
        """Decode one entry; :meth:`verify` checks its ``check`` once the whole state parsed."""
        checkpoint = reader.raw("checkpoint")
        StateReader(checkpoint, f"{reader.path}.checkpoint")
        skip, done = reader.int("skip"), reader.bool("done")
        if done and skip:
            raise StateFormatError(
                f"{reader.path}: a partition that had ended its epoch has nothing to replay "
                f"(skip {skip})"
            )
        partition = reader.int("partition")
        last = _digest_or_none(reader, "last")
        made = _digest_or_none(reader, "made")
        reader.str("check")
        return cls(
            partition=partition,
            checkpoint=checkpoint,
            skip=skip,
            done=done,
            last=None if last is None else KeyDigest(last),
            made=made,
            changes=read_changes(reader),
        )

    def verify(self, saved: str, path: str) -> PartitionState:
        """This entry with its checkpoint's digest if ``saved`` is its digest, else raises."""
        try:
            checked = attrs.evolve(self, checkpoint_check=checkpoint_digest(self.checkpoint))
        except (TypeError, ValueError) as error:
            raise StateFormatError(f"{path}.checkpoint is not plain data ({error})") from None
        if checked.check() != saved:
            raise StateFormatError(
                f"{path}.check does not match the partition's fields (its checkpoint, skip, "
                "done, last, made or changes): the state was edited or damaged after it was saved; "
                "restore from an intact state"
            )
        return checked


def _digest_or_none(reader: StateReader, name: str) -> str | None:
    value = reader.raw(name)
    if value is not None and not isinstance(value, str):
        raise StateFormatError(f"{reader.path}.{name} must be a digest string or null")
    return value  # type: ignore[no-any-return]


@attrs.frozen
class WorkerSlots:
    """Which partitions one worker runs, whose turn is next, and whether it has ended."""

    partitions: tuple[int, ...]
    next: int = 0
    done: bool = False

    def to_plain(self) -> dict[str, Any]:
        return {"partitions": list(self.partitions), "next": self.next, "done": self.done}

    @classmethod
    def from_reader(cls, reader: StateReader) -> WorkerSlots:
        partitions = tuple(
            _int(value, f"{reader.path}.partitions[{i}]")
            for i, value in enumerate(reader.list("partitions"))
        )
        following, count = reader.int("next"), len(partitions)
        _below(f"{reader.path}.next", following, max(1, count), f"its {count} partitions")
        return cls(partitions=partitions, next=following, done=reader.bool("done"))


def _int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StateFormatError(f"{path} must be a non-negative integer, got {value!r}")
    return value


def _below(path: str, value: int, limit: int, what: str) -> None:
    if value >= limit:
        raise StateFormatError(f"{path} {value} is not below {what}")


@attrs.frozen
class RankState:
    """The whole saved state of one rank's :class:`~energy_loader.SavableDataLoader`."""

    rank: int
    world_size: int
    num_workers: int
    num_partitions: int
    config: dict[str, Any]
    epoch: int
    in_epoch: bool
    epoch_ended: bool
    delivered: int
    start: int
    next_worker: int
    workers: tuple[WorkerSlots, ...]
    partitions: tuple[PartitionState, ...]
    # The WorkerConfig seed the partitions ran with.
    seed: int
    # Equal steps (loader/equal_steps.py): the items the job had left where the epoch's
    # assignment began (None: no count, a pipeline of unknown length), this rank's items left,
    # the steps it lacks, and the pieces of the next item already handed out.
    job_left: int | None = None
    items_left: int = 0
    extra: int = 0
    pieces: int = 0
    # What was skipped or changed on purpose, oldest first (energy_loader.state.changes).
    history: tuple[dict[str, Any], ...] = ()

    def position_check(self) -> str:
        """The digest of every field but ``config`` and the partitions (``checks.position``)."""
        header = [getattr(self, name) for name in (*_LAYOUT, *_PLACE)]
        workers = tuple((w.partitions, w.next, w.done) for w in self.workers)
        history = (self.history,) if self.history else ()
        return digest("rank_state", *header, workers, *(getattr(self, n) for n in _STEPS), *history)

    def config_check(self) -> str:
        """The digest of ``config`` as canonical JSON (``checks.config``); one pipeline's
        config is one object, whose digest is computed once."""
        config = self.config
        cached = _CONFIG_CHECKS.get(id(config))
        if cached is not None and cached[0] is config:
            return cached[1]
        check = str(checkpoint_digest(config))
        if len(_CONFIG_CHECKS) >= 8:
            _CONFIG_CHECKS.clear()
        _CONFIG_CHECKS[id(config)] = (config, check)
        return check

    def stream_position(self) -> int:
        """The job's position ``B`` (mod ``P``) seen from this rank: ``start + world_size x
        delivered`` (lockstep), or once its epoch ended ``start mod world_size``, where the next one
        starts."""
        if self.epoch_ended:
            return self.start % self.world_size
        return (self.start + self.world_size * self.delivered) % self.num_partitions

    def slot_of(self, partition: int) -> int:
        """The slot of one of this rank's partitions: its place in the job's stream from
        :meth:`stream_position`; ``rank + i x world_size`` for the rank's ``i``-th."""
        return (partition - self.stream_position()) % self.num_partitions

    def partition_states(self) -> dict[int, PartitionState]:
        """This rank's partitions by number."""
        return {p.partition: p for p in self.partitions}

    def to_plain(self, *, with_partitions: bool = True) -> dict[str, Any]:
        """The state as plain data with its format name and version (without the
        ``partitions`` list when ``with_partitions`` is false)."""
        plain: dict[str, Any] = {"format": RANK_STATE_FORMAT, "version": RANK_STATE_VERSION}
        plain |= {name: getattr(self, name) for name in _LAYOUT} | {"config": self.config}
        plain |= {name: getattr(self, name) for name in _PLACE}
        plain["workers"] = [w.to_plain() for w in self.workers]
        plain["checks"] = {"position": self.position_check(), "config": self.config_check()}
        if self.job_left is not None:  # a count of the epoch's steps (absent: none)
            plain |= {name: getattr(self, name) for name in _STEPS}
        if self.history:
            plain["history"] = list(self.history)
        if with_partitions:
            plain["partitions"] = [p.to_plain() for p in self.partitions]
        return plain

    @classmethod
    def from_plain(cls, data: Any, *, complete: bool = True) -> RankState:
        """Decode and validate; raises ``StateFormatError`` naming the first bad field.
        ``complete=False`` accepts only some of the workers' partitions."""
        reader = StateReader(data, "state")
        if not reader.has("format"):
            raise StateFormatError(
                "state has no 'format' field: not a loader state from "
                "SavableDataLoader.save_state_rank()"
            )
        if reader.raw("format") == _DROPIN_STATE_FORMAT:
            raise StateMismatchError(
                "the state was saved by a drop-in loader (SavableDataLoader over a plain torch "
                "dataset); this loader runs a savable pipeline (pass the same kind of dataset "
                "the state was saved with)"
            )
        if reader.raw("format") != RANK_STATE_FORMAT:
            raise StateFormatError(
                f"state.format is {reader.raw('format')!r}; expected {RANK_STATE_FORMAT!r} "
                "(is this a loader state from energy_loader.save_state_rank()?)"
            )
        version = reader.int("version")
        if version != RANK_STATE_VERSION:
            raise StateFormatError(
                f"state.version is {version}; this energy_loader reads version "
                f"{RANK_STATE_VERSION} (a state from a newer release?)"
            )
        num_workers = reader.int("num_workers")
        world_size = reader.int("world_size", minimum=1)
        rank = reader.int("rank")
        _below("state.rank", rank, world_size, f"state.world_size {world_size}")
        num_partitions = reader.int("num_partitions", minimum=1)
        if num_partitions % world_size:
            raise StateFormatError(
                f"state.num_partitions {num_partitions} is not a multiple of state.world_size "
                f"{world_size}"
            )
        workers = tuple(
            WorkerSlots.from_reader(StateReader(w, f"state.workers[{i}]"))
            for i, w in enumerate(reader.list("workers"))
        )
        if len(workers) != max(1, num_workers):
            raise StateFormatError(
                f"state.workers has {len(workers)} entries; num_workers={num_workers} needs "
                f"{max(1, num_workers)}"
            )
        raw_partitions = reader.list("partitions")
        partitions = tuple(
            PartitionState.from_reader(StateReader(p, f"state.partitions[{i}]"))
            for i, p in enumerate(raw_partitions)
        )
        _check_partitions(
            workers, partitions, num_partitions // world_size, num_partitions, complete
        )
        next_worker = reader.int("next_worker")
        _below("state.next_worker", next_worker, len(workers), f"the {len(workers)} workers")
        start = reader.int("start")
        _below("state.start", start, num_partitions, f"state.num_partitions {num_partitions}")
        config = reader.raw("config")
        StateReader(config, "state.config")
        check_plain(data, "state")
        state = cls(
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            num_partitions=num_partitions,
            config=config,
            epoch=reader.int("epoch"),
            in_epoch=reader.bool("in_epoch"),
            epoch_ended=reader.bool("epoch_ended"),
            delivered=reader.int("delivered"),
            start=start,
            next_worker=next_worker,
            workers=workers,
            partitions=partitions,
            seed=reader.int("seed"),
            history=read_history(reader),
            **_step_fields(reader),
        )
        entries = [StateReader(p, f"state.partitions[{i}]") for i, p in enumerate(raw_partitions)]
        verified = tuple(e.verify(r.str("check"), r.path) for e, r in zip(partitions, entries))
        state = attrs.evolve(state, partitions=verified)
        if state.position_check() != reader.sub("checks").str("position"):
            raise StateFormatError(
                "state.checks.position does not match the state's fields (rank, world_size, "
                "num_workers, num_partitions, seed, epoch, in_epoch, epoch_ended, delivered, "
                "start, next_worker, workers, job_left, items_left, extra, pieces, history): the "
                "state was edited or damaged after it was saved, or pieces of different saves "
                "were put together; restore from an intact state"
            )
        if state.config_check() != reader.sub("checks").str("config"):
            raise StateFormatError(
                "state.checks.config does not match state.config: the pipeline config was "
                "edited or damaged after the save (an edited batch_size would pass for a "
                "restore with smaller batches); restore from an intact state"
            )
        return state


def _step_fields(reader: StateReader) -> dict[str, Any]:
    """The four step-count fields, or none (a pipeline of unknown length)."""
    present = [name for name in _STEPS if reader.has(name)]
    if not present:
        return {}
    if len(present) != len(_STEPS):
        raise StateFormatError(
            f"state has {', '.join(present)} but not all of {', '.join(_STEPS)} (the count of "
            "the epoch's steps)"
        )
    return {name: reader.int(name) for name in _STEPS}


def _check_partitions(
    workers: tuple[WorkerSlots, ...],
    partitions: tuple[PartitionState, ...],
    per_rank: int,
    num_partitions: int,
    complete: bool = True,
) -> None:
    """Every partition in range, once, held by exactly one worker, as many as a rank runs
    (some of them, when not ``complete``)."""
    listed = [p.partition for p in partitions]
    held = [p for w in workers for p in w.partitions]
    for where, numbers in (("state.partitions", listed), ("state.workers[*].partitions", held)):
        bad = [p for p in numbers if p >= num_partitions]
        if bad:
            raise StateFormatError(f"{where} names partitions {bad} of only {num_partitions}")
        if len(set(numbers)) != len(numbers):
            raise StateFormatError(f"{where} lists a partition twice: {numbers}")
        if len(numbers) != per_rank and (complete or where != "state.partitions"):
            raise StateFormatError(
                f"{where} has {len(numbers)} partitions; a rank of this layout runs {per_rank}"
            )
    if not set(listed) <= set(held) or (complete and sorted(listed) != sorted(held)):
        raise StateFormatError(
            f"state.partitions {sorted(listed)} and the workers' partitions {sorted(held)} differ"
        )
    # Worker w runs every W-th of the rank's partitions from its w-th (partitions.py).
    sizes = [len(w.partitions) for w in workers]
    expected = [len(range(w, per_rank, len(workers))) for w in range(len(workers))]
    if sizes != expected:
        raise StateFormatError(
            f"state.workers run {sizes} partitions; {len(workers)} worker(s) sharing "
            f"{per_rank} run {expected}"
        )


def decode_rank_states(states: Sequence[Any]) -> list[RankState]:
    """Plain rank states (or records decoded already) as records; a ``StateFormatError``
    names the entry of a list that is not a state."""
    out = []
    for index, entry in enumerate(states):
        if isinstance(entry, RankState):
            out.append(entry)
            continue
        try:
            out.append(RankState.from_plain(entry))
        except StateFormatError as error:
            if len(states) == 1:
                raise
            raise StateFormatError(f"states[{index}]: {error}") from None
    return out


# -- one leaf per partition: the layout-independent form of state_dict() ----------------------
#
# A leaf's key is its *slot*: the partition's place in the job's stream counted from the
# saving rank's position (RankState.stream_position). Rank r of R runs partitions
# (B + r + i R) % P from position B, so its slots are r + i R whatever B is: the ranks of one
# save never share a key, and rank r' of any world size R' that restores from position B runs
# exactly the slots r' + i R'. A fresh loader therefore knows the keys it needs before it reads
# anything (the template a torch.distributed.checkpoint load fills), on any layout.

SLOT_KEY_PREFIX = "slot_"


def slot_key(slot: int) -> str:
    """The state_dict key of one slot: ``slot_00003``."""
    return f"{SLOT_KEY_PREFIX}{slot:05d}"


def rank_slots(rank: int, world_size: int, num_partitions: int) -> range:
    """The slots rank ``rank`` of ``world_size`` saves and, from the saved position, runs."""
    return range(rank, num_partitions, world_size)


def is_partition_entries(value: Any) -> bool:
    """A non-empty dict whose keys all name slots."""
    return is_keyed_by(value, (SLOT_KEY_PREFIX,))


def partition_entries(states: list[RankState]) -> dict[str, str]:
    """Every partition as a JSON leaf ``{"rank_state": <header>, "partition": <entry>}`` under its
    slot's key, spliced from encoded parts (``state_dict()`` is on the training loop's path)."""
    out = {}
    for state in states:
        header = state.to_plain(with_partitions=False)
        prefix = '{"rank_state":' + compact_json(header) + ',"partition":'
        for entry in state.partitions:
            out[slot_key(state.slot_of(entry.partition))] = prefix + _entry_json(entry) + "}"
    return out


def _entry_json(entry: PartitionState) -> str:
    """``compact_json(entry.to_plain())``, splicing in the checkpoint JSON its digest brought."""
    if entry.checkpoint_check is None:  # taken in this process: digest and text at once
        entry = attrs.evolve(entry, checkpoint_check=checkpoint_digest(entry.checkpoint))
    text = getattr(entry.checkpoint_check, "text", None)
    plain = entry.to_plain()
    if text is None:  # a digest that came without the text
        return compact_json(plain)
    plain["checkpoint"] = 0
    # The checkpoint is the second field, after an integer: the first match is its own.
    head, _, tail = compact_json(plain).partition(',"checkpoint":0,')
    return f'{head},"checkpoint":{text},{tail}'


def states_from_entries(entries: dict[str, Any], *, complete: bool = True) -> list[RankState]:
    """The rank states :func:`partition_entries` split into leaves (a leaf may be parsed already);
    ``complete=False`` accepts some partitions. ``StateFormatError`` for a bad leaf or key."""
    by_rank: dict[int, dict[str, Any]] = {}
    keys: dict[tuple[int, int], str] = {}
    for key, text in sorted(entries.items()):
        if isinstance(text, dict):  # a leaf parsed already (read from a rank file)
            leaf = text
        elif isinstance(text, str):
            leaf = json_leaf(text, f"state_dict[{key!r}]")
        else:
            raise StateFormatError(
                f"state_dict[{key!r}] must be a JSON string, got {type(text).__name__}"
            )
        reader = StateReader(leaf, f"state_dict[{key!r}]")
        header = reader.raw("rank_state")
        rank = StateReader(header, f"{reader.path}.rank_state").int("rank")
        target = by_rank.setdefault(rank, {**header, "partitions": []})
        if {k: v for k, v in target.items() if k != "partitions"} != header:
            raise StateFormatError(
                f"{reader.path}: the partitions of rank {rank} carry different rank positions "
                "(leaves of different saves mixed?)"
            )
        target["partitions"].append(reader.raw("partition"))
        keys[rank, reader.sub("partition").int("partition")] = key
    states = [RankState.from_plain(by_rank[rank], complete=complete) for rank in sorted(by_rank)]
    for state in states:  # every leaf under its slot's key
        for entry in state.partitions:
            key = keys[state.rank, entry.partition]
            if key != slot_key(state.slot_of(entry.partition)):
                raise StateFormatError(
                    f"state_dict[{key!r}] holds partition {entry.partition} of rank {state.rank}, "
                    f"whose key is {slot_key(state.slot_of(entry.partition))!r} (keys renamed, "
                    "or leaves of different saves mixed?)"
                )
    return states
