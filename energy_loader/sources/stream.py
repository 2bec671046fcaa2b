"""StreamSource: batches pulled from a producer the library does not own, by consumer cursor.

The same cursor always gives the same batch, so the state is the cursor (``{"phase", "epoch",
"cursor"}``, -1 before the first fetch); reader ``s`` of ``S`` fetches ``s, s + S, ...``.
Restore key ``(cursor,)``. See docs/sources/stream.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from ..dataset import EpochCursor, Key, SavableDataset, callable_name
from ..errors import StateFormatError, StreamError
from ..state.plain import StateReader
from ..validation import require_callable
from ._download import positive_seconds

__all__ = ["StreamSource"]


class _StreamCursor(EpochCursor):
    dataset: StreamSource

    def __init__(self, dataset: StreamSource) -> None:
        super().__init__(dataset)
        self.cursor = -1

    def begin_epoch(self) -> None:
        if self.cursor < 0:
            self.cursor = self.dataset.context.shard_index

    def resume(self) -> Iterator[tuple[Key, Any]]:
        source = self.dataset
        stride = source.context.num_shards
        while True:
            batch = source.fetch_batch(self.cursor)
            started = time.monotonic()
            while batch is None:
                if source.exhausted(self.cursor):
                    return
                waited = time.monotonic() - started
                if source.fetch_timeout is not None and waited >= source.fetch_timeout:
                    raise StreamError(
                        f"no batch for cursor {self.cursor} from {source.fetch_name} within "
                        f"fetch_timeout={source.fetch_timeout} s (polled every "
                        f"{source.poll_interval} s); is the producer running?"
                    )
                time.sleep(source.poll_interval)
                batch = source.fetch_batch(self.cursor)
            key = (self.cursor,)
            self.cursor += stride
            yield key, batch

    def fields(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_fields(self, reader: StateReader) -> None:
        self.cursor = reader.int("cursor", minimum=-1)
        context = self.dataset.context
        if self.cursor >= 0 and self.cursor % context.num_shards != context.shard_index:
            raise StateFormatError(
                f"{reader.path}.cursor {self.cursor} does not belong to reader "
                f"{context.shard_index} of {context.num_shards} (cursors {context.shard_index}, "
                f"{context.shard_index} + {context.num_shards}, ...)"
            )


class StreamSource(SavableDataset):
    """Pull batches from an outside producer with ``fetch_fn(cursor)``; save the cursor.

    Polling, ``is_exhausted``, timeouts and errors: docs/sources/stream.md. Example::

        client = MyLogClient("broker:9092", topic="rollouts")
        source = StreamSource(client.fetch, is_exhausted=client.is_closed, poll_interval=0.5)
        pipeline = UnbatchDataset(source, micro_batch_size=8)
    """

    def __init__(
        self,
        fetch_fn: Callable[[int], Any],
        *,
        is_exhausted: Callable[[int], bool] | None = None,
        poll_interval: float = 1.0,
        fetch_timeout: float | None = None,
    ) -> None:
        super().__init__()
        require_callable(fetch_fn, "fetch_fn")
        if is_exhausted is not None:
            require_callable(is_exhausted, "is_exhausted")
        self.poll_interval = positive_seconds(poll_interval, "poll_interval")
        self.fetch_timeout = (
            None if fetch_timeout is None else positive_seconds(fetch_timeout, "fetch_timeout")
        )
        self.fetch_fn = fetch_fn
        self.is_exhausted = is_exhausted
        self.fetch_name = callable_name(fetch_fn)

    def fetch_batch(self, cursor: int) -> Any:
        """``fetch_fn(cursor)``, with its failures turned into :class:`StreamError`."""
        try:
            return self.fetch_fn(cursor)
        except Exception as error:
            raise StreamError(
                f"fetch_fn {self.fetch_name} raised at cursor {cursor}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def exhausted(self, cursor: int) -> bool:
        """``is_exhausted(cursor)`` (``False`` without one), checked to be a bool."""
        if self.is_exhausted is None:
            return False
        try:
            answer = self.is_exhausted(cursor)
        except Exception as error:
            raise StreamError(
                f"is_exhausted {callable_name(self.is_exhausted)} raised at cursor {cursor}: "
                f"{type(error).__name__}: {error}"
            ) from error
        if not isinstance(answer, bool):
            raise StreamError(
                f"is_exhausted {callable_name(self.is_exhausted)} must return True or False "
                f"(got {answer!r} at cursor {cursor})"
            )
        return answer

    def _new_cursor(self) -> EpochCursor:
        return _StreamCursor(self)

    def restore_sample(self, key: Key) -> Any:
        if len(key) != 1 or isinstance(key[0], bool) or not isinstance(key[0], int) or key[0] < 0:
            raise ValueError(f"StreamSource restore keys are (cursor,); got {key!r}")
        batch = self.fetch_batch(key[0])
        if batch is None:
            raise StreamError(
                f"fetch_fn {self.fetch_name} returned None for cursor {key[0]}, which it served "
                "before: restoring needs a producer that serves a cursor again (a log, not a "
                "destructive queue)"
            )
        return batch

    def can_restore_sample(self) -> bool:
        return True

    def _config_fields(self) -> dict[str, Any]:
        exhausted = callable_name(self.is_exhausted) if self.is_exhausted is not None else None
        return {"fetch_fn": self.fetch_name, "is_exhausted": exhausted}
