"""Where samples come from: savable, sharded, per-epoch shuffled sources."""

from .chunked import ChunkedFolderSource, loaded_chunk_count, write_chunked_folder
from .huggingface import HuggingFaceIterableSource
from .indexed import IndexedSource
from .litdata import LitDataSource
from .mds import MDSSource
from .megatron import MegatronIndexedSource
from .parquet import ParquetSource
from .permutation import FeistelPermutation
from .shard_writer import ShardWriter
from .sharded import ShardedSource
from .stream import StreamSource
from .webdataset import WebDatasetSource

__all__ = [
    "ChunkedFolderSource",
    "FeistelPermutation",
    "HuggingFaceIterableSource",
    "IndexedSource",
    "LitDataSource",
    "MDSSource",
    "MegatronIndexedSource",
    "ParquetSource",
    "ShardWriter",
    "ShardedSource",
    "StreamSource",
    "WebDatasetSource",
    "loaded_chunk_count",
    "write_chunked_folder",
]
