"""Where samples come from: savable, sharded, per-epoch shuffled sources."""

from .chunked import ChunkedFolderSource, loaded_chunk_count, write_chunked_folder
from .indexed import IndexedSource
from .permutation import FeistelPermutation
from .shard_writer import ShardWriter
from .sharded import ShardedSource
from .stream import StreamSource

__all__ = [
    "ChunkedFolderSource",
    "FeistelPermutation",
    "IndexedSource",
    "ShardWriter",
    "ShardedSource",
    "StreamSource",
    "loaded_chunk_count",
    "write_chunked_folder",
]
