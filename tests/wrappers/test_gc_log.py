"""GcDataset and LogSampleDataset."""

from __future__ import annotations

import gc
import json
import logging

import pytest

import energy_loader as el
from energy_loader.testing import check_resume
from energy_loader.testing.strategies import MakeSample
from tests.helpers import WORKERS_0_AND_2


def _source(length: int = 12) -> el.IndexedSource:
    return el.IndexedSource.from_fn(length, MakeSample(), shuffle=True, seed=4)


def test_gc_collects_every_n_samples_and_changes_nothing_else(monkeypatch) -> None:
    calls = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or real_collect(*a))
    out = [s["index"] for s in el.GcDataset(_source(12), every_n_iter=5, freeze=False)]
    assert out == [s["index"] for s in _source(12)]
    assert len(calls) == 2


def test_log_writes_one_json_line_per_sample_with_rank_worker_index(tmp_path) -> None:
    loader = el.SavableDataLoader(el.LogSampleDataset(_source(10), log_dir=tmp_path), num_workers=2)
    keys = [s[el.RESTORE_KEY] for s in loader]
    del loader
    lines = []
    for path in sorted(tmp_path.iterdir()):
        lines += [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(tuple(r["key"]) for r in lines) == sorted(keys)
    assert {(r["rank"], r["worker"]) for r in lines} == {(0, 0), (0, 1)}
    for worker in (0, 1):
        assert [r["index"] for r in lines if r["worker"] == worker] == list(range(5))


def test_log_index_continues_after_a_restore(tmp_path) -> None:
    pipeline = el.LogSampleDataset(_source(6), log_dir=tmp_path)
    iterator = iter(pipeline)
    next(iterator), next(iterator)
    state = pipeline.save_state()
    restored = el.LogSampleDataset(_source(6), log_dir=tmp_path)
    restored.restore_state(state)
    list(restored)
    log = (tmp_path / "partition00000-of-00001.jsonl").read_text()
    records = [json.loads(x) for x in log.split("\n") if x]
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4, 5]


def test_log_without_a_directory_uses_the_logger(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="energy_loader.samples"):
        list(el.LogSampleDataset(_source(3)))
    assert len(caplog.records) == 3


@pytest.mark.parametrize("workers", WORKERS_0_AND_2)
def test_resume_exactly(workers: int, tmp_path) -> None:
    check_resume(
        lambda: el.GcDataset(
            el.LogSampleDataset(_source(), log_dir=tmp_path), every_n_iter=16, freeze=False
        ),
        num_workers=workers,
    )


def test_constructors_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`every_n_iter` must be positive"):
        el.GcDataset(_source(), every_n_iter=0)
    with pytest.raises(TypeError, match="`log_dir` must be a path"):
        el.LogSampleDataset(_source(), log_dir=3)
