"""Publishing packages to JetStream: pipelined, acknowledged, and never reordered by a retry.

Packages leave in the order they were cut, up to `window` of them awaiting their acks. Each
publish but the first of a round names the previous one in `Nats-Expected-Last-Msg-Id`, so
JetStream stores a package only right after its predecessor: whatever goes wrong (a lost
connection, a restarting server, a stream not loaded yet, a timeout), what this producer stored is
a prefix of what it sent. When a publish fails, the producer lets the ones sent after it settle,
then sends again, in order, every package not acknowledged, the first one without an expectation;
`Nats-Msg-Id` makes JetStream drop the copy of one that had in fact been stored. So each table's
subject holds its packages in commit order even across a restart of the NATS server, and the
slices of a large event stay adjacent, while a table's packages still stream without waiting for
each ack in turn.

A message stored by someone else in between (the consumers' dead letters share the stream) only
makes the next publish fail its expectation and the round start again.

Packages are compressed when submitted, on the loop's thread: zstd at level 1 takes well under a
millisecond for a package, less than handing it to a worker thread and waiting for the GIL to
come back with the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import nats.errors
import nats.js.errors
import zstandard

from producer_service.metrics import ProducerMetrics
from producer_service.packaging import OutgoingPackage
from siphon_core import naming
from siphon_core.logs import get_logger
from siphon_core.queue import JetStreamQueue, QueueError
from siphon_core.wire.packages import ZSTD_LEVEL

log = get_logger("producer")

# Failures that say nothing about the package itself: send the same message again.
_RETRYABLE = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,  # JetStream not ready (a restarted server loading its streams)
    nats.js.errors.ServerError,
    ConnectionError,
)
WRONG_LAST_MESSAGE_ID = 10070  # JetStream's error code for a failed Nats-Expected-Last-Msg-Id
EXPECTED_LAST_MESSAGE_ID = "Nats-Expected-Last-Msg-Id"


class _Item:
    __slots__ = ("package", "subject", "payload", "task", "sent_at")

    def __init__(self, package: OutgoingPackage, subject: str, payload: bytes) -> None:
        self.package = package
        self.subject = subject
        self.payload = payload
        self.task: asyncio.Task[object] | None = None
        self.sent_at = 0.0


class Publisher:
    def __init__(
        self,
        queue: JetStreamQueue,
        metrics: ProducerMetrics,
        acked: Callable[[OutgoingPackage], None],
        max_pending: int,
        window: int = 16,
        publish_timeout_seconds: float = 5.0,
        retry_seconds: float = 120.0,
    ) -> None:
        self._queue = queue
        self._metrics = metrics
        self._acked = acked
        self._max_pending = max_pending
        self._window = max(1, min(window, max_pending))
        self._timeout = publish_timeout_seconds
        self._retry_seconds = retry_seconds
        self._compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self._unsent: deque[_Item] = deque()
        self._in_flight: deque[_Item] = deque()
        self._by_table: dict[int, int] = {}  # relation id -> packages submitted and not yet acked
        self._pending = 0
        self._submitted = asyncio.Event()
        self._settled = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None

    @property
    def pending(self) -> int:
        """Packages submitted and not yet acknowledged."""
        return self._pending

    def submit(self, package: OutgoingPackage, subject: str) -> None:
        started = time.perf_counter()
        payload = self._compressor.compress(package.payload)
        package.payload = b""  # only the compressed bytes wait for their turn
        self._metrics.serialize_seconds.observe(time.perf_counter() - started)
        self._unsent.append(_Item(package, subject, payload))
        self._pending += 1
        self._by_table[package.relation_id] = self._by_table.get(package.relation_id, 0) + 1
        self._submitted.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def table_is_idle(self, relation_id: int) -> bool:
        """Nothing of this table waits to be sent or acknowledged."""
        return not self._by_table.get(relation_id)

    async def wait_for_room(self, timeout: float) -> bool:
        """Backpressure: True once fewer than `max_pending` packages await their acks (or publishing
        failed), False after `timeout` seconds without room."""
        deadline = time.monotonic() + timeout
        while self._pending >= self._max_pending and self.failure is None:
            self._settled.clear()
            try:
                await asyncio.wait_for(self._settled.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
        return True

    async def wait_for_acks(self) -> None:
        while self._pending and self.failure is None:
            self._settled.clear()
            await self._settled.wait()

    async def close(self) -> None:
        """Stops publishing (after a failure nothing this publisher holds may be stored later)."""
        tasks = [item.task for item in self._in_flight if item.task is not None]
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    # -- the sender ---------------------------------------------------------------------------

    async def _run(self) -> None:
        expected: str | None = None  # the stream's last message id we know of (None: first of a round)
        # When the current run of failures began: the budget counts from there, not from the last ack,
        # or a producer idle for longer than the budget would give up at its first failed publish.
        failing_since: float | None = None
        delay = 0.1
        try:
            while True:
                while self._unsent and len(self._in_flight) < self._window:
                    item = self._unsent.popleft()
                    # Tasks start in creation order, and a publish is written before its first wait.
                    item.task = asyncio.get_running_loop().create_task(self._publish(item, expected))
                    item.sent_at = time.perf_counter()
                    expected = item.package.message_id
                    self._in_flight.append(item)
                if not self._in_flight:
                    self._submitted.clear()
                    await self._submitted.wait()
                    continue
                head = self._in_flight[0]
                if not head.task.done() and len(self._in_flight) < self._window:  # type: ignore[union-attr]
                    # Wait for the oldest ack, or for a new package to send meanwhile.
                    self._submitted.clear()
                    submitted = asyncio.get_running_loop().create_task(self._submitted.wait())
                    await asyncio.wait((head.task, submitted), return_when=asyncio.FIRST_COMPLETED)  # type: ignore[arg-type]
                    submitted.cancel()
                    if not head.task.done():  # type: ignore[union-attr]
                        continue
                error = await self._outcome(head)
                if error is None:
                    self._in_flight.popleft()
                    self._done(head)
                    failing_since = None
                    delay = 0.1
                    continue
                # The chain broke at `head`: what was sent after it settles (stored only if `head`
                # was), then every package not acknowledged goes again, in order.
                failed = [head]
                for item in list(self._in_flight)[1:]:
                    if await self._outcome(item) is None:
                        self._done(item)
                    else:
                        failed.append(item)
                self._in_flight.clear()
                self._unsent.extendleft(reversed(failed))
                expected = None
                if _is_broken_chain(error):
                    continue  # someone else's message came in between: no need to wait
                if failing_since is None:
                    failing_since = head.sent_at
                if time.perf_counter() - failing_since > self._retry_seconds:
                    raise QueueError(f"publishing package {head.package.message_id} to {head.subject} failed for "
                                     f"{self._retry_seconds:.0f}s: {error!r}")
                log.warning("publish failed; sending again from the first unacknowledged package",
                            subject=head.subject, packages=len(failed), retry_in_seconds=delay,
                            first_lsn=naming.format_lsn(head.package.first_commit_lsn), error=repr(error))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self.failure = error
            self._settled.set()

    async def _publish(self, item: _Item, expected: str | None) -> object:
        headers = {"Nats-Msg-Id": item.package.message_id}
        if expected is not None:
            headers[EXPECTED_LAST_MESSAGE_ID] = expected
        return await self._queue.js.publish(item.subject, item.payload, timeout=self._timeout,
                                            stream=self._queue.settings.stream, headers=headers)

    async def _outcome(self, item: _Item) -> BaseException | None:
        """None when JetStream acknowledged the package; the error when it may be sent again."""
        assert item.task is not None
        try:
            await item.task
            return None
        except _RETRYABLE as error:
            return error
        except nats.js.errors.APIError as error:
            if _is_broken_chain(error):
                return error
            raise QueueError(f"JetStream refused package {item.package.message_id} on {item.subject}: "
                             f"{error}") from None
        except nats.errors.Error as error:  # e.g. MaxPayloadError: the package itself is the problem
            raise QueueError(f"cannot publish package {item.package.message_id} on {item.subject}: "
                             f"{error!r}") from None

    def _done(self, item: _Item) -> None:
        package = item.package
        self._metrics.publish_seconds.observe(time.perf_counter() - item.sent_at)
        self._metrics.packages.labels(package.table).inc()
        self._metrics.package_bytes.labels(package.table).inc(len(item.payload))
        self._pending -= 1
        remaining = self._by_table[package.relation_id] - 1
        if remaining:
            self._by_table[package.relation_id] = remaining
        else:
            del self._by_table[package.relation_id]
        self._acked(package)
        self._settled.set()


def _is_broken_chain(error: BaseException) -> bool:
    return isinstance(error, nats.js.errors.APIError) and error.err_code == WRONG_LAST_MESSAGE_ID
