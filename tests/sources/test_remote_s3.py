"""Sources against a real S3-compatible server on 127.0.0.1 (moto's server mode) through
s3fs: download-ahead, size/sha256 checks, retries on injected 500s and dropped connections
(a small fault-injecting proxy in front of the server), DownloadError after the retries."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import energy_loader as el
from energy_loader import (
    DownloadError,
    ParquetSource,
    ShardedSource,
    ShardWriter,
    SourceDataError,
    WebDatasetSource,
)
from energy_loader.cli.index import index_shards
from energy_loader.cli.index import main as index_main
from energy_loader.testing import check_resume

from .test_parquet import write_files
from .test_webdataset import write_shards

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class FaultProxy(http.server.ThreadingHTTPServer):
    """Forwards HTTP to the S3 server, failing chosen GETs: ``faults[name]`` is a list of
    ``"500"`` / ``"drop"`` consumed one per GET whose path ends with ``name``
    (``"always"`` fails every one with a 500)."""

    daemon_threads = True

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.faults: dict[str, list[str] | str] = {}
        self.injected = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def fault_for(self, method: str, path: str) -> str | None:
        if method != "GET":
            return None
        with self.lock:
            for name, plan in self.faults.items():
                if path.split("?", 1)[0].endswith(name):
                    if plan == "always":
                        self.injected += 1
                        return "500"
                    if plan:
                        self.injected += 1
                        return plan.pop(0)  # type: ignore[union-attr]
        return None


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        fault = self.server.fault_for(self.command, self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if fault == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault == "500":
            payload = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
            self.send_response(500)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.target_port, timeout=30)
        try:
            upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(name, value)
        length = response.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server and a fault proxy in front of it; yields the endpoints."""
    patch = pytest.MonkeyPatch()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        patch.setenv(name, value)
    # Imported here: s3fs and moto are heavy imports the other modules' tests need not pay for.
    import s3fs
    from moto.server import ThreadedMotoServer

    # Port 0: the server binds a port of its own (a port probed free a moment before can be
    # taken by another test process's server in between, which then answers for both).
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    proxy = FaultProxy(port)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{port}"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    # exist_ok: moto keeps its buckets in the process, and under xdist a worker may set this
    # module's fixture up a second time (after running another module's tests in between).
    fs.makedirs("bucket", exist_ok=True)
    try:
        yield {"endpoint": endpoint, "proxy": proxy, "fs": fs}
    finally:
        proxy.shutdown()
        proxy.server_close()
        server.stop()
        patch.undo()


def options(endpoint: str) -> dict[str, Any]:
    """s3fs options: the endpoint, and no botocore retries (so ours are the ones tested)."""
    return {
        "client_kwargs": {"endpoint_url": endpoint},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }


def upload_shards(s3: dict[str, Any], local: Path, *, indexes: bool = True) -> str:
    prefix = f"bucket/{uuid.uuid4().hex}"
    for path in sorted(local.iterdir()):
        if indexes or not path.name.endswith(".idx.json"):
            s3["fs"].put_file(str(path), f"{prefix}/{path.name}")
    return f"s3://{prefix}"


