"""The drop-in loader: torch's batches for torch's arguments, and exact resume at every stop."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    get_worker_info,
)

import energy_loader as el
from energy_loader.errors import StateFormatError, StateMismatchError
from energy_loader.loader.dropin import job as dropin_job
from energy_loader.loader.dropin import map_style
from energy_loader.loader.dropin import restore as dropin_restore
from energy_loader.loader.dropin.build import runs_dropin
from energy_loader.loader.dropin.state import MapState

from .dropin_helpers import (
    Augmenting,
    Dicts,
    Sharded,
    StatefulSampler,
    StatefulSharded,
    assert_same,
    plain_roundtrip,
    run_epochs,
    stop_and_resume,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

TENSORS = TensorDataset(torch.arange(23).float(), torch.arange(23))


def _both(make: Any, epochs: int = 2, seed: int = 0) -> tuple[list[Any], list[Any]]:
    torch.manual_seed(seed)
    theirs = run_epochs(make(DataLoader), epochs)
    torch.manual_seed(seed)
    ours_loader = make(el.SavableDataLoader)
    assert runs_dropin(ours_loader)
    assert isinstance(ours_loader, el.SavableDataLoader)
    if not isinstance(ours_loader.dataset, IterableDataset):
        assert len(ours_loader) == len(make(DataLoader))
    return run_epochs(ours_loader, epochs), theirs


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "arguments",
    [
        {"batch_size": 4, "shuffle": True},
        {"batch_size": 5, "drop_last": True},
        {"batch_size": None},
        {"batch_size": 3, "sampler": WeightedRandomSampler([1.0] * 23, 17)},
        {"batch_size": 3, "sampler": SubsetRandomSampler(range(3, 20))},
        {"batch_sampler": BatchSampler(RandomSampler(range(23)), 4, drop_last=False)},
        {"batch_size": 4, "collate_fn": lambda samples: [s[1] * 2 for s in samples]},
    ],
    ids=["shuffle", "drop_last", "unbatched", "weighted", "subset", "batch_sampler", "collate"],
)
def test_yields_what_torch_yields(workers: int, arguments: dict[str, Any]) -> None:
    """Every epoch is torch's, but for a sampler that draws from torch's global generator
    (no ``generator=``): from the second epoch on it draws from the job's own stream."""
    ours, theirs = _both(lambda cls: cls(TENSORS, num_workers=workers, **arguments))
    draws_from_global = (
        "shuffle" in arguments or "sampler" in arguments or ("batch_sampler" in arguments)
    )
    if draws_from_global:
        first = len(DataLoader(TENSORS, **arguments))
        assert_same(ours[:first], theirs[:first])
        assert len(ours) == len(theirs)
    else:
        assert_same(ours, theirs)


@pytest.mark.parametrize("persistent", [False, True])
def test_yields_what_torch_yields_with_a_generator_and_dict_samples(persistent: bool) -> None:
    def make(cls: Any) -> Any:
        generator = torch.Generator().manual_seed(7)
        return cls(
            Dicts(19),
            batch_size=4,
            shuffle=True,
            generator=generator,
            num_workers=2,
            persistent_workers=persistent,
        )

    ours, theirs = _both(make, epochs=3)
    assert_same(ours, theirs)


def test_distributed_sampler_with_set_epoch_yields_what_torch_yields() -> None:
    def run(cls: Any) -> list[Any]:
        sampler = DistributedSampler(TENSORS, num_replicas=2, rank=1, shuffle=True, seed=4)
        loader = cls(TENSORS, batch_size=3, sampler=sampler, num_workers=1)
        out = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            out.extend(loader)
        return out

    assert_same(run(el.SavableDataLoader), run(DataLoader))


def test_tuple_samples_come_as_lists_as_torch_gives_them() -> None:
    (batch,) = list(el.SavableDataLoader(TensorDataset(torch.arange(3)), batch_size=3))
    assert type(batch) is list


