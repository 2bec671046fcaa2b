"""energy_loader: a checkpointable data pipeline for PyTorch training.

Compose savable wrappers over a source, run them in a :class:`SavableDataLoader`, and save the
loader's exact position with every training checkpoint; a restored loader yields exactly what
the interrupted one would have yielded next.
"""

from typing import TYPE_CHECKING, Any

from .dataset import RESTORE_KEY, BaseWrapperDataset, EpochCursor, SavableDataset, restore_key_of
from .distributed import (
    data_parallel_ranks,
    rank_state_key,
    rank_state_path,
    restore_state_global,
    restore_state_rank_file,
    save_state_global,
    save_state_rank_file,
)
from .errors import (
    CodeChangedWarning,
    DataChangedWarning,
    DownloadError,
    EnergyLoaderError,
    SourceDataError,
    StateFormatError,
    StateMismatchError,
    StreamError,
    WorkerError,
    WorkerStateMismatchError,
)
from .loader import BasicDataLoader, SavableDataLoader
from .metrics import StallPolicy
from .sources import (
    ChunkedFolderSource,
    HuggingFaceIterableSource,
    IndexedSource,
    LitDataSource,
    MDSSource,
    MegatronIndexedSource,
    ParquetSource,
    ShardedSource,
    ShardWriter,
    StreamSource,
    WebDatasetSource,
    write_chunked_folder,
)
from .worker import WorkerConfig, WorkerContext, current_worker
from .wrappers import (
    BatchDataset,
    BlendDataset,
    ConcatDataset,
    EpochizeDataset,
    FilterDataset,
    GcDataset,
    GroupBatchDataset,
    LimitDataset,
    LogSampleDataset,
    MapDataset,
    PackingDataset,
    RepeatDataset,
    ShuffleBufferDataset,
    UnbatchDataset,
    default_collate,
)

__all__ = [
    "BaseWrapperDataset",
    "BasicDataLoader",
    "BatchDataset",
    "BlendDataset",
    "ChunkedFolderSource",
    "CodeChangedWarning",
    "ConcatDataset",
    "DataChangedWarning",
    "DownloadError",
    "EnergyLoaderError",
    "EpochCursor",
    "EpochizeDataset",
    "FilterDataset",
    "GcDataset",
    "GroupBatchDataset",
    "HuggingFaceIterableSource",
    "IndexedSource",
    "LimitDataset",
    "LitDataSource",
    "LogSampleDataset",
    "MDSSource",
    "MapDataset",
    "MegatronIndexedSource",
    "PackingDataset",
    "ParquetSource",
    "RESTORE_KEY",
    "RepeatDataset",
    "SavableDataLoader",
    "SavableDataset",
    "ShardWriter",
    "ShardedSource",
    "ShuffleBufferDataset",
    "SourceDataError",
    "StallPolicy",
    "StateFormatError",
    "StateMismatchError",
    "StreamError",
    "StreamSource",
    "UnbatchDataset",
    "WebDatasetSource",
    "WorkerConfig",
    "WorkerContext",
    "WorkerError",
    "WorkerStateMismatchError",
    "current_worker",
    "data_parallel_ranks",
    "dcp",
    "default_collate",
    "rank_state_key",
    "rank_state_path",
    "restore_key_of",
    "restore_state_global",
    "restore_state_rank_file",
    "save_state_global",
    "save_state_rank_file",
    "write_chunked_folder",
]

__version__ = "0.1.0"

if TYPE_CHECKING:
    from . import dcp


def __getattr__(name: str) -> Any:
    """``energy_loader.dcp`` on first use: it imports torch.distributed.checkpoint (~1 s),
    which a job that does not checkpoint through DCP need not pay at ``import energy_loader``."""
    if name == "dcp":
        import importlib

        return importlib.import_module(f"{__name__}.dcp")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
