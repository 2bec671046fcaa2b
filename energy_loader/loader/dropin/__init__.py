"""The drop-in engines: torch's DataLoader behaviour for plain datasets, with exact resume.

``SavableDataLoader(dataset, ...)`` with a dataset that is not a savable pipeline runs it on
one of these engines (:mod:`energy_loader.loader.engine`). Modules: ``build`` (which engine,
and the checks of its options), ``map_style`` and ``iterable`` (how each kind of dataset
runs), ``restore`` (the save and restore half of the engine protocol for both), ``stream``
and ``position`` (the recorded index stream and where it stands, pure), ``sampling`` (the
generators that drive a sampler), ``job`` (one job seed and id per job), ``state`` and
``entries`` (the saved format), ``trainers`` (Lightning's count of a resumed epoch).

:class:`DropInDataLoader` is kept for code that names it: constructing it builds a
``SavableDataLoader`` (refusing a savable pipeline), and ``isinstance(loader,
DropInDataLoader)`` tells a loader that runs a drop-in engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DropInDataLoader", "runs_dropin"]


def runs_dropin(loader: Any) -> bool:
    """Whether ``loader`` is a :class:`~energy_loader.SavableDataLoader` over a plain dataset
    (a drop-in engine), not over a savable pipeline."""
    from ..pipeline_engine import PipelineEngine
    from ..savable_loader import SavableDataLoader

    return isinstance(loader, SavableDataLoader) and not isinstance(loader.engine, PipelineEngine)


class _DropInType(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return runs_dropin(instance)


class DropInDataLoader(metaclass=_DropInType):
    """A :class:`~energy_loader.SavableDataLoader` over a plain map-style or iterable dataset
    (the name of earlier releases; ``type(loader) is SavableDataLoader``)."""

    def __new__(cls, dataset: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        from ...dataset import SavableDataset
        from ..savable_loader import SavableDataLoader

        if isinstance(dataset, SavableDataset):
            raise TypeError(
                "DropInDataLoader runs plain datasets; give a savable pipeline to SavableDataLoader"
            )
        return SavableDataLoader(dataset, *args, **kwargs)
