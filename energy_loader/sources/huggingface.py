"""HuggingFaceIterableSource: a Hugging Face ``datasets.IterableDataset`` as a savable source.

State: ``{"phase", "epoch", "count", "hf"}``; restore key ``(epoch, count)``. Splitting by
partition and epochs: docs/sources/huggingface.md.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

from ..dataset import EpochCursor, Key, SavableDataset
from ..errors import StateFormatError
from ..state.plain import StateReader

__all__ = ["HuggingFaceIterableSource", "to_plain_state"]


def to_plain_state(value: Any, path: str = "state_dict") -> Any:
    """``value`` (a Hugging Face state dict) as JSON-safe data: tuples become lists, numpy
    scalars Python numbers; anything else raises ``TypeError`` naming where it is."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path} has a non-string key {key!r}: it cannot be saved")
            out[key] = to_plain_state(item, f"{path}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [to_plain_state(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"{path} is a {type(value).__name__} ({value!r}); a saved state must be plain data. "
        "This dataset's state_dict() holds something energy_loader cannot store."
    )


class _HuggingFaceCursor(EpochCursor):
    dataset: HuggingFaceIterableSource

    def __init__(self, dataset: HuggingFaceIterableSource) -> None:
        super().__init__(dataset)
        self.count = 0
        self.hf_state: dict[str, Any] | None = None
        self._live: Any = None  # the split dataset being iterated

    def begin_epoch(self) -> None:
        self.count = 0
        self.hf_state = None
        self._live = None

    def resume(self) -> Iterator[tuple[Key, Any]]:
        from datasets.distributed import split_dataset_by_node

        context = self.dataset.context
        live = split_dataset_by_node(
            self.dataset.hf_dataset, rank=context.shard_index, world_size=context.num_shards
        )
        live.set_epoch(self.epoch)
        if self.hf_state is not None:
            live.load_state_dict(self.hf_state)
        self._live = live
        epoch = self.epoch
        try:
            for batch in live.iter(batch_size=1):
                sample = {name: column[0] for name, column in batch.items()}
                self.count += 1
                yield (epoch, self.count - 1), sample
        finally:
            self.hf_state = self._state()
            self._live = None

    def _state(self) -> dict[str, Any] | None:
        return self.hf_state if self._live is None else to_plain_state(self._live.state_dict())

    def fields(self) -> dict[str, Any]:
        return {"count": self.count, "hf": self._state()}

    def load_fields(self, reader: StateReader) -> None:
        self.count = reader.int("count")
        state = reader.raw("hf")
        if state is not None and not isinstance(state, dict):
            raise StateFormatError(f"{reader.path}.hf must be a dict or None (got {state!r})")
        self.hf_state = state


class HuggingFaceIterableSource(SavableDataset):
    """Read a Hugging Face ``datasets.IterableDataset``, saving its own state as plain data.

    Splitting, epochs and shuffle buffers: docs/sources/huggingface.md. Example::

        stream = load_dataset("allenai/c4", "en", split="train", streaming=True)
        source = HuggingFaceIterableSource(stream.shuffle(seed=1, buffer_size=1))
    """

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        try:
            import datasets
        except ImportError:  # pragma: no cover - the dev extra installs it
            raise ImportError(
                "HuggingFaceIterableSource needs the `datasets` package (pip install datasets)"
            ) from None
        if isinstance(dataset, datasets.Dataset):
            raise TypeError(
                "a map-style datasets.Dataset goes through IndexedSource(dataset, ...) (random "
                "access, exact shuffle, restore_sample); HuggingFaceIterableSource is for "
                "datasets.IterableDataset"
            )
        if not isinstance(dataset, datasets.IterableDataset):
            raise TypeError(
                "HuggingFaceIterableSource needs a datasets.IterableDataset "
                f"(got {type(dataset).__name__})"
            )
        self.hf_dataset = dataset

    def _new_cursor(self) -> EpochCursor:
        return _HuggingFaceCursor(self)

    def restore_sample(self, key: Key) -> Any:
        raise TypeError(
            "HuggingFaceIterableSource cannot rebuild a sample from its key: a streaming "
            "dataset has no random access (use a map-style Dataset through IndexedSource)"
        )

    def can_restore_sample(self) -> bool:
        return False

    def _config_fields(self) -> dict[str, Any]:
        info = getattr(self.hf_dataset, "info", None)
        return {
            "dataset": getattr(info, "dataset_name", None),
            "config": getattr(info, "config_name", None),
            "n_shards": self.hf_dataset.n_shards,
            "columns": self.hf_dataset.column_names,
        }
