"""``inspect`` and ``replay`` on the states a drop-in loader saved: files the library wrote
itself (per-rank files) and a training checkpoint holding ``loader.state_dict()``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import energy_loader as el

from ..helpers import run_command, run_commands
from .dropin_helpers import build_shuffled_loader

_run = run_command


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """A run saved after 2 of its 6 batches, and the batches that came after."""
    folder = tmp_path_factory.mktemp("dropin")
    loader = build_shuffled_loader()
    iterator = iter(loader)
    next(iterator), next(iterator)
    el.save_state_rank_file(loader, folder / "files")
    torch.save({"step": 2, "data": loader.state_dict()}, folder / "checkpoint.pt")
    rest = [batch["index"].tolist() for batch in iterator]
    return folder, rest


def test_inspect_describes_a_drop_in_state(saved: tuple[Path, list[Any]]) -> None:
    folder, _ = saved
    text, as_json = run_commands(
        ("inspect", str(folder / "checkpoint.pt")), ("inspect", "--json", str(folder / "files"))
    )
    assert text.returncode == 0, text.stderr
    assert "epoch 0, 2 of 6 batches handed out" in text.stdout
    assert "BatchSampler(RandomSampler)" in text.stdout
    summary = json.loads(as_json.stdout)
    assert (summary["epoch"], summary["batches_handed_out"]) == (0, 2)
    assert summary["fraction_through"] == pytest.approx(2 / 6)


def test_replay_prints_the_indices_and_samples_the_run_yielded_next(
    saved: tuple[Path, list[Any]],
) -> None:
    folder, rest = saved
    result = _run(
        "replay",
        "--pipeline",
        "tests.loader.dropin_helpers:build_shuffled_loader",
        str(folder / "files"),
        "--steps",
        "1:3",
        "--json",
        "--samples",
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["key"] for row in rows] == rest[1:3]
    assert [[s["index"] for s in row["sample"]] for row in rows] == rest[1:3]


def test_peek_keys_changes_nothing_and_agrees_with_the_run() -> None:
    loader = build_shuffled_loader()
    iterator = iter(loader)
    next(iterator)
    torch.manual_seed(5)
    expected_draw = torch.rand(2)
    torch.manual_seed(5)
    peeked = loader.peek_keys(3)
    assert torch.equal(torch.rand(2), expected_draw)  # the global RNG is as it was
    assert peeked == [next(iterator)["index"].tolist() for _ in range(3)]
    assert loader.peek_keys(10) == [batch["index"].tolist() for batch in iterator]


def test_replay_of_a_distributed_sampler_job_serves_any_rank_from_rank_0s_checkpoint(
    tmp_path: Path,
) -> None:
    """Lightning keeps rank 0's state: replaying rank 1 from it gives rank 1's next batches."""
    from torch.utils.data import DistributedSampler

    from energy_loader.cli.replay import replay_dropin

    from .dropin_helpers import Dicts

    def make(rank: int) -> Any:
        sampler = DistributedSampler(range(40), num_replicas=2, rank=rank, seed=3)
        return el.SavableDataLoader(Dicts(40), batch_size=4, sampler=sampler)

    saving = make(0)
    iterator = iter(saving)
    next(iterator), next(iterator)
    torch.save({"loader": saving.state_dict()}, tmp_path / "checkpoint.pt")
    expected = [batch["index"].tolist() for batch in list(make(1))[2:4]]
    rows = replay_dropin(make(1), [tmp_path / "checkpoint.pt"], 1, 0, 2)
    assert [row["key"] for row in rows] == expected
