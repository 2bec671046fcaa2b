"""The fluent form builds exactly the pipeline the classes build."""

from __future__ import annotations

import energy_loader as el
from energy_loader.testing.strategies import AddNoise, DropMultiples, MakeSample


def test_fluent_chain_equals_the_class_pipeline() -> None:
    def source() -> el.IndexedSource:
        return el.IndexedSource.from_fn(40, MakeSample(), shuffle=True, seed=2)

    fluent = (
        source()
        .map(AddNoise())
        .filter(DropMultiples(3))
        .shuffle_buffer(5)
        .batch(4)
        .limit(6)
        .repeat(2)
    )
    classes = el.RepeatDataset(
        el.LimitDataset(
            el.BatchDataset(
                el.ShuffleBufferDataset(
                    el.FilterDataset(el.MapDataset(source(), AddNoise()), DropMultiples(3)), 5
                ),
                4,
            ),
            6,
        ),
        2,
    )
    assert fluent.config() == classes.config()
    assert [b["index"].tolist() for b in fluent] == [b["index"].tolist() for b in classes]
    assert isinstance(source().gc(every_n_iter=2, freeze=False), el.GcDataset)
    assert isinstance(source().log_samples(), el.LogSampleDataset)


def test_fluent_methods_of_the_other_wrappers() -> None:
    def source(seed: int = 2) -> el.IndexedSource:
        return el.IndexedSource.from_fn(40, MakeSample(), shuffle=True, seed=seed)

    other = source(3)
    assert (
        source().blend((other, 2.0), weight=1.0).config()
        == el.BlendDataset((source(), 1.0), (source(3), 2.0)).config()
    )
    assert source().concat(source(3)).config() == el.ConcatDataset(source(), source(3)).config()
    assert (
        source().repeat().epochize(7).config()
        == el.EpochizeDataset(el.RepeatDataset(source()), 7).config()
    )
    assert isinstance(source().batch(4).unbatch(2), el.UnbatchDataset)
    assert isinstance(source().group_batch(lambda s: s["index"] % 2, 3), el.GroupBatchDataset)
