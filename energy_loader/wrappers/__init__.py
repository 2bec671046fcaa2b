"""Savable dataset wrappers, one module each."""

from .batch import BatchDataset
from .blend import BlendDataset
from .collate import default_collate
from .concat import ConcatDataset
from .epochize import EpochizeDataset
from .filter import FilterDataset
from .gc import GcDataset
from .group_batch import GroupBatchDataset
from .limit import LimitDataset
from .log_sample import LogSampleDataset
from .map import MapDataset
from .packing import PackingDataset
from .repeat import RepeatDataset
from .shuffle_buffer import ShuffleBufferDataset
from .unbatch import UnbatchDataset

__all__ = [
    "BatchDataset",
    "BlendDataset",
    "ConcatDataset",
    "EpochizeDataset",
    "FilterDataset",
    "GcDataset",
    "GroupBatchDataset",
    "LimitDataset",
    "LogSampleDataset",
    "MapDataset",
    "PackingDataset",
    "RepeatDataset",
    "ShuffleBufferDataset",
    "UnbatchDataset",
    "default_collate",
]
