"""A pipeline's restore proves the values it re-makes, not only their restore keys.

Each partition's state carries, beside the digest of its last item's restore key (``last``),
a digest of that item's values as they were made (``made``). The replay that re-makes the
item must make the same values: a map function whose behaviour changed, one drawing from a
generator nobody seeds or reading a global counter, and a data file edited in place all
re-make the same keys with other values, and the restore refuses, naming the stages that run
user code. The oracles: the uninterrupted run, states edited by hand, and functions or files
changed between the saving run and the restoring one.
"""

from __future__ import annotations

import collections
import copy
import itertools
import json
import random
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.testing.compare import first_difference
from energy_loader.testing.strategies import MakeSample, PipelineSpec, pipelines
from tests.helpers import MODEL_EXAMPLES, indices, reference_pipeline, saved_at

# What _shifted adds: a module global, so a test changes the function's behaviour between the
# saving run and the restoring one without changing its code (a Counter, not plain data: the
# code fingerprint takes it by its type, as it takes any value that is not plain data).
_SHIFT = collections.Counter({"value": 0})
# A counter every call reads on: the values depend on how many samples the process made.
_COUNTER = itertools.count()


def _shifted(sample: dict) -> dict:
    return {**sample, "y": sample["index"] + _SHIFT["value"]}


def _numbered(sample: dict) -> dict:
    return {**sample, "n": next(_COUNTER)}


class _Jitter:
    """A map drawing from a generator of its own, which nobody seeds (seeded from the OS)."""

    def __init__(self) -> None:
        self.rng = random.Random()

    def __call__(self, sample: dict) -> dict:
        return {**sample, "jitter": self.rng.random()}


@pytest.fixture
def shift():
    """``_SHIFT``, put back after the test."""
    yield _SHIFT
    _SHIFT["value"] = 0


def _batched(fn) -> el.SavableDataset:
    source = el.IndexedSource.from_fn(60, MakeSample(), shuffle=True, seed=5)
    return el.BatchDataset(el.MapDataset(source, fn), batch_size=4)


def _loader(pipeline: el.SavableDataset, workers: int = 0, **options) -> el.SavableDataLoader:
    # Rolling checkpoints every 8 items only (none by time, which a loaded machine would add
    # at random points): a save after 11 batches has items to replay, to re-make the last.
    options = {"checkpoint_every_n_samples": 8, "checkpoint_every_sec": None, **options}
    return el.SavableDataLoader(pipeline, num_workers=workers, **options)


def _refusal(loader: el.SavableDataLoader, state: dict) -> str:
    loader.restore_state_rank(state)
    with pytest.raises(el.StateMismatchError) as caught:
        next(iter(loader))
    return str(caught.value)


