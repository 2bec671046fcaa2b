"""The map-style drop-in's index stream and where it stands: what a save records of it and
how a restore re-derives it.

:class:`IndexStream` owns what places the stream -- the user's sampler, the generators that
drive it (:class:`~energy_loader.loader.dropin.sampling.SamplerRng`), the dealing of a
``DistributedSampler``'s permutation (:class:`~energy_loader.loader.dropin.dealing.Dealing`)
-- and runs it in the main process: it opens a fresh epoch's sampler as torch opens the task
stream (:meth:`IndexStream.open`, :meth:`~IndexStream.begin`), pulls its units
(:meth:`~IndexStream.pull`), turns a running epoch into a state
(:meth:`~IndexStream.state_at`) and a saved state back into a running :class:`Epoch`
(:meth:`~IndexStream.resume`). It loads no sample and knows no worker: the engine
(:mod:`.map_style`) runs torch's iterator around it. How one unit is pulled and how a re-run
is checked: :mod:`.position`; how the values of the last batch are checked (a callback the
engine sets, :attr:`IndexStream.values_check`): :mod:`.values`; the training's global
generators: :mod:`.global_rngs`.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils.data import DistributedSampler

from ...errors import StateMismatchError
from ...torch_internals import distributed_permutation
from ..progress import MAX_HELD_BACK
from . import global_rngs
from .dealing import Dealing
from .global_rngs import GlobalsAtSave, GlobalStart, PrivateGlobal
from .position import (
    NOT_REPLAYED,
    Replayed,
    Units,
    own_generators_digest,
    positioned_iterator,
    saved_after_last_batch,
    unit_digest,
    units_per_epoch,
    verify_replay,
)
from .sampling import EpochStart, SamplerRng, stateful_part
from .state import JobStart, MapState, Proof, check_config

_END = object()  # what a pull finds past the epoch's last unit


class Epoch:
    """Where the current epoch's index stream stands (main process)."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.start: EpochStart | None = None
        self.pulled = 0  # units taken from the sampler
        self.used = 0  # units handed out (or failed) to the user
        self.exhausted = False
        self.ended = False  # its iterator reported the end (StopIteration)
        # A restored epoch: the positioned sampler iterator, and the loader's own generator
        # states to put back at the first pull (after the engine drew its base seed).
        self.resume: tuple[Units, list[torch.Tensor]] | None = None
        # A Stateful sampler's state_dict() after each unit pulled (by units pulled).
        self.snapshots: dict[int, Any] = {}
        # The base of the epoch's per-sample seeds, and the sampler's own stream of torch's
        # global generator (epochs >= 1 of a loader without a generator, or a pinned start
        # whose generators moved; global_rngs.py).
        self.seed = 0
        self.private: PrivateGlobal | None = None
        # Under a DistributedSampler: its epoch, the dealing of the permutation this epoch
        # runs, and that dealing's units per rank (dealing.Dealing).
        self.sampler_epoch = 0
        self.dealing: Dealing | None = None
        self.units: int | None = None
        self.distributed_plain: tuple[Dealing, dict[str, int]] | None = None
        self.resumed = False  # continues a restored state's epoch (not a fresh one)
        # The self-check's record (state.Proof): the units pulled and not yet long handed
        # out, as (number, unit), and the digest of the sampler's generators at the epoch's
        # end ("" until then).
        self.recent: collections.deque[tuple[int, Any]] = collections.deque()
        # The digest of each unit's values as collated where it was made (values.py), by
        # number, from the moment its result arrives until it is long handed out.
        self.made: dict[int, str] = {}
        self.end_proof = ""
        self.proven: tuple[int, Proof] | None = None  # the last proof made, by units used
        # A fresh epoch's sampler iterator and what its iter() drew (torch's generators before
        # it, and python's or numpy's global RNG where it moved them: global_rngs.py), until
        # the first unit is pulled (MapEngine.begin).
        self.iterator: Units | None = None
        self.at_iter: list[torch.Tensor] | None = None
        self.global_at_iter: dict[str, Any] = {}
        self.begun = False
        # How many times the job's torch iterator calls iter(sampler) in this epoch (a fresh
        # epoch: JobStart.iter_calls), and how many times this loader called it.
        self.iter_calls = 1
        self.iters = 0
        # The global RNGs a pinned start found elsewhere than at the save: the sampler must not
        # draw from them (global_rngs.GlobalsAtSave).
        self.globals_at_save: GlobalsAtSave | None = None

    def note_made(self, first: int, made: tuple[str, ...] | None) -> None:
        """Record the digests of the values of units ``first``, ``first + 1``, ... as made."""
        if made:
            for number, digest in enumerate(made, first):
                self.made[number] = digest

    def hand_out(self) -> None:
        """Count a unit handed out (or failed), and forget the records of units handed out
        longer ago than a save may reach back (``held_back``)."""
        self.used += 1
        recent, used = self.recent, self.used
        while recent and recent[0][0] < used - MAX_HELD_BACK - 1:
            recent.popleft()
        made = self.made
        while made and (oldest := next(iter(made))) < used - MAX_HELD_BACK - 1:
            del made[oldest]
        snapshots = self.snapshots
        if snapshots:
            for number in [n for n in snapshots if n < used - MAX_HELD_BACK]:
                del snapshots[number]

    def sampling(self) -> contextlib.AbstractContextManager[Any]:
        """The context the sampler draws in: its private global stream, if it has one."""
        return self.private if self.private is not None else contextlib.nullcontext()


