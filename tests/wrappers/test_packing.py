"""PackingDataset: every token exactly once, pack lengths, boundaries, state, exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.testing import check_resume, samples_equal
from energy_loader.testing.strategies import MakeSample, RandomTokens
from energy_loader.wrappers import PackingDataset
from tests.helpers import WORKERS_0_AND_2


def _sequences(lengths: list[int]) -> list[torch.Tensor]:
    """Sequence ``i`` holds tokens ``i * 1000 + position``: each token names its origin."""
    return [torch.arange(n, dtype=torch.long) + 1000 * i for i, n in enumerate(lengths)]


@given(
    lengths=st.lists(st.integers(0, 30), max_size=40),
    max_len=st.integers(1, 16),
    buffer_size=st.integers(1, 6),
    too_long=st.sampled_from(["split", "drop"]),
    shuffle=st.booleans(),
)
def test_every_token_once_lengths_bounded_boundaries_exact(
    lengths: list[int], max_len: int, buffer_size: int, too_long: str, shuffle: bool
) -> None:
    source = el.IndexedSource(_sequences(lengths), shuffle=shuffle, seed=4)
    packing = PackingDataset(source, max_len, buffer_size=buffer_size, too_long=too_long)
    seen: dict[int, list[int]] = {i: [] for i in range(len(lengths))}
    for pack in packing:
        tokens, bounds = pack["tokens"].tolist(), pack["cu_seqlens"].tolist()
        assert 0 < len(tokens) <= max_len
        assert bounds[0] == 0 and bounds[-1] == len(tokens)
        assert pack["cu_seqlens"].dtype == torch.int32
        assert len(bounds) == len(pack[el.RESTORE_KEY]) + 1
        for (key, start, stop), a, b in zip(pack[el.RESTORE_KEY], bounds, bounds[1:]):
            segment = tokens[a:b]
            assert 0 < b - a == stop - start, "a boundary per piece, of the piece's length"
            assert segment == [1000 * key[0] + p for p in range(start, stop)]
            seen[key[0]].extend(segment)
    for i, n in enumerate(lengths):
        dropped = too_long == "drop" and n > max_len
        expected = [] if dropped else [1000 * i + p for p in range(n)]
        assert sorted(seen[i]) == expected, f"sequence {i} (length {n})"


@given(
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=25),
    max_len=st.integers(1, 12),
    buffer_size=st.integers(1, 5),
    too_long=st.sampled_from(["split", "drop"]),
    data=st.data(),
)
def test_resume_is_exact_at_any_stop_point(
    lengths: list[int], max_len: int, buffer_size: int, too_long: str, data: st.DataObject
) -> None:
    def build() -> PackingDataset:
        source = el.IndexedSource(_sequences(lengths), shuffle=True, seed=1)
        return PackingDataset(source, max_len, buffer_size=buffer_size, too_long=too_long)

    report = check_resume(build, epochs=2)
    stops = data.draw(st.lists(st.integers(0, report.events), max_size=3, unique=True))
    if stops:
        check_resume(build, epochs=2, stop_points=sorted(stops))


def test_first_fit_over_the_look_ahead_buffer() -> None:
    source = el.IndexedSource(_sequences([5, 6, 2, 3, 8, 1]))
    packs = list(PackingDataset(source, 8, buffer_size=2))
    pieces = [[(k[0], b - a) for k, a, b in p[el.RESTORE_KEY]] for p in packs]
    # 5 opens a pack; 6 waits; 2 fits (7); 3 waits -> buffer full: emit [5, 2]. The next pack
    # takes 6 (first fit), 3 still waits; 8 waits -> emit [6]. The next pack takes 3 (8 does
    # not fit), then 1 fits; the end drains [3, 1], then [8].
    assert pieces == [[(0, 5), (2, 2)], [(1, 6)], [(3, 3), (5, 1)], [(4, 8)]]


def test_over_long_sequences_are_split_or_dropped() -> None:
    source = el.IndexedSource(_sequences([3, 20]))
    split = list(PackingDataset(source, 8, too_long="split"))
    assert [p[el.RESTORE_KEY] for p in split] == [
        (((0,), 0, 3), ((1,), 16, 20)),
        (((1,), 0, 8),),
        (((1,), 8, 16),),
    ]
    dropped = list(PackingDataset(el.IndexedSource(_sequences([3, 20])), 8, too_long="drop"))
    assert [p["tokens"].tolist() for p in dropped] == [[0, 1, 2]]


def test_padding_to_max_len_and_token_inputs_of_every_kind() -> None:
    data = [[1, 2, 3], np.array([4, 5], dtype=np.int64), torch.tensor([6]), []]
    (pack,) = PackingDataset(el.IndexedSource(data), 8, pad_id=0)
    assert pack["tokens"].tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert pack["cu_seqlens"].tolist() == [0, 3, 5, 6]


def test_a_random_encoder_is_reproduced_by_restore_sample() -> None:
    source = el.IndexedSource.from_fn(30, MakeSample(), shuffle=True, seed=2)
    packing = PackingDataset(source, 10, encode_fn=RandomTokens(), buffer_size=3)
    packs = list(packing)
    assert len({len(p["cu_seqlens"]) for p in packs}) > 1
    for pack in packs:
        expected = {k: v for k, v in pack.items() if k != el.RESTORE_KEY}
        assert samples_equal(packing.restore_sample(pack[el.RESTORE_KEY]), expected)


def test_state_holds_piece_keys_not_tokens() -> None:
    source = el.IndexedSource(_sequences([400] * 50))
    packing = PackingDataset(source, 1000, buffer_size=8)
    iterator = iter(packing)
    next(iterator)
    state = packing.save_state()
    assert set(state) == {"phase", "epoch", "inner_done", "inner", "pack", "buffer"}
    assert state["pack"] == [[[2], 0, 400], [[3], 0, 400]]
    assert [piece[0] for piece in state["buffer"]] == [[i] for i in range(4, 10)]
    assert len(json.dumps(state)) < 300


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_is_exact(workers: int) -> None:
    def build() -> el.SavableDataset:
        source = el.IndexedSource.from_fn(40, MakeSample(), shuffle=True, seed=9)
        packing = PackingDataset(source, 7, encode_fn=RandomTokens(), buffer_size=3)
        return el.BatchDataset(el.ShuffleBufferDataset(packing, 3), 2)

    check_resume(build, num_workers=workers, epochs=2)


def test_bad_inputs_name_the_sample() -> None:
    with pytest.raises(ValueError, match="must be 1-D"):
        list(PackingDataset(el.IndexedSource([torch.zeros(2, 2)]), 8))
    with pytest.raises(TypeError, match="pass encode_fn"):
        list(PackingDataset(el.IndexedSource(["text"]), 8))
    with pytest.raises(ValueError, match="restore keys are tuples of"):
        PackingDataset(el.IndexedSource([[1]]), 8).restore_sample(((0,), 1))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_len": 0}, ValueError, "`max_len` must be positive"),
        ({"max_len": 8, "buffer_size": 0}, ValueError, "`buffer_size` must be positive"),
        ({"max_len": 8, "too_long": "truncate"}, ValueError, "'split'.*'drop'"),
        ({"max_len": 8, "encode_fn": "tokenizer"}, TypeError, "`encode_fn` must be callable"),
        ({"max_len": 8, "pad_id": -1}, ValueError, "`pad_id` must be >= 0"),
        ({"max_len": 8, "seed_per_sample": 1}, TypeError, "`seed_per_sample` must be True"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        PackingDataset(el.IndexedSource([[1]]), **kwargs)
