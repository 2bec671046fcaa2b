"""Savable dataset wrappers, one module each."""

from .batch import BatchDataset
from .collate import default_collate
from .filter import FilterDataset
from .gc import GcDataset
from .limit import LimitDataset
from .log_sample import LogSampleDataset
from .map import MapDataset
from .repeat import RepeatDataset
from .shuffle_buffer import ShuffleBufferDataset

__all__ = [
    "BatchDataset",
    "FilterDataset",
    "GcDataset",
    "LimitDataset",
    "LogSampleDataset",
    "MapDataset",
    "RepeatDataset",
    "ShuffleBufferDataset",
    "default_collate",
]