@pytest.mark.parametrize(
    ("workers", "resume_workers", "persistent"),
    # Two of the four layouts in the slow set: the drawn model (test_dropin_properties) draws
    # 0-3 workers, another count on restart and persistent workers in the default run too.
    [
        (0, 0, False),
        pytest.param(2, 1, False, marks=pytest.mark.slow),
        (0, 2, False),
        pytest.param(1, 2, True, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("with_generator", [False, True])
def test_resumes_exactly_at_every_stop(
    workers: int, resume_workers: int, persistent: bool, with_generator: bool
) -> None:
    """Before the first batch, mid-epoch, after an epoch's last batch: the rest is the same,
    random augmentation (python, numpy, torch) included, on another num_workers too."""

    def make(num_workers: int) -> el.SavableDataLoader:
        generator = torch.Generator().manual_seed(11) if with_generator else None
        return el.SavableDataLoader(
            Augmenting(11),
            batch_size=3,
            shuffle=True,
            generator=generator,
            num_workers=num_workers,
            persistent_workers=persistent and num_workers > 0,
        )

    stops = range(0, 13) if workers == resume_workers == 0 else [0, 2, 4, 5, 8]
    for stop in stops:
        stop_and_resume(make, workers, resume_workers, stop, epochs=3)


def test_augmentation_is_reproduced_after_a_restore_and_differs_between_epochs() -> None:
    loader = el.SavableDataLoader(Augmenting(6), batch_size=2, shuffle=True, num_workers=2)
    first, second = run_epochs(loader, 1), run_epochs(loader, 1)
    assert not torch.equal(first[0]["torch"], second[0]["torch"])


def test_seed_per_sample_off_leaves_augmentation_to_the_workers_seeds() -> None:
    loader = el.SavableDataLoader(Augmenting(4), batch_size=2, seed_per_sample=False)
    assert loader.seed_per_sample is False
    run_epochs(loader, 1)


def test_a_stateful_sampler_is_saved_through_its_state_dict() -> None:
    def make(num_workers: int) -> el.SavableDataLoader:
        return el.SavableDataLoader(
            TENSORS, batch_size=4, sampler=StatefulSampler(23, seed=5), num_workers=num_workers
        )

    loader = make(0)
    iterator = iter(loader)
    next(iterator)
    state = loader.save_state_rank()
    assert state["sampler_state"]["position"] == 4
    for stop in [0, 3, 6, 7]:
        stop_and_resume(make, 0, 1, stop, epochs=2)


def test_the_training_process_global_rng_is_not_changed_by_a_restore() -> None:
    loader = el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    restored = el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True)
    restored.load_state_dict(state)
    next(iter(restored))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("dataset_class", [Sharded, StatefulSharded])
# 3 workers: slow. 2 workers split the 11 samples unevenly too (each worker batches and drops
# its own rest, as torch's do).
@pytest.mark.parametrize("workers", [0, 2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("arguments", [{"batch_size": 3}, {"batch_size": 2, "drop_last": True}])
def test_iterable_datasets_yield_what_torch_yields_and_resume(
    dataset_class: type, workers: int, arguments: dict[str, Any]
) -> None:
    ours, theirs = _both(lambda cls: cls(dataset_class(11), num_workers=workers, **arguments))
    assert_same(ours, theirs)

    def make(num_workers: int) -> el.SavableDataLoader:
        return el.SavableDataLoader(dataset_class(11), num_workers=num_workers, **arguments)

    for stop in [0, 1, len(ours) // 2, len(ours) // 2 + 1]:
        stop_and_resume(make, workers, workers, stop, epochs=2)


def test_an_iterable_state_restores_on_the_same_num_workers_only() -> None:
    loader = el.SavableDataLoader(Sharded(8), batch_size=2, num_workers=2)
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    with pytest.raises(StateMismatchError, match="num_workers=2"):
        el.SavableDataLoader(Sharded(8), batch_size=2, num_workers=1).load_state_dict(state)


def test_states_are_plain_data() -> None:
    loader = el.SavableDataLoader(
        TENSORS, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    iterator = iter(loader)
    next(iterator)
    state = loader.save_state_rank()
    assert json.loads(json.dumps(state)) == state
    assert plain_roundtrip(state) == state
    assert state["format"] == "energy_loader.dropin_state"
    # state_dict(): the same state as one JSON leaf under this rank's key (for DCP).
    entries = loader.state_dict()
    assert list(entries) == ["rank_00000"] and json.loads(entries["rank_00000"]) == state
    rest = list(iterator)
    for given in (state, entries):
        restored = el.SavableDataLoader(
            TENSORS, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
        restored.load_state_dict(plain_roundtrip(given))
        assert_same(list(restored), rest)


def test_bad_states_and_mismatches_are_refused_with_the_loader_unchanged() -> None:
    loader = el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True)
    next(iter(loader))
    state, entries = loader.save_state_rank(), loader.state_dict()
    other = el.SavableDataLoader(TENSORS, batch_size=5, shuffle=True)
    for given in (state, entries):
        with pytest.raises(StateMismatchError, match="batch_size"):
            other.load_state_dict(given)
    with pytest.raises(StateFormatError):
        other.load_state_dict({"format": "something else"})
    with pytest.raises(StateFormatError):
        other.load_state_dict({**state, "version": 99})
    with pytest.raises(StateFormatError, match=r"state_dict\['rank_00000'\] is not valid JSON"):
        other.load_state_dict({"rank_00000": entries["rank_00000"][:-5]})
    with pytest.raises(StateFormatError, match="holds the state of rank 0; each rank's state"):
        other.load_state_dict({"rank_00001": entries["rank_00000"]})
    pipeline_state = el.SavableDataLoader(el.IndexedSource(list(range(4)))).state_dict()
    with pytest.raises((StateMismatchError, StateFormatError)):
        other.load_state_dict(pipeline_state)
    assert len(list(other)) == len(other)


def _shuffled_state(**arguments: Any) -> dict[str, Any]:
    loader = el.SavableDataLoader(TENSORS, batch_size=4, **arguments)
    next(iter(loader))
    return plain_roundtrip(loader.save_state_rank())


def _flip_a_byte(text: str) -> str:
    raw = bytearray(base64.b64decode(text))
    raw[100] ^= 0x01
    return base64.b64encode(bytes(raw)).decode("ascii")


@pytest.mark.parametrize(
    ("saved", "now", "field"),
    [
        ({"shuffle": True}, {"shuffle": False}, "sampler"),
        ({"shuffle": False}, {"shuffle": True}, "sampler"),
        ({"shuffle": True, "generator": True}, {"shuffle": True}, "generators"),
        ({"shuffle": True}, {"shuffle": True, "generator": True}, "generators"),
    ],
)
def test_a_state_of_another_sampling_setup_is_refused_naming_the_field(
    saved: dict[str, Any], now: dict[str, Any], field: str
) -> None:
    def arguments(spec: dict[str, Any]) -> dict[str, Any]:
        out = {"shuffle": spec["shuffle"]}
        if spec.get("generator"):
            out["generator"] = torch.Generator().manual_seed(3)
        return out

    state = _shuffled_state(**arguments(saved))
    loader = el.SavableDataLoader(TENSORS, batch_size=4, **arguments(now))
    with pytest.raises(StateMismatchError, match=field):
        loader.load_state_dict(state)


@pytest.mark.parametrize(
    ("edit", "error", "field"),
    [
        (lambda s: s["job"].update(seed=s["job"]["seed"] + 1), StateFormatError, "state.job"),
        (lambda s: s["rng"].__setitem__(0, _flip_a_byte(s["rng"][0])), StateFormatError, "rng"),
        (lambda s: s["rng"].__setitem__(0, s["rng"][0][:4000]), StateFormatError, "bytes"),
        (lambda s: s["rng"].__setitem__(0, "not base64!"), StateFormatError, "base64"),
        (lambda s: s.update(epoch=-1), StateFormatError, "state.epoch"),
        (lambda s: s.pop("digest"), StateFormatError, "digest"),
    ],
    ids=[
        "job_seed",
        "flipped_generator_byte",
        "truncated_generator",
        "not_base64",
        "epoch",
        "digest",
    ],
)
def test_an_edited_or_damaged_state_is_refused_at_load_with_the_loader_unchanged(
    edit: Any, error: type[Exception], field: str
) -> None:
    reference = el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True)
    expected = list(reference)
    state = _shuffled_state(shuffle=True)
    edit(state)
    torch.manual_seed(0)
    loader = el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True)
    with pytest.raises(error, match=field):
        loader.load_state_dict(state)
    torch.manual_seed(0)
    assert len(list(loader)) == len(expected)  # a fresh epoch, as if nothing was loaded


def test_a_pipeline_state_given_to_a_drop_in_loader_is_named_as_such() -> None:
    pipeline = el.SavableDataLoader(el.IndexedSource(list(range(4))))
    next(iter(pipeline))
    for state in (pipeline.state_dict(), pipeline.save_state_rank()):
        with pytest.raises(StateMismatchError, match="savable pipeline"):
            el.SavableDataLoader(TENSORS, batch_size=4).load_state_dict(state)


def test_under_a_distributed_sampler_any_ranks_state_restores_every_rank() -> None:
    """The ranks advance in lockstep, so rank 0's state (what Lightning keeps) is rank 1's."""

    def make(rank: int) -> el.SavableDataLoader:
        sampler = DistributedSampler(TENSORS, num_replicas=2, rank=rank, seed=5)
        config = el.WorkerConfig(rank=rank, world_size=2, num_workers=0)
        return el.SavableDataLoader(TENSORS, batch_size=3, sampler=sampler, worker_config=config)

    uninterrupted = list(make(1))
    saving = make(0)
    iterator = iter(saving)
    next(iterator)
    next(iterator)
    restored = make(1)
    restored.load_state_dict(plain_roundtrip(saving.state_dict()))
    assert_same(list(restored), uninterrupted[2:])
    other_world = el.SavableDataLoader(
        TENSORS, batch_size=3, sampler=DistributedSampler(TENSORS, num_replicas=3, rank=1)
    )
    with pytest.raises(StateMismatchError):
        other_world.load_state_dict(saving.state_dict())


def test_torch_argument_errors_are_torchs() -> None:
    with pytest.raises(ValueError, match="expected unspecified shuffle option"):
        el.SavableDataLoader(Sharded(4), shuffle=True)
    with pytest.raises(ValueError, match="mutually exclusive"):
        el.SavableDataLoader(TENSORS, batch_size=2, batch_sampler=[[0, 1]])
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        el.SavableDataLoader(TENSORS, shuffle=True, sampler=SequentialSampler(TENSORS))
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        el.SavableDataLoader(TENSORS, num_workers=-1)
    with pytest.raises(TypeError, match="seed_per_sample"):
        el.SavableDataLoader(TENSORS, seed_per_sample="yes")


def test_attributes_mean_what_they_mean_on_torchs_loader() -> None:
    collate = torch.utils.data.default_collate
    loader = el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True, num_workers=2)
    theirs = DataLoader(TENSORS, batch_size=4, shuffle=True, num_workers=2)
    for name in ("batch_size", "drop_last", "num_workers", "prefetch_factor", "timeout"):
        assert getattr(loader, name) == getattr(theirs, name), name
    assert loader.dataset is TENSORS and loader.collate_fn is collate
    assert type(loader.sampler) is RandomSampler and type(loader.batch_sampler) is BatchSampler
    assert repr(el.SavableDataLoader(TENSORS).batch_size) == "1"


class _Configured(IterableDataset[Any]):
    """Configures itself in worker_init_fn through get_worker_info().dataset (torch's idiom)."""

    def __init__(self) -> None:
        self.shard: int | None = None

    def __iter__(self) -> Any:
        yield from range(100 * (self.shard or 0), 100 * (self.shard or 0) + 3)


def _configure(worker_id: int) -> None:
    info = get_worker_info()
    info.dataset.shard = info.id + 1


def test_worker_init_fn_sees_the_users_dataset() -> None:
    ours = sorted(el.SavableDataLoader(_Configured(), num_workers=2, worker_init_fn=_configure))
    theirs = sorted(DataLoader(_Configured(), num_workers=2, worker_init_fn=_configure))
    assert [int(x) for x in ours] == [int(x) for x in theirs] == [100, 101, 102, 200, 201, 202]

    class Reads(Dataset[Any]):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int) -> int:
            info = get_worker_info()
            return int(info is not None and isinstance(info.dataset, Reads))

    assert [int(b) for b in el.SavableDataLoader(Reads(), num_workers=1)] == [1, 1]


def test_an_error_in_getitem_comes_after_the_batches_before_it() -> None:
    class Failing(Dataset[Any]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> int:
            if index == 5:
                raise KeyError("five")
            return index

    for workers in (0, 1):
        got = []
        loader = el.SavableDataLoader(Failing(), batch_size=2, num_workers=workers)
        with pytest.raises(KeyError, match="five"):
            for batch in loader:
                got.append(batch.tolist())
        assert got == [[0, 1], [2, 3]]
        loader.close()


def test_savable_pipeline_takes_torch_batching_arguments_or_refuses_them() -> None:
    source = el.IndexedSource(list(range(10)))
    batched = list(el.SavableDataLoader(source, batch_size=4, drop_last=True))
    assert [b.tolist() for b in batched] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [int(x) for x in el.SavableDataLoader(el.IndexedSource(list(range(3))))] == [0, 1, 2]
    with pytest.raises(ValueError, match="ShuffleBufferDataset"):
        el.SavableDataLoader(source, shuffle=True)
    with pytest.raises(ValueError, match="does not apply to a savable pipeline"):
        el.SavableDataLoader(source, sampler=SequentialSampler(range(10)))
    with pytest.raises(ValueError, match="needs a `batch_size`"):
        el.SavableDataLoader(source, drop_last=True)


def test_save_and_restore_global_on_the_same_world_size() -> None:
    loader = el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    states = loader.save_state_global(0)
    assert states is not None and len(states) == 1
    restored = el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True)
    restored.restore_state_global(states)
    assert_same(list(restored), list(iterator))
    two = []
    for rank in range(2):  # a 2-rank job's states (each rank's own loader, no process group)
        config = el.WorkerConfig(rank=rank, world_size=2)
        torch.manual_seed(0)  # one job seed for both ranks
        ranked = el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True, worker_config=config)
        next(iter(ranked))
        two.append(ranked.save_state_rank())
    with pytest.raises(StateMismatchError, match="same world size"):
        el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True).restore_state_global(two)