@pytest.fixture(scope="module")
def wds_local(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wds-s3")
    write_shards(directory, [6, 5, 7])
    index_shards(str(directory), progress=False)
    return directory


def test_webdataset_on_s3_downloads_ahead_and_resumes(s3, wds_local, tmp_path):
    url = upload_shards(s3, wds_local)
    storage = options(s3["endpoint"])
    expected = [s["json"] for s in WebDatasetSource(wds_local)]
    source = WebDatasetSource(url, cache_dir=tmp_path / "cache", storage_options=storage)
    iterator = iter(source)
    assert next(iterator)["json"] == expected[0]
    deadline = time.monotonic() + 10  # the prefetch thread fetches the other shards
    while len(list((tmp_path / "cache").glob("*.tar"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.tar")) == [
        f"shard-00{n}.tar" for n in range(3)
    ]
    assert [s["json"] for s in iterator] == expected[1:]
    check_resume(
        lambda: WebDatasetSource(
            url, shuffle=True, seed=2, cache_dir=tmp_path / "cache2", storage_options=storage
        ).batch(4),
        num_workers=2,
    )


def test_an_unindexed_remote_is_indexed_into_the_cache_only(s3, wds_local, tmp_path):
    url = upload_shards(s3, wds_local, indexes=False)
    source = WebDatasetSource(url, cache_dir=tmp_path, storage_options=options(s3["endpoint"]))
    assert len(list(source)) == 18
    assert len(list((tmp_path / "indexes").glob("*.idx.json"))) == 3
    assert not s3["fs"].glob(url.removeprefix("s3://") + "/*.idx.json")


def test_injected_500s_and_dropped_connections_are_retried(s3, wds_local, tmp_path):
    url = upload_shards(s3, wds_local)
    proxy: FaultProxy = s3["proxy"]
    before = proxy.injected
    proxy.faults = {"shard-000.tar": ["500", "drop", "500"], "shard-002.tar": ["500"]}
    try:
        source = WebDatasetSource(
            url,
            cache_dir=tmp_path,
            storage_options=options(proxy.url),
            download_retries=4,
            predownload=0,
        )
        got = [s["json"] for s in source]
    finally:
        proxy.faults = {}
    assert got == [s["json"] for s in WebDatasetSource(wds_local)]
    assert proxy.injected - before == 4


def test_a_download_that_keeps_failing_is_a_download_error_naming_the_object(
    s3, wds_local, tmp_path
):
    url = upload_shards(s3, wds_local)
    proxy: FaultProxy = s3["proxy"]
    proxy.faults = {"shard-001.tar": "always"}
    try:
        source = WebDatasetSource(
            url,
            cache_dir=tmp_path,
            storage_options=options(proxy.url),
            download_retries=1,
            predownload=0,
        )
        with pytest.raises(DownloadError, match=rf"{url}/shard-001\.tar after 2 attempts"):
            list(source)
    finally:
        proxy.faults = {}


def test_a_remote_shard_that_does_not_match_its_index_is_refused(s3, wds_local, tmp_path):
    url = upload_shards(s3, wds_local, indexes=False)
    storage = {**options(s3["endpoint"]), "skip_instance_cache": True}
    WebDatasetSource(url, cache_dir=tmp_path, storage_options=storage)  # indexes into the cache
    data = bytearray((wds_local / "shard-000.tar").read_bytes())
    data[600] ^= 0xFF  # same size, different bytes: only the sha256 tells
    s3["fs"].pipe_file(url.removeprefix("s3://") + "/shard-000.tar", bytes(data))
    source = WebDatasetSource(
        url, cache_dir=tmp_path, storage_options=storage, predownload=0, download_retries=1
    )
    with pytest.raises(SourceDataError, match=r"shard-000\.tar is corrupt: got .* sha256"):
        list(source)


# ~13 s (every restore downloads the shards again): slow. S3 through s3fs resumes with workers
# in test_webdataset_on_s3_downloads_ahead_and_resumes, and a ShardedSource on a remote
# resumes with workers in test_sharded.py's test_memory_filesystem_remote_resumes_with_workers.
@pytest.mark.slow
def test_sharded_source_on_s3_resumes_with_workers(s3, tmp_path, no_leftover_processes):
    with ShardWriter(tmp_path / "shards", max_shard_bytes=400) as writer:
        for i in range(30):
            writer.write({"i": i, "x": [i] * 5})
    url = upload_shards(s3, tmp_path / "shards")
    storage = options(s3["endpoint"])
    caches = iter(range(100))
    report = check_resume(
        lambda: ShardedSource(
            url, tmp_path / f"cache-{next(caches)}", shuffle=True, seed=1, storage_options=storage
        ),
        num_workers=2,
    )
    assert report.events == 2 * 31


def test_parquet_on_s3(s3, tmp_path):
    write_files(tmp_path / "pq", [9, 6])
    prefix = f"bucket/{uuid.uuid4().hex}"
    for path in sorted((tmp_path / "pq").iterdir()):
        s3["fs"].put_file(str(path), f"{prefix}/{path.name}")
    remote = ParquetSource(f"s3://{prefix}", storage_options=options(s3["endpoint"]), shuffle=True)
    local = ParquetSource(tmp_path / "pq", shuffle=True)
    assert [dict(s) for s in remote] == [dict(s) for s in local]
    shutil.rmtree(tmp_path / "pq")
    assert remote.restore_sample((1, 0, 2))["i"] == 11
    assert isinstance(el.restore_key_of(next(iter(remote))), tuple)


def _index_command(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "energy_loader", "index", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )


@pytest.mark.slow  # the index command in a process of its own; reading S3 runs by default
def test_index_command_indexes_an_s3_folder_on_a_given_endpoint(
    s3, wds_local, tmp_path, monkeypatch
):
    url = upload_shards(s3, wds_local, indexes=False)
    bucket_path = url.removeprefix("s3://")
    result = _index_command(url, "--endpoint-url", s3["endpoint"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "indexed 3 shards (18 samples); 0 already had an index"
    assert sorted(p.rsplit("/", 1)[1] for p in s3["fs"].glob(f"{bucket_path}/*.idx.json")) == [
        f"shard-00{n}.tar.idx.json" for n in range(3)
    ]
    indexes = [
        json.loads(s3["fs"].cat(f"{bucket_path}/shard-00{n}.tar.idx.json")) for n in range(3)
    ]
    assert [index["samples"] for index in indexes] == [6, 5, 7]  # as wds_local wrote them
    source = WebDatasetSource(url, cache_dir=tmp_path, storage_options=options(s3["endpoint"]))
    assert [s["json"]["i"] for s in source] == list(range(18))
    # AWS_ENDPOINT_URL reaches the same server, for the command (--cache-dir keeps the remote
    # untouched) and for a source given no endpoint.
    again = _index_command(url, "--cache-dir", str(tmp_path / "c"), AWS_ENDPOINT_URL=s3["endpoint"])
    assert again.returncode == 0, again.stderr
    assert len(list((tmp_path / "c" / "indexes").glob("*.idx.json"))) == 3
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["endpoint"])
    plain = WebDatasetSource(
        url, cache_dir=tmp_path / "e", storage_options={"skip_instance_cache": True}
    )
    assert [s["json"]["i"] for s in plain] == list(range(18))


@pytest.mark.slow  # the index command in a process of its own; reading S3 runs by default
def test_index_command_on_an_unreachable_endpoint_is_one_line_and_exit_1(wds_local):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = _index_command(
        "s3://bucket/train",
        "--endpoint-url",
        endpoint,
        "--storage-options",
        '{"config_kwargs": {"retries": {"max_attempts": 1}}}',  # fail fast
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
    )
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"index: s3://bucket/train: cannot connect to the endpoint {endpoint}")
    assert result.stdout == ""


def test_index_command_refuses_bad_storage_options_naming_the_option(wds_local, capsys):
    for args, expected in [
        ([str(wds_local), "--endpoint-url", "http://127.0.0.1:1"], "for s3:// locations"),
        (["s3://bucket/x", "--endpoint-url", "127.0.0.1:1"], "http:// or https:// URL"),
        (["s3://bucket/x", "--storage-options", "[1]"], "must be a JSON object"),
        (["s3://bucket/x", "--storage-options", "{x"], "must be a JSON object"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            index_main(args)
        assert exit_.value.code == 2
        assert expected in capsys.readouterr().err
