"""State classes, the plain-data codec, configuration fingerprints and checkpoint files."""

from .atomic import fsync_directory, write_atomically
from .checkpoint import CheckpointDirectory, load_checkpoint, save_checkpoint
from .fingerprint import ConfigDifference, config_differences, describe_differences
from .plain import StateReader, check_plain, to_key
from .rank_state import (
    RANK_STATE_FORMAT,
    RANK_STATE_VERSION,
    PartitionState,
    RankState,
    WorkerSlots,
)

__all__ = [
    "RANK_STATE_FORMAT",
    "RANK_STATE_VERSION",
    "CheckpointDirectory",
    "ConfigDifference",
    "PartitionState",
    "RankState",
    "StateReader",
    "WorkerSlots",
    "check_plain",
    "config_differences",
    "describe_differences",
    "fsync_directory",
    "load_checkpoint",
    "save_checkpoint",
    "to_key",
    "write_atomically",
]