def _has_proof(state: dict) -> bool:
    return any(p["skip"] and p["made"] for p in state["partitions"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_map_whose_output_changed_with_the_same_code_is_refused_naming_it(workers, shift) -> None:
    state, rest = saved_at(_loader(_batched(_shifted), workers), 11)
    assert _has_proof(state)
    shift["value"] = 1
    changed = _loader(_batched(_shifted), workers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", el.CodeChangedWarning)  # the code is the same
        message = _refusal(changed, state)
    assert "with other values" in message
    assert "BatchDataset > MapDataset.fn (tests.test_content_proof._shifted)" in message
    assert "IndexedSource" in message  # the data, the other place values come from
    assert "verify_restore=False" in message
    # The pipeline that saved the state continues it exactly, in a fresh loader and in the
    # refused one.
    shift["value"] = 0
    for loader in (_loader(_batched(_shifted), workers), changed):
        loader.restore_state_rank(state)
        assert [indices(batch) for batch in loader] == rest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fn", [_numbered, _Jitter], ids=["global_counter", "unseeded_rng"])
def test_a_map_that_reads_a_counter_or_an_unseeded_generator_is_refused(fn, workers) -> None:
    make = (lambda: _Jitter()) if fn is _Jitter else (lambda: fn)
    # A checkpoint every 3 batches: each partition replays from a checkpoint after its first
    # items, where the counter stood elsewhere (a replay from the epoch's start would count
    # the same again, and be exact).
    state, _ = saved_at(_loader(_batched(make()), workers, checkpoint_every_n_samples=3), 11)
    assert _has_proof(state)
    message = _refusal(_loader(_batched(make()), workers), state)
    assert "with other values" in message
    assert "MapDataset.fn (tests.test_content_proof." in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_parquet_file_edited_in_place_is_named_at_the_restore(tmp_path, workers) -> None:
    """The same rows and row groups with other values: the data fingerprint names the file
    (a warning by default, a refusal with on_data_change='refuse'); the original file back
    restores exactly."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "rows.parquet"

    def write(scale: float) -> None:  # the same rows and row groups, other values
        table = pa.table({"index": list(range(64)), "value": [i * scale for i in range(64)]})
        pq.write_table(table, path, row_group_size=16)

    def build() -> el.SavableDataset:
        return el.BatchDataset(el.ParquetSource(path, shuffle=True, seed=2), batch_size=4)

    write(1.0)
    state, rest = saved_at(_loader(build(), workers), 11)
    assert _has_proof(state)
    write(2.0)
    with pytest.raises(el.StateMismatchError) as caught:
        _loader(build(), workers, on_data_change="refuse").restore_state_rank(state)
    assert "the data files changed" in str(caught.value)
    assert "BatchDataset > ParquetSource" in str(caught.value)
    assert "rows.parquet" in str(caught.value)
    with pytest.warns(el.DataChangedWarning, match="rows.parquet"):
        _loader(build(), workers).restore_state_rank(state)
    write(1.0)
    again = _loader(build(), workers)
    again.restore_state_rank(state)
    assert [indices(batch) for batch in again] == rest


# -- no false refusals -------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("saved", "restored"), [(0, 0), (2, 2), pytest.param(2, 1, marks=pytest.mark.slow)]
)
def test_legitimate_restores_carry_the_proof_and_continue_exactly(saved, restored) -> None:
    """map (seeded noise) -> shuffle buffer -> batch, four partitions: saved at steps where
    the workers are rotated (an odd step with two workers) or not, restored with the same or
    another number of workers, through a rank state and through state_dict() leaves."""
    options = {"num_partitions": 4}
    uninterrupted = [indices(b) for b in _loader(reference_pipeline(200, 8, 4), saved, **options)]
    for steps in (7, 12):
        loader = _loader(reference_pipeline(200, 8, 4), saved, **options)
        iterator = iter(loader)
        head = [next(iterator) for _ in range(steps)]
        state, leaves = loader.save_state_rank(), json.loads(json.dumps(loader.state_dict()))
        loader._shutdown_workers()
        assert _has_proof(state)
        made = {p["partition"]: p["made"] for p in state["partitions"] if p["made"]}
        assert all(isinstance(value, str) and len(value) == 16 for value in made.values())
        for carrier in ("rank_state", "leaves"):
            fresh = _loader(reference_pipeline(200, 8, 4), restored, **options)
            if carrier == "rank_state":
                fresh.restore_state_rank(state)
            else:
                fresh.load_state_dict(leaves)
            rest = [indices(batch) for batch in fresh]
            assert [indices(b) for b in head] + rest == uninterrupted


def test_a_batch_changed_in_place_after_it_was_handed_out_is_no_false_refusal() -> None:
    """Without workers the loader hands out the very tensors the pipeline made: their values'
    digest is taken before, so a training step that writes into them changes nothing."""
    loader = _loader(_batched(_shifted))
    iterator = iter(loader)
    for _ in range(11):
        batch = next(iterator)
        batch["x"].add_(1000)
        batch["index"].zero_()
    state = loader.save_state_rank()
    assert _has_proof(state)
    fresh = _loader(_batched(_shifted))
    fresh.restore_state_rank(state)
    assert len(list(fresh)) == 4


def test_a_restored_loader_saved_again_keeps_the_proof_of_values(shift) -> None:
    state, _ = saved_at(_loader(_batched(_shifted)), 11)
    restored = _loader(_batched(_shifted))
    restored.restore_state_rank(state)
    again = restored.save_state_rank()  # before any item: the restored position itself
    assert [p["made"] for p in again["partitions"]] == [p["made"] for p in state["partitions"]]
    shift["value"] = 1
    assert "with other values" in _refusal(_loader(_batched(_shifted)), again)


# -- older states, edits, the opt-out ----------------------------------------------------------


@pytest.mark.parametrize("made", ["0" * 16, None, 7])
def test_an_edited_made_is_refused_by_the_entry_check(made) -> None:
    state, _ = saved_at(_loader(_batched(_shifted)), 11)
    edited = copy.deepcopy(state)
    entry = next(p for p in edited["partitions"] if p["made"])
    entry["made"] = made
    expected = r"made must be a digest string" if made == 7 else r"partitions\[0\]\.check"
    with pytest.raises(el.StateFormatError, match=expected):
        _loader(_batched(_shifted)).restore_state_rank(edited)


def test_verify_restore_false_saves_no_digest_of_values_and_skips_the_check(shift) -> None:
    unchecked = _loader(_batched(_shifted), verify_restore=False)
    state, rest = saved_at(unchecked, 11)
    assert all(p["made"] is None for p in state["partitions"])  # not computed at all
    checked_state, _ = saved_at(_loader(_batched(_shifted)), 11)
    shift["value"] = 1
    # A state with the proof restores into a loader that does not check it: continued.
    loader = _loader(_batched(_shifted), verify_restore=False)
    loader.restore_state_rank(checked_state)
    batches = list(loader)
    assert [indices(batch) for batch in batches] == rest
    assert all(int(y) == int(i) + 1 for b in batches for i, y in zip(b["index"], b["y"]))


# -- the drawn model: a function swapped between save and restore is never silent ------------

_TAG = collections.Counter({"value": 0})  # not plain data, as _SHIFT


def _tagged(item):
    return {"item": item, "tag": _TAG["value"]}


def _tagged_anew(item):
    return {"item": item, "tag": 1}


_TAGGED_CODE = _tagged.__code__


def _tagged_pipeline(spec: PipelineSpec) -> el.SavableDataset:
    return el.MapDataset(spec.build(), _tagged)


def _first_epoch(loader: el.SavableDataLoader) -> list:
    """The items the loader yields until its first epoch ends."""
    out = []
    for item in loader:
        if loader.epoch != 0:
            break
        out.append(item)
    return out


def _swapped_restore(spec: PipelineSpec, workers: int, mode: str, stop: int) -> None:
    model = _first_epoch(_loader(_tagged_pipeline(spec), workers))
    stop = min(stop, len(model))
    saver = _loader(_tagged_pipeline(spec), workers)
    iterator = iter(saver)
    for _ in range(stop):
        next(iterator)
    state = saver.save_state_rank()
    saver._shutdown_workers()
    if mode == "behaviour":  # the same code, other values: only the proof of values sees it
        _TAG["value"] = 1
    else:  # other code under the same name: the fingerprint sees it
        _tagged.__code__ = _tagged_anew.__code__
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = _loader(_tagged_pipeline(spec), workers)
            try:
                restored.restore_state_rank(state)
                rest = _first_epoch(restored)
            except el.StateMismatchError as error:
                assert mode == "behaviour", f"changed code is warned, not refused: {error}"
                assert "with other values" in str(error), error
                return
    finally:
        _TAG["value"] = 0
        _tagged.__code__ = _TAGGED_CODE
    warned = any(issubclass(w.category, el.CodeChangedWarning) for w in caught)
    assert warned == (mode == "code"), [str(w.message) for w in caught]
    # Continued: with the new values, from the position the uninterrupted run stood at; quiet
    # only where the state had nothing to re-make.
    assert mode == "code" or not _has_proof(state), "a changed function continued silently"
    assert len(rest) == len(model) - stop
    for got, expected in zip(rest, model[stop:]):
        assert got["tag"] == 1
        assert first_difference(got["item"], expected["item"]) is None


@MODEL_EXAMPLES
@given(
    spec=pipelines(max_length=30, max_depth=4),
    mode=st.sampled_from(["behaviour", "code"]),
    stop=st.integers(0, 40),
)
def test_a_function_swapped_between_save_and_restore_is_refused_or_warned(
    spec: PipelineSpec, mode: str, stop: int
) -> None:
    """Drawn pipelines (every wrapper) under a map whose values change between the save and
    the restore, in process: refused (same code, other values: wherever the state has an item
    to re-make) or warned (other code), never silent; a restore that continues stands where
    the uninterrupted run stood."""
    _swapped_restore(spec, 0, mode, stop)


@pytest.mark.slow
@pytest.mark.timeout(600)
@settings(max_examples=max(6, MODEL_EXAMPLES.max_examples // 2))
@given(
    spec=pipelines(max_length=30, max_depth=4, max_shards=2),
    mode=st.sampled_from(["behaviour", "code"]),
    stop=st.integers(0, 40),
)
def test_a_function_swapped_between_save_and_restore_is_refused_or_warned_with_workers(
    spec: PipelineSpec, mode: str, stop: int
) -> None:
    _swapped_restore(spec, 2, mode, stop)


@pytest.mark.parametrize("entry", ["state_dict", "rank_file", "gathered"])
def test_other_values_are_refused_through_every_entry_point(entry, shift, tmp_path) -> None:
    """A state reaches the restore through leaves, a folder of rank files or a gathered
    list: the proof of values is checked the same on each path."""
    loader = _loader(_batched(_shifted))
    iterator = iter(loader)
    for _ in range(11):
        next(iterator)
    leaves = json.loads(json.dumps(loader.state_dict()))
    state = loader.save_state_rank()
    el.save_state_rank_file(loader, tmp_path)
    assert _has_proof(state)
    shift["value"] = 1
    changed = _loader(_batched(_shifted))
    if entry == "state_dict":
        changed.load_state_dict(leaves)
    elif entry == "rank_file":
        el.restore_state_rank_file(changed, tmp_path)
    else:
        changed.restore_state_global([state])
    with pytest.raises(el.StateMismatchError, match="with other values"):
        next(iter(changed))