class IndexStream:
    """The loader's index stream, owned by the engine: its sampler and generators, what a position
    of it is, and how a saved one is re-derived (``length``: the sampler's ``len()`` or None;
    ``code``: the user code's fingerprints a state records)."""

    def __init__(
        self,
        index_sampler: Any,
        rng: SamplerRng,
        *,
        length: int | None,
        config: dict[str, Any],
        code: dict[str, Any],
        unit_size: int,
        drop_last: bool,
        verify: bool,
    ) -> None:
        # A restore's check of the last batch's values (values.py; set by the engine), given
        # the state and the saving loader's last unit once the re-run proved its indices.
        self.values_check: Callable[[MapState, Any], None] | None = None
        self.index_sampler = index_sampler
        self.rng = rng
        self.length = length
        self.config = config
        self.code = code  # the user code's fingerprints (state.code)
        self.unit_size = unit_size
        self.drop_last = drop_last
        self.verify = verify
        self.stateful = stateful_part(index_sampler)
        self.distributed = distributed_part(index_sampler)
        # The global RNGs the sampler may draw from unseen, watched at each epoch's start.
        self.watched = global_rngs.watched(rng.uses_global)

    # -- a fresh epoch's stream ----------------------------------------------------------------

    def open(self, epoch: Epoch) -> None:
        """The sampler's iterator as torch opens the epoch's task stream (it may open it
        twice, as the job's iterator calls ``iter(sampler)``: ``epoch.iter_calls``)."""
        if epoch.resume is not None:
            epoch.iterator = epoch.resume[0]
            return
        private = epoch.private
        if private is not None:
            private.pay_base_draw()  # torch drew its base seed after the stream it opened last
        if epoch.iterator is None or epoch.iters < epoch.iter_calls:
            self.call_iter(epoch)
        # (else the job's iterator called iter(sampler) no more: this stream reuses the last)
        if private is not None:
            private.torch_opened_stream()  # torch draws its base seed right after

    def call_iter(self, epoch: Epoch) -> None:
        """Call ``iter(sampler)`` for a fresh epoch, noting what that call drew: the
        generators' states before it, where it moved them, and the global RNGs it moved."""
        rng = self.rng
        drawn = global_rngs.DrawnGlobals(self.watched)
        with epoch.sampling():
            before = rng.capture() if rng.draws else None
            iterator = Units(iter(self.index_sampler), 0, self.length)
            at_iter = None
            if before is not None and any(
                not torch.equal(a, b) for a, b in zip(before, rng.capture())
            ):
                at_iter = before  # iter(sampler) itself drew random numbers
        epoch.iterator, epoch.at_iter = iterator, at_iter
        epoch.global_at_iter = drawn.before_moved()
        epoch.iters += 1

    def begin(self, epoch: Epoch) -> None:
        """Once an epoch, before its first unit goes anywhere (after the base-seed draw is settled):
        put a restored epoch's generators back, or run ``iter(sampler)`` as the job did and capture
        the fresh epoch's start and first unit, noting the global RNGs it moved."""
        if epoch.resume is not None:
            self.rng.put_own(epoch.resume[1])
        else:
            if epoch.private is not None:
                epoch.private.pay_base_draw()
            while epoch.iters < epoch.iter_calls:
                self.call_iter(epoch)
            iterator = epoch.iterator
            assert iterator is not None  # (call_iter ran)
            epoch.start = start = self.capture_start(epoch, epoch.at_iter)
            self.snapshot_sampler(epoch)
            drawn = global_rngs.DrawnGlobals(self.watched)
            with epoch.sampling():
                iterator.peek()
            first_pull = drawn.before_moved()
            if first_pull or epoch.global_at_iter:
                start.global_start = GlobalStart(epoch.global_at_iter, first_pull)
                if epoch.globals_at_save is not None:
                    epoch.globals_at_save.check(start.global_start.names, self.config["sampler"])
        if epoch.dealing is None and self.distributed is not None:
            self.deal_as_the_sampler(epoch, self.distributed)

    def snapshot_sampler(self, epoch: Epoch) -> None:
        """A Stateful sampler's ``state_dict()`` after the units pulled so far (once)."""
        if self.stateful is not None and epoch.pulled not in epoch.snapshots:
            epoch.snapshots[epoch.pulled] = self.stateful.state_dict()

    def pull(self, epoch: Epoch, count: int) -> list[Any]:
        """Up to ``count`` units of the epoch (fewer at its end), pulled in the epoch's own
        stream, each kept for the proof (and a Stateful sampler's snapshot after it); at the
        epoch's end, the digest of the sampler's own generators (``end_proof``)."""
        iterator = epoch.iterator
        assert iterator is not None
        units = []
        with epoch.sampling():
            for _ in range(count):
                unit = next(iterator, _END)
                if unit is _END:
                    break
                units.append(unit)
                epoch.recent.append((epoch.pulled, unit))
                epoch.pulled += 1
                self.snapshot_sampler(epoch)
            if iterator.ended and not epoch.end_proof:
                epoch.end_proof = own_generators_digest(self.rng, self.rng.capture()) or "-"
        return units

    def state_at(
        self, epoch: Epoch, used: int, *, rank: int, world_size: int, job: JobStart
    ) -> MapState:
        """The position after ``used`` units of ``epoch`` (begun), as a state."""
        start = epoch.start
        assert start is not None
        drawn = start.global_start
        sampler_state = None
        if self.stateful is not None:
            if used not in epoch.snapshots:
                held_back = epoch.used - used
                raise ValueError(f"held_back={held_back} reaches further back than recorded")
            sampler_state = epoch.snapshots[used]
        return MapState(
            rank=rank,
            world_size=world_size,
            config=self.config,
            started=True,
            epoch=epoch.number,
            used=used,
            job=job,
            start=start,
            sampler_state=sampler_state,
            distributed=self.dealing_record(epoch),
            proof=self.proof_at(epoch, used),
            global_rngs_at_save=None if drawn is None else global_rngs.digests_now(drawn.names),
            code=self.code,
        )

    # -- a restored epoch ----------------------------------------------------------------------

    def resume(self, state: MapState) -> Epoch:
        """The saved epoch positioned after its used units, or, if none are left, the next
        epoch with the sampler's generators where the saved one left them."""
        if self.needs_dealing(state):
            return self._resume_dealt(state)
        start = state.start
        saved, sampler = state.distributed, self.distributed
        user_epoch = 0 if sampler is None else int(sampler.epoch)
        if saved is not None and sampler is not None:
            # The saved epoch is the sampler epoch's permutation, whatever set_epoch() the
            # restarted script called before this iter() (as a resized restore deals it).
            sampler.set_epoch(saved["epoch"])
        replayed = positioned_iterator(
            self.index_sampler, self.rng, start, state.used, state.sampler_state, self.length
        )
        own_last = replayed.last  # this rank's unit `used - 1`, if one was re-made
        if self.verify:
            other_rank = saved is not None and saved["rank"] != self.distributed_rank
            if other_rank and state.used:
                # Any rank's state restores every rank: check the saving rank's batch.
                replayed = attrs.evolve(replayed, last=self._saving_rank_unit(state))
            verify_replay(state, replayed, self.rng, self.config["sampler"])
            if self.values_check is not None and replayed.last is not NOT_REPLAYED:
                self.values_check(state, replayed.last)
        iterator, after = replayed.iterator, replayed.after
        if iterator is None:
            if sampler is not None:  # the next epoch is the one the script set
                sampler.set_epoch(user_epoch)
            self.rng.put_own(after)
            return Epoch(state.epoch + 1)
        epoch = Epoch(state.epoch)
        if state.used and own_last is not NOT_REPLAYED:  # for the next save's proof
            epoch.recent.append((state.used - 1, own_last))
            if state.proof.made and own_last is replayed.last:  # (the saving rank's unit)
                epoch.made[state.used - 1] = state.proof.made
        epoch.resumed = True
        epoch.start = start
        epoch.pulled = epoch.used = state.used
        epoch.resume = (iterator, after)
        if global_rngs.draws_in_own_stream(self.rng, state.epoch):
            epoch.private = PrivateGlobal(after[0])
        if self.stateful is not None:
            epoch.snapshots[state.used] = state.sampler_state
        if saved is not None:
            epoch.sampler_epoch = saved["epoch"]
            epoch.dealing = Dealing(saved["offset"], saved["end"], saved["world"])
            epoch.units = self.length
        return epoch

    @property
    def distributed_rank(self) -> int | None:
        """This loader's rank in its ``DistributedSampler`` (None without one)."""
        return None if self.distributed is None else int(self.distributed.rank)

    def _saving_rank_unit(self, state: MapState, permutation: list[int] | None = None) -> Any:
        """The last unit the rank that saved ``state`` handed out, from its dealing of the
        epoch's permutation (a DistributedSampler's state restores every rank)."""
        saved, sampler = state.distributed, self.distributed
        assert saved is not None and sampler is not None
        if permutation is None:
            permutation = distributed_permutation(
                sampled_length(sampler), sampler.shuffle, sampler.seed, saved["epoch"]
            )
        indices = Dealing(saved["offset"], saved["end"], saved["world"]).indices(
            permutation, saved["rank"]
        )
        size = state.config.get("batch_size")
        if size is None:
            return indices[state.used - 1] if state.used <= len(indices) else None
        return indices[(state.used - 1) * size : state.used * size]

    def deal_as_the_sampler(self, epoch: Epoch, sampler: DistributedSampler[Any]) -> None:
        """The epoch is the sampler's own dealing (set before its first pull)."""
        epoch.sampler_epoch = int(sampler.epoch)
        end = sampler.total_size if sampler.drop_last else sampled_length(sampler)
        epoch.dealing = Dealing(0, end, sampler.num_replicas)
        epoch.units = self.length

    def needs_dealing(self, state: MapState) -> bool:
        """Whether ``state`` continues on a new dealing of its epoch's permutation: saved under
        a DistributedSampler on another world size or batch size, or already dealt anew."""
        saved = state.distributed
        if saved is None or self.distributed is None or not state.started:
            return False
        return (
            saved["offset"] > 0
            or saved["world"] != self.distributed.num_replicas
            or state.config.get("batch_size") != self.config["batch_size"]
        )

    def _resume_dealt(self, state: MapState) -> Epoch:
        """The saved epoch continued from the job's position, its rest dealt to this layout."""
        saved = state.distributed
        assert saved is not None and self.distributed is not None
        sampler = self.distributed
        old = Dealing(saved["offset"], saved["end"], saved["world"])
        saved_unit = state.config.get("batch_size") or 1
        consumed = min(state.used * saved_unit, old.per_rank())
        dealing = old.continued(consumed, sampler.num_replicas)
        permutation = distributed_permutation(
            sampled_length(sampler), sampler.shuffle, sampler.seed, saved["epoch"]
        )
        units = units_of(dealing.indices(permutation, sampler.rank), self)
        if self.verify and state.used:
            replayed = Replayed(None, [], self._saving_rank_unit(state, permutation))
            verify_replay(state, replayed, self.rng, self.config["sampler"])
            if self.values_check is not None:
                self.values_check(state, replayed.last)
        saved_states = state.start.states
        if saved_states is not None:  # the loader's generator as the saving job left it
            self.rng.put_own(saved_states)
        # Saved after its epoch's last batch: the next epoch (a drop_last batching may have
        # left indices of the saving dealing unused; they stay unused, as they would have).
        if not units or saved_after_last_batch(state):
            return Epoch(state.epoch + 1)
        epoch = Epoch(state.epoch)
        epoch.resumed = True
        epoch.start = EpochStart(state.epoch, None, None)
        epoch.resume = (Units(iter(units), 0, len(units)), self.rng.capture())
        epoch.sampler_epoch = saved["epoch"]
        epoch.dealing = dealing
        epoch.units = len(units)
        return epoch

    def capture_start(self, epoch: Epoch, at_iter: list[torch.Tensor] | None) -> EpochStart:
        """The generators' states before the sampler's first pull (in its own stream)."""
        if not self.rng.recorded:
            return EpochStart(epoch.number, None, None)
        with epoch.sampling():
            states = self.rng.capture()
        return EpochStart(epoch.number, states, at_iter)

    def proof_at(self, epoch: Epoch, used: int) -> Proof:
        """What a restore of the position after ``used`` units checks itself against."""
        proven = epoch.proven
        if proven is not None and proven[0] == used:
            return proven[1]
        last = made = ""
        if used:
            first = epoch.recent[0][0] if epoch.recent else used
            if first <= used - 1:
                last = unit_digest(epoch.recent[used - 1 - first][1])
                made = epoch.made.get(used - 1, "")
        units = self.length if epoch.units is None else epoch.units
        end = epoch.end_proof if used == units and epoch.end_proof != "-" else ""
        proof = Proof(last, end, made)
        epoch.proven = (used, proof)
        return proof

    def dealing_record(self, epoch: Epoch) -> dict[str, int] | None:
        if epoch.dealing is None:
            if self.distributed is None:
                return None
            self.deal_as_the_sampler(epoch, self.distributed)  # iter() made, nothing pulled
        dealing, sampler = epoch.dealing, self.distributed
        assert dealing is not None and sampler is not None
        cached = epoch.distributed_plain
        if cached is None or cached[0] is not dealing:  # once a dealing (so JSON is cached)
            plain = {
                "epoch": int(epoch.sampler_epoch),
                "offset": dealing.offset,
                "end": dealing.end,
                "world": dealing.world,
                "units": -1 if epoch.units is None else epoch.units,
                "rank": int(sampler.rank),  # the saving rank of the dealing
            }
            cached = epoch.distributed_plain = (dealing, plain)
        return cached[1]


