"""check_resume must fail loudly on a pipeline that does not resume exactly."""

from __future__ import annotations

from typing import Any

import pytest

import energy_loader as el
from energy_loader.testing import ResumeMismatch, check_resume, first_difference


class _CountCalls:
    """Numbers its calls: deterministic within one run, but restarts at 0 after a restore."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        return {**sample, "call": self.calls}


def _make(index: int) -> dict[str, Any]:
    return {"index": index}


def test_check_resume_reports_the_first_divergence() -> None:
    def build() -> el.SavableDataset:
        return el.MapDataset(el.IndexedSource.from_fn(10, _make), _CountCalls())

    with pytest.raises(
        ResumeMismatch,
        match=r"first divergence at event 3: expected sample with restore key \(3,\)",
    ):
        check_resume(build, stop_points=[3])


def test_check_resume_rejects_what_is_not_a_pipeline() -> None:
    with pytest.raises(TypeError, match="build_fn must return a SavableDataset"):
        check_resume(lambda: [1, 2, 3])


def test_first_difference_names_the_path() -> None:
    import torch

    a = {"x": torch.tensor([1, 2]), "y": [1, {"z": 2}]}
    b = {"x": torch.tensor([1, 2]), "y": [1, {"z": 3}]}
    assert first_difference(a, b) == "sample['y'][1]['z']: 2 vs 3"
    assert first_difference(a, a) is None