def test_held_back_saves_reach_back_batches() -> None:
    loader = el.SavableDataLoader(TENSORS, batch_size=4)
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(3)]
    state = loader.state_dict(held_back=1)
    restored = el.SavableDataLoader(TENSORS, batch_size=4)
    restored.load_state_dict(state)
    assert_same(next(iter(restored)), batches[2])


@pytest.mark.parametrize("dataset", [TENSORS, Sharded(23)], ids=["map", "iterable"])
def test_stats_count_the_batches_handed_out_the_saves_and_each_workers_share(
    dataset: Any,
) -> None:
    loader = el.SavableDataLoader(dataset, batch_size=4, num_workers=2)
    handed = 0
    for handed, _ in enumerate(loader, 1):
        if handed == 2:
            loader.state_dict()
    total = loader.stats()["total"]
    assert total["items"] == handed == 6
    assert total["saves"] == 1 and total["save_s_max"] > 0
    assert sum(worker["items"] for worker in total["workers"]) == handed
    assert loader.stats()["since_last"]["items"] == 0
    loader.close()


def _simulated_rank(rank: int, world_size: int, dataset: Any = TENSORS) -> el.SavableDataLoader:
    """A drop-in loader as rank ``rank`` of ``world_size`` under a DistributedSampler, without
    a process group (nothing is exchanged: each rank keeps its own job seed)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=5)
    config = el.WorkerConfig(rank=rank, world_size=world_size, num_workers=0)
    return el.SavableDataLoader(dataset, batch_size=3, sampler=sampler, worker_config=config)


def _saved_after(loader: el.SavableDataLoader, batches: int) -> dict[str, Any]:
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return loader.save_state_rank()


def test_rank_states_that_disagree_on_the_job_or_the_position_are_refused_together() -> None:
    """Two ranks seeded per rank with no process group to share a seed: their states restore
    each rank on the world size that saved them, but one rank's state cannot continue the
    other's samples (another world size, or a list where rank 0's stands for every rank):
    refused naming the seeds. States at different positions under a DistributedSampler
    (two saves mixed) are refused naming them."""
    states = []
    for rank in range(2):
        torch.manual_seed(1000 + rank)
        states.append(_saved_after(_simulated_rank(rank, 2), 2))
    assert states[0]["job"]["seed"] != states[1]["job"]["seed"]
    entries = _simulated_rank(0, 2).state_dict_of_ranks(states)  # Lightning's callback's
    for rank in range(2):  # each rank its own state: fine, as before
        el.distributed.restore_state_global(_simulated_rank(rank, 2), states)
        _simulated_rank(rank, 2).load_state_dict(entries)
    with pytest.raises(StateMismatchError, match="held their own job seeds"):
        el.distributed.restore_state_global(_simulated_rank(0, 3), states)
    with pytest.raises(StateMismatchError, match="held their own job seeds"):
        _simulated_rank(2, 3).load_state_dict(entries)
    torch.manual_seed(0)
    later = _saved_after(_simulated_rank(1, 2), 3)
    torch.manual_seed(0)
    mixed = [_saved_after(_simulated_rank(0, 2), 2), later]
    with pytest.raises(StateMismatchError, match="epoch 0, 2 batches used; rank 1: epoch 0, 3"):
        el.distributed.restore_state_global(_simulated_rank(0, 2), mixed)


def test_a_state_of_a_pre_release_version_is_refused_naming_both_versions() -> None:
    state = _shuffled_state(shuffle=True)
    for version in (2, 5):
        with pytest.raises(StateFormatError, match=f"state.version is {version}; .* version 1"):
            el.SavableDataLoader(TENSORS, batch_size=4, shuffle=True).load_state_dict(
                {**state, "version": version}
            )


def test_a_restore_decodes_its_state_and_checks_it_against_the_stream_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One decode (format, fields, digest) and one check of the stream per restore: from one
    state, from every rank's entries, and from the job's position on another world size; and
    one check that several states are of one save, by the carrier that holds them (none for
    one state)."""
    counts = {"decoded": 0, "checked": 0, "one_save": 0}
    decode = MapState.from_plain.__func__  # type: ignore[attr-defined]
    check = map_style.check_restorable

    def counted_decode(cls: type[MapState], state: Any) -> MapState:
        counts["decoded"] += 1
        return decode(cls, state)  # type: ignore[no-any-return]

    def counted_check(*args: Any) -> None:
        counts["checked"] += 1
        check(*args)

    states = []
    for rank in range(2):
        torch.manual_seed(0)  # one job seed on both ranks (no process group shares it)
        states.append(_saved_after(_simulated_rank(rank, 2), 2))
    one_save = dropin_job.check_one_save

    def counted_one_save(*args: Any, **kwargs: Any) -> None:
        counts["one_save"] += 1
        one_save(*args, **kwargs)

    monkeypatch.setattr(MapState, "from_plain", classmethod(counted_decode))
    monkeypatch.setattr(map_style, "check_restorable", counted_check)
    monkeypatch.setattr(dropin_restore, "check_one_save", counted_one_save)
    entries = _simulated_rank(0, 2).state_dict_of_ranks(states)
    restores = [
        lambda: _simulated_rank(1, 2).load_state_dict(states[1]),
        lambda: _simulated_rank(1, 2).load_state_dict(entries),
        lambda: _simulated_rank(0, 3).load_state_dict(entries),
        lambda: el.distributed.restore_state_global(_simulated_rank(0, 1), states),
    ]
    for restore, one_save_checks in zip(restores, (0, 1, 1, 1)):
        counts.update(decoded=0, checked=0, one_save=0)
        restore()
        assert counts == {"decoded": 1, "checked": 1, "one_save": one_save_checks}