def distributed_config(index_sampler: Any) -> dict[str, Any]:
    """A DistributedSampler's settings (its rank is the layout's, not the job's)."""
    sampler = distributed_part(index_sampler)
    if sampler is None:
        return {}
    return {
        "num_replicas": sampler.num_replicas,
        "distributed": {
            "shuffle": bool(sampler.shuffle),
            "seed": int(sampler.seed),
            "drop_last": bool(sampler.drop_last),
        },
    }


def units_of(indices: list[int], stream: IndexStream) -> list[Any]:
    """A rank's indices as the loader's units: batches of ``batch_size`` (the last one
    dropped if short and ``drop_last``), or the indices themselves without batching."""
    if stream.config["batch_size"] is None:
        return list(indices)
    size = stream.unit_size
    units = [indices[i : i + size] for i in range(0, len(indices), size)]
    if units and stream.drop_last and len(units[-1]) < size:
        units.pop()
    return units


def sampled_length(sampler: DistributedSampler[Any]) -> int:
    return len(sampler.dataset)  # type: ignore[arg-type]  # DistributedSampler needs a len()


def distributed_part(index_sampler: Any) -> DistributedSampler[Any] | None:
    """The ``DistributedSampler`` of the sampler chain (a batch sampler's inner one), or None."""
    for sampler in (index_sampler, getattr(index_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def check_restorable(state: MapState, stream: IndexStream) -> None:
    """Raise ``StateMismatchError`` for a state this loader's stream cannot continue."""
    # A DistributedSampler job's position restores any layout; one saved before its first
    # iter() has nothing dealt yet, so it restores any layout as it is.
    unstarted_distributed = (
        not state.started and stream.distributed is not None and "distributed" in state.config
    )
    if stream.needs_dealing(state) or unstarted_distributed:
        check_config(
            {k: v for k, v in state.config.items() if k not in _DEALT_FREELY},
            {k: v for k, v in stream.config.items() if k not in _DEALT_FREELY},
        )
    else:
        check_config(state.config, stream.config)
    units = units_per_epoch(state)
    if state.started and units is not None and state.used > units:
        raise StateMismatchError(
            f"state.used is {state.used}, but an epoch of the saving loader had {units} "
            "batches: the position lies outside the epoch (an edited or foreign state). "
            "Restore a state this loader's setup saved, as it saved it"
        )
    for states in (state.start.states, state.start.at_iter):
        if states is not None and len(states) != len(stream.rng.generators):
            raise stream.rng.count_mismatch(len(states))


def point_at_rank(sampler: DistributedSampler[Any], rank: int, num_replicas: int) -> None:
    """Set a ``DistributedSampler`` to ``rank`` of ``num_replicas``, its ``num_samples`` and
    ``total_size`` computed as its constructor computes them."""
    size = sampled_length(sampler)
    if sampler.drop_last and size % num_replicas:
        sampler.num_samples = math.ceil((size - num_replicas) / num_replicas)
    else:
        sampler.num_samples = math.ceil(size / num_replicas)
    sampler.total_size = sampler.num_samples * num_replicas
    sampler.num_replicas, sampler.rank = num_replicas, rank


# What may differ when a DistributedSampler job continues on another layout or batch size.
_DEALT_FREELY = ("batches_per_epoch", "batch_size", "num_replicas")
