"""`GroupRunner`: the streaming apply loops of many tables in one process and one event loop.

Each table keeps its own `StreamConsumer` (its durable JetStream consumer, micro-batches, error
strategy and acks); they share the run's NATS connection, Spark session and source connection.
A quiet table costs one pull request waiting on its subject. A table whose consumer stops with an
error (on_error: stop, a schema change the target cannot follow) stops alone: it is reported and
started again with exponential backoff, while the other tables go on.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from siphon_core.config import TableConfig
from siphon_core.logs import get_logger
from siphon_core.queue import JetStreamQueue
from siphon_dagster.streaming.consumer import StreamConsumer
from siphon_dagster.streaming.interrupts import run_interruptibly
from siphon_dagster.streaming.pace import BatchPace
from siphon_dagster.streaming.report import BatchReport, RunSummary
from siphon_dagster.streaming.turns import Turns

_log = get_logger("streaming.group")
SWITCH_INTERVAL_SECONDS = 0.00025  # the run's interpreter switch interval (see GroupRunner.run)


@dataclass(frozen=True)
class TableFailure:
    table: str  # schema.table
    error: BaseException
    attempt: int
    retry_in_seconds: float | None  # None: not retried (the run drains and ends)


@dataclass
class GroupSummary:
    tables: dict[str, RunSummary] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # table -> last error, for tables that ended failed


class GroupRunner:
    """Runs `make_consumer(table)` for every table concurrently until `stop()` (or, with
    `stop_when_drained`, until every table's queue is empty)."""

    def __init__(self, queue: JetStreamQueue, tables: Sequence[TableConfig],
                 make_consumer: Callable[[TableConfig], StreamConsumer],
                 on_batch: Callable[[BatchReport], None], on_failure: Callable[[TableFailure], None],
                 retry_initial_seconds: float = 15.0, retry_max_seconds: float = 600.0,
                 tick: Callable[[], None] | None = None, tick_seconds: float = 5.0,
                 pace: BatchPace | None = None, apply_threads: int = 16, setup_concurrency: int = 8,
                 decode_concurrency: int | None = None, first_batch_turns: int = 0,
                 on_applied: Callable[[BatchReport], None] | None = None) -> None:
        self.queue = queue
        self.tables = list(tables)
        self.make_consumer = make_consumer
        self.on_batch = on_batch
        # Called on the event loop as each batch is acked, before on_batch is queued for the
        # reporting thread: it must be quick (the run's metrics), and it is never late, where the
        # reports fall behind when Dagster's event log is slow.
        self.on_applied = on_applied
        self.on_failure = on_failure
        self.retry_initial_seconds = retry_initial_seconds
        self.retry_max_seconds = retry_max_seconds
        self.tick = tick  # called every `tick_seconds` (e.g. due materializations), on the reporting thread
        self.tick_seconds = tick_seconds
        self._stopping = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._consumers: dict[str, StreamConsumer] = {}
        self.pace = pace  # None: every table's batch collects batch_max_wait_seconds
        # Batches are prepared and written on threads (the target's statements wait on the network);
        # asyncio's default pool of a few threads would queue hundreds of tables behind each other.
        self.apply_threads = apply_threads
        # Turns only tables' first batches take, beyond `apply_threads` (see turns.Turns).
        self.first_batch_turns = first_batch_turns
        self.setup_concurrency = setup_concurrency
        self._setup_gate: asyncio.Semaphore | None = None
        self._turns: Turns | None = None
        # Tables decoding at once: decoding holds the interpreter lock, so more than the cores only
        # take turns, and the event loop (every table's pulls and acks) waits behind them.
        self.decode_concurrency = decode_concurrency or os.cpu_count() or 2
        self._cpu_executor: ThreadPoolExecutor | None = None
        self._ready_tables: set[str] = set()
        self._heap_settled = False
        self._started_at = 0.0
        self._streaming_tables: set[str] = set()  # tables that applied a batch in this run
        self._streaks = FailureStreaks(retry_initial_seconds, retry_max_seconds)
        # Reports (Dagster events, metrics) are written by one thread of their own, in order: an
        # event log write waits on its storage, and the event loop must never wait with it.
        self._reporter: ThreadPoolExecutor | None = None
        # Batch reports not written yet, oldest first; those an interrupt cancels are kept.
        self._batch_reports: deque[tuple[Future[None], BatchReport]] = deque()
        self._unreported: list[BatchReport] = []

    def stop(self) -> None:
        """Asks every table to return after its batch in progress; callable from any thread."""
        self._stopping.set()
        for consumer in list(self._consumers.values()):
            consumer.stop()
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)

    def run(self, stop_when_drained: bool = False) -> GroupSummary:
        # A thread that lets go of the interpreter lock (a pyarrow call, a socket) waits up to the
        # switch interval to take it back from a thread that keeps computing. A run's threads do
        # both all the time (decoding, the event loop, the apply threads, the reports): at the
        # default 5 ms, a decode of 10 ms took 60 to 100 ms, and every table's batch queued behind it.
        previous = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
        try:
            return run_interruptibly(self.run_async(stop_when_drained))
        finally:
            sys.setswitchinterval(previous)

    async def run_async(self, stop_when_drained: bool = False) -> GroupSummary:
        self._loop = asyncio.get_running_loop()
        self._started_at = time.monotonic()
        self._unreported = []
        self._loop.set_default_executor(ThreadPoolExecutor(self.apply_threads + self.first_batch_turns,
                                                           thread_name_prefix="siphon-apply"))
        self._setup_gate = asyncio.Semaphore(self.setup_concurrency)
        # Batches taken at once, one per apply thread (see StreamConsumer.turns).
        self._turns = Turns(self.apply_threads, first_extra=self.first_batch_turns)
        settle_heap()  # what is loaded before the first table starts: Dagster, the definitions
        self._cpu_executor = ThreadPoolExecutor(self.decode_concurrency, thread_name_prefix="siphon-decode")
        self._stopped = asyncio.Event()
        if self._stopping.is_set():
            self._stopped.set()
        summary = GroupSummary()
        self._reporter = ThreadPoolExecutor(1, thread_name_prefix="siphon-report")
        interrupted = False
        try:
            await self.queue.connect()
            try:
                await self.queue.ensure_stream()
                ticker = asyncio.create_task(self._tick()) if self.tick is not None else None
                tables = [asyncio.create_task(self._serve(table, stop_when_drained, summary)) for table in self.tables]
                try:
                    await asyncio.gather(*tables)
                finally:
                    if ticker is not None:
                        ticker.cancel()
                    await self._end(tables)
            finally:
                await self.queue.close()
        except BaseException as error:
            # An interrupt (Dagster terminating the run, Ctrl-C) is not an Exception.
            interrupted = not isinstance(error, Exception)
            raise
        finally:
            self._cpu_executor.shutdown(wait=True)
            # Every report is written before the run returns, unless it was interrupted: a run that
            # caught up on a backlog may have minutes of Dagster events queued, and the batches they
            # describe are applied and acked already. The batches whose reports were cancelled are
            # kept for `unreported_batches`: the caller reports them in a few events at most.
            self._reporter.shutdown(wait=True, cancel_futures=interrupted)
            self._unreported = [report for future, report in self._batch_reports if future.cancelled()]
            self._batch_reports.clear()
        return summary

    async def _end(self, tables: list[asyncio.Task[None]]) -> None:
        """Ends every table's task before the run's connection closes. When one table's task
        raised something no table catches (an interrupt raised in its frame), the others would
        otherwise go on, see the connection close under them and retry against it."""
        self.stop()
        pending = [task for task in tables if not task.done()]
        for task in pending:
            # A batch being written is still written and acked (StreamConsumer._loop); a second
            # cancellation would cut that short, so a task already cancelled (the run's own
            # cancellation reaches every table through the gather) is not cancelled again.
            if not task.cancelling():
                task.cancel()
        if pending:
            await asyncio.wait(pending)

    def unreported_batches(self) -> list[BatchReport]:
        """The batches applied (and acked) whose `on_batch` an interrupt cancelled, in order."""
        return list(self._unreported)

    def _report(self, callback: Callable[..., None], *args: object) -> Future[None] | None:
        def run() -> None:
            try:
                callback(*args)
            except Exception as error:  # reporting must not end the run
                _log.warning("report failed", error=str(error))

        assert self._reporter is not None
        try:
            return self._reporter.submit(run)
        except RuntimeError:  # the run is ending and its reports are closed
            _log.debug("report dropped: the run is ending")
            return None

    async def _serve(self, table: TableConfig, stop_when_drained: bool, summary: GroupSummary) -> None:
        """One table's consumer, started again after a failure with exponential backoff; with
        `stop_when_drained` a failure is reported and not retried."""
        totals = summary.tables.setdefault(table.name, RunSummary())

        def report(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            wait = state.next_action.sleep if state.next_action else None
            self._report(self.on_failure, TableFailure(table.name, error, self._streaks.count(table.name), wait))

        retrying = AsyncRetrying(
            wait=lambda _state: self._streaks.failed(table.name),
            retry=retry_if_exception_type(Exception),
            before_sleep=report,
            sleep=self._sleep,
            reraise=True,
        )
        if stop_when_drained:
            try:
                await self._stream(table, True, totals)
            except Exception as error:
                summary.failed[table.name] = str(error)
                self._report(self.on_failure, TableFailure(table.name, error, 1, None))
            return
        try:
            async for attempt in retrying:
                with attempt:
                    if self._stopping.is_set():
                        return
                    await self._stream(table, False, totals)
        except _Stopping:
            return

    async def _stream(self, table: TableConfig, stop_when_drained: bool, totals: RunSummary) -> None:
        consumer = self.make_consumer(table)
        consumer.setup_gate = self._setup_gate
        consumer.cpu_executor = self._cpu_executor
        consumer.on_ready = lambda: self._ready(table.name)
        if not consumer.pipelined:
            consumer.turns = self._turns
        if self.pace is not None:
            consumer.batch_wait = self.pace.wait_seconds
        self._consumers[table.name] = consumer
        if self._stopping.is_set():
            consumer.stop()
        try:
            await consumer.run_async(stop_when_drained=stop_when_drained, on_batch=lambda r: self._batch(r, totals))
        finally:
            self._consumers.pop(table.name, None)

    def _ready(self, table: str) -> None:
        """Once every table's consumer is set up, what the run holds for good (Dagster's
        definitions, every consumer and target) leaves the cyclic collector's reach."""
        self._ready_tables.add(table)
        if not self._heap_settled and len(self._ready_tables) == len(self.tables):
            self._heap_settled = True
            settle_heap()
            _log.info("every table's consumer is set up", tables=len(self.tables),
                      seconds=round(time.monotonic() - self._started_at, 1))

    def _batch(self, report: BatchReport, totals: RunSummary) -> None:
        self._streaks.applied(report.table)
        if self.pace is not None:
            self.pace.record(report.table)
        if report.table not in self._streaming_tables:
            self._streaming_tables.add(report.table)
            if len(self._streaming_tables) == len(self.tables):
                _log.info("every table applied a batch", tables=len(self.tables),
                          seconds=round(time.monotonic() - self._started_at, 1))
        totals.add(report)
        if self.on_applied is not None:
            try:
                self.on_applied(report)
            except Exception as error:  # like a report, it must not end the run
                _log.warning("recording a batch failed", error=str(error))
        future = self._report(self.on_batch, report)
        if future is not None:  # called on the event loop only
            self._batch_reports.append((future, report))
            while self._batch_reports and self._batch_reports[0][0].done():
                self._batch_reports.popleft()

    async def _sleep(self, seconds: float) -> None:
        """The backoff's wait, cut short when the run stops (the next attempt then returns)."""
        assert self._stopped is not None
        try:
            await asyncio.wait_for(self._stopped.wait(), timeout=seconds)
        except TimeoutError:
            pass
        if self._stopping.is_set():
            raise _Stopping

    async def _tick(self) -> None:
        assert self.tick is not None
        while True:
            await asyncio.sleep(self.tick_seconds)
            self._report(self.tick)


class FailureStreaks:
    """Each table's failures since it last applied a batch, and the wait before its next start:
    `initial` seconds doubling up to `maximum`. A table that streamed again since its last failure
    starts over from `initial`: a stop days after the last one is no reason to wait ten minutes."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._streaks: dict[str, int] = {}

    def failed(self, table: str) -> float:
        """Counts a failure of `table`; returns how long it waits before it starts again."""
        streak = self._streaks.get(table, 0) + 1
        self._streaks[table] = streak
        return min(self.maximum, self.initial * 2 ** (streak - 1))

    def applied(self, table: str) -> None:
        self._streaks.pop(table, None)

    def count(self, table: str) -> int:
        return self._streaks.get(table, 0)


def settle_heap() -> None:
    """Collects what is garbage now, then moves every object alive into the collector's permanent
    generation (`gc.freeze`). A run of hundreds of tables holds millions of long-lived objects
    (Dagster's definitions of every table, consumers, targets), and each full collection walked all
    of them: about a sixth of a core in a run of 200 tables. Refcounting still frees frozen objects."""
    gc.collect()
    gc.freeze()


class _Stopping(Exception):
    """The run stopped during a table's backoff."""

