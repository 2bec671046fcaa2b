"""``python -m energy_loader index PATH``: build the member indexes of WebDataset tar shards.

Each shard gets ``<shard>.idx.json`` beside it (local directory or fsspec URL) so that
:class:`~energy_loader.WebDatasetSource` can seek to any sample; shards are indexed in
parallel threads (the work is reading and hashing), with a progress bar.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from ..errors import EnergyLoaderError
from ..sources._tar_index import INDEX_SUFFIX, build_index
from ..sources.webdataset import _BRACES, _is_url, _list_shards, expand_urls
from ..state.atomic import write_atomically

__all__ = ["index_shards", "main"]

_DESCRIPTION = """Build the member index of WebDataset tar shards.

PATH is a directory holding .tar shards, one shard, a brace pattern
(shard-{000..099}.tar) or a directory URL (s3://bucket/train). Each shard gets
SHARD.idx.json beside it or, with --cache-dir DIR (for read-only remotes),
in DIR/indexes/, where a WebDatasetSource with cache_dir=DIR looks for them.
Existing indexes are kept unless --force."""


def _open(url: str) -> Any:
    import fsspec

    return fsspec.open(url, "rb").open()


def _index_one(url: str, target: str, force: bool) -> tuple[str, int | None]:
    """Index one shard into ``target``; ``(url, samples)`` or ``(url, None)`` if kept."""
    if _is_url(target):
        import fsspec

        fs, path = fsspec.core.url_to_fs(target)
        if not force and fs.exists(path):
            return url, None
    elif not force and Path(target).exists():
        return url, None
    name = url.rsplit("/", 1)[-1]
    with _open(url) if _is_url(url) else open(url, "rb") as file:
        data = build_index(file, name, url)
    encoded = json.dumps(data).encode()
    if _is_url(target):
        fs.pipe_file(path, encoded)
    else:
        write_atomically(target, encoded)
    return url, data["samples"]


def index_shards(
    location: str,
    *,
    jobs: int = 8,
    cache_dir: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict[str, int | None]:
    """Index every shard of ``location``; returns ``{shard: samples or None if kept}``."""
    urls = expand_urls(location) if _BRACES.search(location) else _list_shards(location, {})
    if not urls:
        raise FileNotFoundError(f"{location} holds no .tar shards")
    targets = {}
    for url in urls:
        if cache_dir is None:
            targets[url] = url + INDEX_SUFFIX
        else:
            name = url.rsplit("/", 1)[-1]
            targets[url] = str(Path(cache_dir) / "indexes" / (name + INDEX_SUFFIX))
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(urls), unit="shard", desc="indexing", file=sys.stderr)
    done: dict[str, int | None] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(urls)))) as pool:
        futures = [pool.submit(_index_one, url, targets[url], force) for url in urls]
        try:
            for future in as_completed(futures):
                url, samples = future.result()
                done[url] = samples
                if bar is not None:
                    bar.update(1)
        finally:
            for future in futures:
                future.cancel()
            if bar is not None:
                bar.close()
    return done


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m energy_loader index",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help="shards: directory, file, pattern or URL")
    parser.add_argument("--jobs", type=int, default=8, help="shards indexed at once (8)")
    parser.add_argument(
        "--cache-dir", default=None, help="the source's cache_dir: write the indexes there"
    )
    parser.add_argument("--force", action="store_true", help="rebuild existing indexes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be positive (got {args.jobs})")
    try:
        done = index_shards(
            args.path,
            jobs=args.jobs,
            cache_dir=args.cache_dir,
            force=args.force,
            progress=not args.quiet,
        )
    except (EnergyLoaderError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    built = {url: n for url, n in done.items() if n is not None}
    print(
        f"indexed {len(built)} shards ({sum(built.values())} samples); "
        f"{len(done) - len(built)} already had an index"
    )
    return 0
