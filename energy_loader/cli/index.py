"""``python -m energy_loader index PATH``: build the member indexes of WebDataset tar shards
(``<shard>.idx.json``) in threads (docs/sources/webdataset.md). A failure is one line, exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from ..errors import EnergyLoaderError, first_line
from ..sources._download import storage_options_dict
from ..sources._tar_index import INDEX_SUFFIX, build_index
from ..sources.webdataset import _BRACES, _is_url, _list_shards, expand_urls
from ..state.atomic import write_atomically

_DESCRIPTION = """Build the member index of WebDataset tar shards.

PATH is a directory holding .tar shards, one shard, a brace pattern
(shard-{000..099}.tar) or a directory URL (s3://bucket/train). Each shard gets
SHARD.idx.json beside it or, with --cache-dir DIR (for read-only remotes),
in DIR/indexes/, where a WebDatasetSource with cache_dir=DIR looks for them.
Existing indexes are kept unless --force.

Remote locations go through fsspec with the storage options a WebDatasetSource
takes as storage_options. An S3-compatible server that is not AWS (MinIO, Ceph,
R2, ...) needs its endpoint: --endpoint-url, or the environment variable
AWS_ENDPOINT_URL (read by botocore, so it also reaches the sources in a training
job). Credentials come from the usual AWS places (AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, AWS_PROFILE or --profile, ~/.aws/credentials). An endpoint
that cannot be reached is one line on stderr and exit code 1."""

_EPILOG = """examples:
  python -m energy_loader index /data/train
  python -m energy_loader index s3://bucket/train --endpoint-url http://minio:9000
  python -m energy_loader index s3://bucket/train --cache-dir /scratch/wds --profile research
  python -m energy_loader index gs://bucket/train --storage-options '{"token": "anon"}'"""

# Exception class names (no storage library imported): an unreachable endpoint, no credentials.
_UNREACHABLE = {
    "ClientConnectorError",
    "ConnectTimeoutError",
    "ConnectionError",
    "EndpointConnectionError",
    "ProxyConnectionError",
}
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "ProfileNotFound"}


def storage_options_from(
    location: str,
    options_json: str | None = None,
    endpoint_url: str | None = None,
    profile: str | None = None,
) -> dict[str, Any]:
    """The fsspec storage options the command line asks for; ``ValueError`` names a wrong one."""
    options: dict[str, Any] = {}
    if options_json is not None:
        try:
            options = json.loads(options_json)
        except ValueError as error:
            raise ValueError(
                f"--storage-options must be a JSON object (got {options_json!r}: {error})"
            ) from None
        if not isinstance(options, dict):
            raise ValueError(f"--storage-options must be a JSON object (got {options_json!r})")
    if endpoint_url is None and profile is None:
        return options
    if not location.startswith(("s3://", "s3a://")):
        raise ValueError(
            "--endpoint-url and --profile are for s3:// locations (got "
            f"{location!r}); give other filesystems' options with --storage-options"
        )
    if endpoint_url is not None:
        if not endpoint_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--endpoint-url must be an http:// or https:// URL (got {endpoint_url!r})"
            )
        client = options.get("client_kwargs") or {}
        if not isinstance(client, dict):
            raise ValueError("--storage-options: client_kwargs must be a JSON object")
        options["client_kwargs"] = {**client, "endpoint_url": endpoint_url}
    if profile is not None:
        options["profile"] = profile
    return options


def _index_one(
    url: str, target: str, force: bool, storage_options: dict[str, Any]
) -> tuple[str, int | None]:
    """Index one shard into ``target``; ``(url, samples)`` or ``(url, None)`` if kept."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(target, **storage_options) if _is_url(target) else (None, "")
    if not force and (Path(target).exists() if fs is None else fs.exists(path)):
        return url, None
    remote = _is_url(url)
    with fsspec.open(url, "rb", **storage_options).open() if remote else open(url, "rb") as file:
        data = build_index(file, url.rsplit("/", 1)[-1], url)
    encoded = json.dumps(data).encode()
    if fs is not None:
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
    storage_options: dict[str, Any] | None = None,
) -> dict[str, int | None]:
    """Index every shard of ``location``; returns ``{shard: samples or None if kept}``."""
    options = storage_options_dict(storage_options)
    urls = expand_urls(location) if _BRACES.search(location) else _list_shards(location, options)
    if not urls:
        raise FileNotFoundError(f"{location} holds no .tar shards")
    folder = None if cache_dir is None else Path(cache_dir) / "indexes"
    targets = {
        url: str(folder / url.rsplit("/", 1)[-1]) + INDEX_SUFFIX if folder else url + INDEX_SUFFIX
        for url in urls
    }
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(urls), unit="shard", desc="indexing", file=sys.stderr)
    done: dict[str, int | None] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(urls)))) as pool:
        futures = [pool.submit(_index_one, url, targets[url], force, options) for url in urls]
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


def _describe_failure(error: BaseException, location: str, options: dict[str, Any]) -> str:
    """One line saying why indexing ``location`` failed and what to check."""
    names = {cls.__name__ for cls in type(error).__mro__}
    message = first_line(error) or type(error).__name__
    if names & _UNREACHABLE:
        client = options.get("client_kwargs")
        endpoint = (client.get("endpoint_url") if isinstance(client, dict) else None) or (
            os.environ.get("AWS_ENDPOINT_URL")
        )
        where = f"the endpoint {endpoint}" if endpoint else "the storage endpoint"
        return (
            f"{location}: cannot connect to {where} ({message}); check --endpoint-url "
            "(or AWS_ENDPOINT_URL) and that the server is up"
        )
    if names & _NO_CREDENTIALS:
        return (
            f"{location}: no usable credentials ({message}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or a profile with --profile (or AWS_PROFILE)"
        )
    if not isinstance(error, (EnergyLoaderError, OSError)):
        message = f"{type(error).__name__}: {message}"
    return message if location in message else f"{location}: {message}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m energy_loader index",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help="shards: directory, file, pattern or URL")
    parser.add_argument("--jobs", type=int, default=8, help="shards indexed at once (8)")
    parser.add_argument("--cache-dir", help="the source's cache_dir: write the indexes there")
    parser.add_argument("--force", action="store_true", help="rebuild existing indexes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    options_help = "fsspec storage options for a remote PATH, as a JSON object"
    parser.add_argument("--storage-options", metavar="JSON", help=options_help)
    endpoint = "the S3-compatible server to use for s3:// (default: AWS_ENDPOINT_URL, else AWS)"
    parser.add_argument("--endpoint-url", metavar="URL", help=endpoint)
    parser.add_argument("--profile", help="the AWS credentials profile for s3:// (AWS_PROFILE)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be positive (got {args.jobs})")
    try:
        options = storage_options_from(
            args.path, args.storage_options, args.endpoint_url, args.profile
        )
    except ValueError as error:
        parser.error(str(error))
    try:
        done = index_shards(
            args.path,
            jobs=args.jobs,
            cache_dir=args.cache_dir,
            force=args.force,
            progress=not args.quiet,
            storage_options=options,
        )
    except Exception as error:
        print(f"index: {_describe_failure(error, args.path, options)}", file=sys.stderr)
        return 1
    built = {url: n for url, n in done.items() if n is not None}
    print(
        f"indexed {len(built)} shards ({sum(built.values())} samples); "
        f"{len(done) - len(built)} already had an index"
    )
    return 0
