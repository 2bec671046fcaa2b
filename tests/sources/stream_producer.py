"""A real producer for the StreamSource tests: a log server in its own process, and its client.

``python -m tests.sources.stream_producer`` serves newline-delimited JSON on 127.0.0.1 (it
prints ``PORT <n>`` when ready). Each named stream has a producer thread that appends batch
``k`` to the stream's log ``(k + 1) * every`` seconds after the stream was created, so a
consumer that is faster than the producer finds nothing yet and must poll (``every=0``: the
whole stream is there from the start). Batches stay in the
log (like a message log with retention), so a cursor can be fetched again after a restore.

Requests: ``create`` (stream, total, batch, every, fail_at), ``fetch`` (stream, cursor),
``exhausted`` (stream, cursor), ``extend`` (stream, more), ``stats`` (stream).
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import sys
import threading
import time
from collections import Counter
from typing import Any, ClassVar


def batch_payload(cursor: int, size: int) -> dict[str, Any]:
    first = cursor * size
    return {
        "index": list(range(first, first + size)),
        "x": [[i, i * i] for i in range(first, first + size)],
    }


class _Stream:
    def __init__(self, total: int, batch: int, every: float, fail_at: int | None) -> None:
        self.total, self.batch, self.every, self.fail_at = total, batch, every, fail_at
        self.produced = 0
        self.fetches: Counter[int] = Counter()
        self.lock = threading.Lock()
        if every == 0:
            self.produced = total  # produced before anyone asks
        else:
            threading.Thread(target=self._produce, daemon=True).start()

    def _produce(self) -> None:
        start = time.monotonic()
        while True:
            with self.lock:
                if self.produced >= self.total:
                    return
                due = start + (self.produced + 1) * self.every
            time.sleep(max(0.0, due - time.monotonic()))
            with self.lock:
                self.produced += 1

    def fetch(self, cursor: int) -> dict[str, Any]:
        with self.lock:
            self.fetches[cursor] += 1
            if cursor == self.fail_at:
                return {"error": f"the producer lost batch {cursor}"}
            if cursor < self.produced:
                return {"batch": batch_payload(cursor, self.batch)}
            return {"batch": None}


class _Handler(socketserver.StreamRequestHandler):
    streams: ClassVar[dict[str, _Stream]] = {}
    lock = threading.Lock()

    def handle(self) -> None:
        for line in self.rfile:
            request = json.loads(line)
            reply = self.answer(request)
            self.wfile.write(json.dumps(reply).encode() + b"\n")
            self.wfile.flush()

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op, name = request["op"], request["stream"]
        if op == "create":
            with self.lock:
                if name not in self.streams:
                    self.streams[name] = _Stream(
                        request["total"], request["batch"], request["every"], request.get("fail_at")
                    )
            return {"ok": True}
        stream = self.streams[name]
        if op == "fetch":
            return stream.fetch(request["cursor"])
        if op == "exhausted":
            with stream.lock:
                done = stream.produced >= stream.total
                return {"exhausted": done and request["cursor"] >= stream.total}
        if op == "extend":
            with stream.lock:
                stream.total += request["more"]
                stream.produced = stream.total
            return {"ok": True}
        if op == "stats":
            with stream.lock:
                return {"fetches": {str(k): v for k, v in stream.fetches.items()}}
        return {"error": f"unknown op {op!r}"}


class StreamClient:
    """``fetch_fn`` for StreamSource: asks the producer server for batch ``cursor``.

    Connects lazily in each process (a loader worker gets its own connection after fork) and
    turns the JSON batch into tensors.
    """

    def __init__(self, port: int, stream: str) -> None:
        self.port, self.stream = port, stream
        self._connection: Any = None
        self._pid = -1

    def _ask(self, **request: Any) -> dict[str, Any]:
        if self._connection is None or self._pid != os.getpid():
            connection = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            self._connection = (connection, connection.makefile("rb"))
            self._pid = os.getpid()
        connection, reader = self._connection
        connection.sendall(json.dumps({"stream": self.stream, **request}).encode() + b"\n")
        reply = json.loads(reader.readline())
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def create(self, total: int, batch: int, every: float, fail_at: int | None = None) -> None:
        self._ask(op="create", total=total, batch=batch, every=every, fail_at=fail_at)

    def __call__(self, cursor: int) -> dict[str, Any] | None:
        import torch  # here, so that the server process starts without importing torch

        payload = self._ask(op="fetch", cursor=cursor)["batch"]
        if payload is None:
            return None
        return {"index": torch.tensor(payload["index"]), "x": torch.tensor(payload["x"]).float()}

    def exhausted(self, cursor: int) -> bool:
        return self._ask(op="exhausted", cursor=cursor)["exhausted"]

    def extend(self, more: int) -> None:
        self._ask(op="extend", more=more)

    def fetch_counts(self) -> dict[int, int]:
        return {int(k): v for k, v in self._ask(op="stats")["fetches"].items()}

    def __getstate__(self) -> dict[str, Any]:
        return {"port": self.port, "stream": self.stream, "_connection": None, "_pid": -1}


def main() -> None:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    # Stop when the test process goes away (stdin closes), whatever happens to it.
    threading.Thread(target=lambda: (sys.stdin.read(), server.shutdown()), daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
