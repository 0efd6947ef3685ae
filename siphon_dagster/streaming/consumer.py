"""`StreamConsumer`: the streaming apply loop of one (target, table).

A durable pull consumer on the table's subject; micro-batches cut by count, bytes and time; decode
and fold in Spark; applied through the target; acked only after the target committed. A crash
anywhere means redelivery, never loss, and duplicates are harmless under the version rule.

Order matters for one thing: an unchanged TOASTed value is filled from the target's stored row,
which must hold every earlier change. JetStream redelivers an unacknowledged message only after
its ack wait, while newer messages flow at once; so a run that finds messages left unacknowledged
by a previous run rewinds the consumer to its ack floor first, and the stream replays in order.
Within a run, every message pulled and not yet acked is marked in progress at a third of the
consumer's ack wait, so that a batch slower than the ack wait (a slow warehouse, a large batch)
is not redelivered and applied again while it is still being written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo, DeliverPolicy
from pyspark.sql import SparkSession

from siphon_core import naming
from siphon_core.config import StreamingConfig, TableConfig
from siphon_core.logs import get_logger
from siphon_core.queue import JetStreamQueue
from siphon_core.wire.packages import PackageError
from siphon_dagster.streaming.apply import AppliedBatch, BatchApplier, PreparedBatch
from siphon_dagster.streaming.batch import MAX_EXPANSION_OF_MESSAGE_LIMIT, PackageAssembler, ReceivedPackage
from siphon_dagster.streaming.interrupts import run_interruptibly
from siphon_dagster.streaming.pace import GATHERED_PACED, gathering
from siphon_dagster.streaming.report import BatchReport, RunSummary
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.streaming.strategy import ErrorStrategy, RetryPolicy, StreamApplyError
from siphon_dagster.streaming.turns import Turn, Turns
from siphon_dagster.targets.base import Target

_log = get_logger("streaming.consumer")
_Result = TypeVar("_Result")
_FETCH_STEP = 64  # messages per pull request: bounds how far a batch overshoots its byte limit
# A group run's pull asks for as many messages as the batch's byte budget holds at the size of
# those taken so far, up to this many a request: a backlog of small messages otherwise took 16
# round trips a batch, slow in a run of hundreds of tables.
_FETCH_STEP_MAX = 1000
_PROGRESS_SHARE_OF_ACK_WAIT = 1 / 3  # in-progress marks are sent this often, as a share of the ack wait
_ACK_CONFIRM_SECONDS = 30.0  # how long the last ack of a batch waits for the server's confirmation
# A batch pulled while no other is in flight (a run's first, or the first after the table was
# quiet) is cut at this share of batch_max_bytes: behind a backlog it is decoded while nothing is
# written yet, and a full one kept the target idle that long (a quarter of a one-table backlog's
# apply went to its first batch).
_FIRST_BATCH_SHARE = 1 / 4
# How long a request for the messages already waiting lingers when there are none.
_TAKE_WAITING_SECONDS = 0.1
# Requests in a row that may bring nothing while the server said more messages were waiting.
_TAKE_WAITING_MISSES = 3


class StreamConsumer:
    """Applies one table's stream to one target. Not thread-safe; `stop()` may be called from any thread."""

    def __init__(self, queue: JetStreamQueue, target: Target, table: TableConfig,
                 spark: SparkSession | Callable[[], SparkSession],
                 streaming: StreamingConfig | None = None, source: SourceRowReader | None = None,
                 retry: RetryPolicy | None = None, run_tables: int = 1,
                 remote_spark: bool = False) -> None:
        self.queue = queue
        self.target = target
        self.table = table
        self.streaming = streaming or StreamingConfig()
        application = queue.settings.application_identifier
        self.subject = naming.table_subject(application, table.schema_name, table.table_name)
        self.durable = naming.consumer_name(target.name, table.schema_name, table.table_name)
        self.applier = BatchApplier(spark, target, table.schema_name, table.table_name, source,
                                    driver_decode_max_bytes=self.streaming.driver_decode_limit(run_tables, remote_spark))
        self.strategy = ErrorStrategy(
            table.on_error, queue, self.applier, retry or RetryPolicy(),
            dead_letter_subject=naming.dead_letter_subject(application, table.schema_name, table.table_name),
            durable=self.durable)
        self._assembler = PackageAssembler(
            table.schema_name, table.table_name,
            max_package_bytes=MAX_EXPANSION_OF_MESSAGE_LIMIT * queue.settings.max_message_bytes)
        self._held: dict[int, Msg] = {}  # slices of an event whose last slice has not arrived
        self._unacked: dict[int, Msg] = {}  # every message pulled and not yet acked, by id()
        self.progress_interval_seconds: float | None = None  # None: a third of the consumer's ack wait
        # With a value, a batch's first message is awaited this long by one pull request (a quiet
        # table then costs one request per interval); None: batch_max_wait_seconds, as a by-hand run.
        self.idle_pull_seconds: float | None = None
        # False: a batch's pending count is read from its last message's metadata (what JetStream
        # had not delivered then) instead of a consumer-info request per batch; a group run's
        # hundreds of tables then send no request per batch beyond pull and ack.
        self.exact_pending = True
        # A group run paces its tables: how long a batch collects after its first message, and a
        # gate that lets a few consumers at a time set themselves up (each costs JetStream requests).
        self.batch_wait: Callable[[], float] | None = None
        self.setup_gate: asyncio.Semaphore | None = None
        # A group run decodes on a few threads of its own (CPU work under one interpreter lock: more
        # threads decoding at once only take turns, and starve the event loop of the lock), apart
        # from the threads that wait on the target and Spark.
        self.cpu_executor: Executor | None = None
        self.on_ready: Callable[[], None] | None = None  # called once the consumer is set up
        # False: one batch in flight, pulled only once the one before is acked. Pulling and
        # decoding ahead speeds a table that has the process to itself, but a run of hundreds of
        # tables has more batches than threads: each table's batches ahead only wait in the queue
        # for a thread, and every batch in it waits longer.
        self.pipelined = True
        # A group run's turns: a batch takes its waiting messages only once it holds one, and gives
        # it back once it is acked. With more busy tables than the run writes at once, batches then
        # wait for their turn in the queue, still taking what arrives, instead of waiting pulled and
        # stale behind the others. Only without `pipelined` (one batch in flight). A table's first
        # batch goes ahead of the others' later ones (see turns.Turns).
        self.turns: Turns | None = None
        self._applied_any = False  # whether a batch of this consumer was applied
        self.strategy.sleep = self._wait_without_turn
        self._turn: Turn | None = None  # the turn this table's batch holds
        self._turn_seconds = 0.0  # how long the batch being pulled waited for its turn
        self._gathered: str | None = None  # how the batch being pulled gathered (GATHERED_*), group runs only
        self._last_schema: object = None
        self._first_message_at = 0.0  # when a group run's pull got its batch's first message
        self._stopping = threading.Event()
        # The same request, for what waits on the event loop (a turn): set from stop() on any thread.
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None

    def stop(self) -> None:
        """Asks the run to return after the batch in progress."""
        self._stopping.set()
        loop, stop_requested = self._event_loop, self._stop_requested
        if loop is not None and stop_requested is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended: nothing waits on it
                loop.call_soon_threadsafe(stop_requested.set)

    def run(self, stop_when_drained: bool = False, max_batches: int | None = None,
            on_batch: Callable[[BatchReport], None] | None = None) -> RunSummary:
        return run_interruptibly(self.run_async(stop_when_drained, max_batches, on_batch))

    async def run_async(self, stop_when_drained: bool = False, max_batches: int | None = None,
                        on_batch: Callable[[BatchReport], None] | None = None) -> RunSummary:
        summary = RunSummary()
        self._event_loop, self._stop_requested = asyncio.get_running_loop(), asyncio.Event()
        if self._stopping.is_set():
            self._stop_requested.set()
        # A queue already connected is shared with other tables' consumers (a group run): its
        # owner closes it.
        owns_connection = not self.queue.is_connected
        if owns_connection:
            await self.queue.connect()
        try:
            async with self.setup_gate or contextlib.nullcontext():
                await self.queue.ensure_stream()
                info = await self._rewind_if_interrupted(await self.queue.ensure_consumer(self.durable, self.subject))
                subscription = await self.queue.bind(self.durable)
            if self.on_ready is not None:
                self.on_ready()
            progress = asyncio.create_task(self._mark_in_progress(self._progress_interval(info)))
            try:
                await self._loop(subscription, summary, stop_when_drained, max_batches, on_batch)
            finally:
                progress.cancel()
                # Unacknowledged messages of a failed batch wait for the next run, which replays them.
                await subscription.unsubscribe()
        finally:
            if owns_connection:
                await self.queue.close()
        return summary

    async def _loop(self, subscription: JetStreamContext.PullSubscription, summary: RunSummary,
                    stop_when_drained: bool, max_batches: int | None,
                    on_batch: Callable[[BatchReport], None] | None) -> None:
        # Three batches are in flight at most: batch N is written to the target while batch N+1,
        # when its messages are already here and its schema is unchanged, is decoded and folded in
        # Spark, and batch N+2 is pulled. Messages pulled or prepared ahead but never written stay
        # unacknowledged, and the next run replays them in order.
        ahead: asyncio.Task[list[Msg]] | None = None
        following: _Batch | None = None
        finishing: asyncio.Task[BatchReport | None] | None = None
        try:
            while not self._stopping.is_set() and (max_batches is None or summary.batches < max_batches):
                self._end_turn()  # a turn covers one batch, from its take to its ack
                if following is not None:
                    batch, following = following, None
                else:
                    pulled_at = time.perf_counter()
                    messages = await (ahead if ahead is not None else self._pull(subscription, alone=self.pipelined))
                    # A group run's batch counts from its first message, not from a quiet table's wait.
                    pulled_at = max(pulled_at, self._first_message_at)
                    ahead = None
                    if messages and self.pipelined and _below(max_batches, summary.batches + 1):
                        ahead = asyncio.create_task(self._pull(subscription))
                    batch = await self._assemble(messages, pulled_at) if messages else None
                report = None
                if batch is not None:
                    finishing = asyncio.create_task(self._finish(batch))
                    if ahead is not None and _below(max_batches, summary.batches + 1):
                        await asyncio.wait({ahead, finishing}, return_when=asyncio.FIRST_COMPLETED)
                        if ahead.done() and not finishing.done():
                            following, ahead = await self._assemble_following(batch, ahead, finishing, subscription,
                                                                              _below(max_batches, summary.batches + 2))
                    # Shielded: an interrupt here leaves the batch to end (written, acked) in the
                    # `finally` below, which reports it, rather than cut between its ack and its report.
                    report = await asyncio.shield(finishing)
                    finishing = None
                if report is not None:
                    self._applied_any = True
                    summary.add(report)
                    _log.info("batch applied", table=self.table.name, target=self.target.name,
                              sequences=f"{report.first_sequence}-{report.last_sequence}", events=report.events,
                              rows=report.rows_applied, lsn=report.applied_lsn_text, pending=report.pending,
                              seconds=round(report.latency_seconds, 3))
                    if on_batch is not None:
                        on_batch(report)
                if stop_when_drained and following is None:
                    pending = report.pending if report is not None else await self._pending()
                    if pending <= 0 and (ahead is None or not await ahead):
                        return
                # Nothing of a written batch outlives it. The next pull waits for the table's next
                # message and a turn, and through that wait a run of hundreds of tables kept every
                # table's last batch: its messages, packages and folded rows. Behind a backlog, when
                # batches are full, that grew the run by hundreds of MB.
                messages, batch, report = [], None, None
        finally:
            if ahead is not None:
                ahead.cancel()
                # It ends before the run's connection closes; else the client turns its
                # cancellation into a ConnectionClosedError that asyncio reports at the run's end.
                await asyncio.wait({ahead})
                _outcome_seen(ahead)
            if finishing is not None:
                ended: BatchReport | None = None
                with contextlib.suppress(Exception):
                    ended = await finishing  # a batch being written is written and acked, never left half-done
                if ended is not None:  # and reported: the caller hands on a report the interrupt cancels
                    summary.add(ended)
                    if on_batch is not None:
                        with contextlib.suppress(Exception):
                            on_batch(ended)
            self._end_turn()
            if following is not None and following.early is not None:
                with contextlib.suppress(Exception):
                    await following.early  # its thread runs on; let it end before the run does

    async def _assemble_following(self, batch: _Batch, ahead: asyncio.Task[list[Msg]],
                                  finishing: asyncio.Task[BatchReport | None],
                                  subscription: JetStreamContext.PullSubscription,
                                  pull_more: bool) -> tuple[_Batch | None, asyncio.Task[list[Msg]] | None]:
        """The next batch, assembled while this one is written, its Spark work started early."""
        pulled_at = time.perf_counter()
        try:
            messages = ahead.result()
            if not messages:
                return None, None
            following = await self._assemble(messages, pulled_at, after=batch)
        except BaseException:
            with contextlib.suppress(Exception):
                await finishing  # the batch before is applied and acked first
            raise
        return following, asyncio.create_task(self._pull(subscription)) if pull_more else None

    async def _rewind_if_interrupted(self, info: ConsumerInfo) -> ConsumerInfo:
        """Replays from the ack floor when a previous run left messages unacknowledged; the
        consumer's info, as it is now."""
        if not info.num_ack_pending:
            return info
        js = self.queue.js
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        config = dataclasses.replace(info.config, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                     opt_start_seq=floor + 1)
        _log.warning("previous run left messages unacknowledged; replaying from the ack floor",
                     table=self.table.name, target=self.target.name, unacknowledged=info.num_ack_pending,
                     from_sequence=floor + 1)
        await js.delete_consumer(self.queue.settings.stream, self.durable)
        return await self.queue.add_consumer(config)

    async def _pull(self, subscription: JetStreamContext.PullSubscription, alone: bool = False) -> list[Msg]:
        """Up to batch_max_messages / batch_max_bytes, waiting at most batch_max_wait_seconds (or
        the group run's pace) after the first message; `alone`: no other batch is in flight, and
        the batch is cut at `_FIRST_BATCH_SHARE` of the byte limit."""
        limits = self.streaming
        wait = self.batch_wait() if self.batch_wait is not None else limits.batch_max_wait_seconds
        if self.idle_pull_seconds is not None:
            return await self._pull_gathered(subscription, wait)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        max_messages = limits.batch_max_messages
        max_bytes = max(1, int(limits.batch_max_bytes * _FIRST_BATCH_SHARE)) if alone else limits.batch_max_bytes
        messages: list[Msg] = []
        size = 0
        while len(messages) < max_messages and size < max_bytes:
            remaining = deadline - loop.time()
            if remaining < 0.01:
                break
            step = min(max_messages - len(messages), _FETCH_STEP)
            if alone:  # a close cut: one message, then what the byte limit holds at their size
                step = fetch_step(step, max_bytes - size, size / len(messages), least=1) if messages else 1
            try:
                got = await subscription.fetch(step, timeout=remaining)
            except TimeoutError:
                break
            messages += got
            size += sum(len(m.data) for m in got)
            self._unacked.update((id(m), m) for m in got)
        return messages

    async def _pull_gathered(self, subscription: JetStreamContext.PullSubscription, wait: float) -> list[Msg]:
        """A group run's pull: one request waits (up to idle_pull_seconds) for a batch's first
        message; unless more were already waiting behind it, the batch then gathers for `wait`
        seconds on the server's side, and what arrived is taken in a request or two. Pulling each
        message as it arrives would cost a table two requests per message, and a run of hundreds
        of tables spends its time (and the queue's) on them."""
        try:
            first = await subscription.fetch(1, timeout=self.idle_pull_seconds)
        except TimeoutError:
            return []
        self._first_message_at = time.perf_counter()
        self._unacked.update((id(m), m) for m in first)
        # The pace's wait is skipped while every turn is taken: the batch gathers in the line for its
        # turn, and waiting first as well only made a quiet table's change later (p95 16.9 -> 13.6 s
        # at 200 tables). A table's first batch never waits for it: the table is not streaming
        # until that batch lands, and its turns of its own are seldom all taken.
        self._gathered = gathering(bool(first[-1].metadata.num_pending), self._applied_any, self._turns_contended())
        if self._gathered == GATHERED_PACED:
            await asyncio.sleep(wait)
        if not await self._take_turn():
            # Stopped while waiting for a turn: the first message stays unacknowledged, and the next
            # run replays it in order (see _rewind_if_interrupted), so a run of hundreds of tables
            # ends after the batches it is writing, not after one more batch of every table.
            return []
        return first + await self._take_waiting(subscription, len(first), sum(len(m.data) for m in first),
                                                int(first[-1].metadata.num_pending or 0))

    def _turns_contended(self) -> bool:
        return self.turns is not None and not self.pipelined and self.turns.locked()

    async def _take_turn(self) -> bool:
        """Waits for a turn (in a group run); False when the run was stopped first."""
        self._turn_seconds = 0.0
        if self.turns is None or self.pipelined or self._turn is not None:
            return True
        if self._stopping.is_set():
            return False
        first = not self._applied_any
        if not self.turns.locked(first):  # a turn is free: taken without a task or a wait
            self._turn = await self.turns.acquire(first)
            return True
        started = time.perf_counter()
        acquiring = asyncio.ensure_future(self.turns.acquire(first))
        stopped = asyncio.ensure_future(self._stop_requested.wait()) if self._stop_requested is not None else None
        try:
            await asyncio.wait({acquiring, *([stopped] if stopped else [])}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stopped is not None:
                stopped.cancel()
            if not acquiring.done():
                acquiring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquiring
            # A turn granted as the wait ended is held all the same, and given back with the batch
            # (or by the loop's end, when this task was cancelled).
            self._turn = None if acquiring.cancelled() else acquiring.result()
        self._turn_seconds = time.perf_counter() - started
        return self._turn is not None

    async def _wait_without_turn(self, seconds: float) -> None:
        """A failed batch's wait before its retry, with its turn given back: a table whose target
        keeps failing would otherwise hold a turn, and the other tables' batches, through every
        backoff."""
        held = self._turn is not None
        self._end_turn()
        await asyncio.sleep(seconds)
        if held:
            assert self.turns is not None
            self._turn = await self.turns.acquire(not self._applied_any)

    def _end_turn(self) -> None:
        if self._turn is not None:
            turn, self._turn = self._turn, None
            assert self.turns is not None
            self.turns.release(turn)

    async def _take_waiting(self, subscription: JetStreamContext.PullSubscription, count: int,
                            size: int, pending_after: int = 0) -> list[Msg]:
        """The messages waiting for the consumer now, up to the batch limits beyond `count`
        messages of `size` bytes already taken; `pending_after`: how many the server had behind
        the last of those when it delivered it.

        A request's messages that arrive after its short wait (a busy process reads its socket
        late) are not lost, but stay in the subscription until the table's next batch, a whole
        round of the run's tables later, and past the ack wait they are delivered again. Each
        message says how many were still behind it: while the last one taken says some were, the
        batch takes again, up to a few requests that bring nothing."""
        limits = self.streaming
        messages: list[Msg] = []
        misses = 0
        while count < limits.batch_max_messages and size < limits.batch_max_bytes:
            step = fetch_step(limits.batch_max_messages - count, limits.batch_max_bytes - size, size / max(count, 1))
            try:
                got = await subscription.fetch(step, timeout=_TAKE_WAITING_SECONDS)
            except TimeoutError:
                got = []
            messages += got
            count += len(got)
            size += sum(len(m.data) for m in got)
            self._unacked.update((id(m), m) for m in got)
            if got:
                pending_after, misses = int(got[-1].metadata.num_pending or 0), 0
            else:
                misses += 1
            if len(got) < step and not pending_after:  # the server had no more
                break
            if misses > _TAKE_WAITING_MISSES:
                break
        return messages

    def _progress_interval(self, info: ConsumerInfo) -> float:
        if self.progress_interval_seconds is not None:
            return self.progress_interval_seconds
        return max(1.0, float(info.config.ack_wait or 30.0) * _PROGRESS_SHARE_OF_ACK_WAIT)

    async def _mark_in_progress(self, interval: float) -> None:
        """Resets the ack wait of every message pulled and not yet acked, every `interval` seconds."""
        while True:
            await asyncio.sleep(interval)
            for key, message in list(self._unacked.items()):
                if message.is_acked:
                    self._unacked.pop(key, None)
                    continue
                try:
                    await message.in_progress()
                except nats.errors.ConnectionClosedError:
                    return  # the run is ending
                except Exception as error:
                    # A reconnecting client (a full outbound buffer): the next round marks again,
                    # before the ack wait ends, or the message is delivered again and applied twice.
                    _log.warning("could not mark a message in progress; marking again in the next round",
                                 table=self.table.name, error=str(error))
                    break

    async def _assemble(self, messages: Sequence[Msg], pulled_at: float, after: _Batch | None = None) -> _Batch:
        """Whole packages out of the messages (slices wait for their last slice), and their Spark
        work started at once; `after` is a batch still in flight before this one."""
        by_sequence = {**self._held, **{m.metadata.sequence.stream: m for m in messages}}
        numbered = [(m.metadata.sequence.stream, m.data) for m in messages]
        # Decompressing and reading packages is CPU work: on the event loop it would hold up every
        # other table's pulls and acks.
        packages, undecodable = await self._on_cpu(self._accept, numbered)
        dead_lettered: list[int] = []
        for sequence, error in undecodable:
            await self.strategy.undecodable(by_sequence[sequence], sequence, error)
            dead_lettered.append(sequence)
        held = set(self._assembler.held_sequences)
        self._held = {s: by_sequence[s] for s in held if s in by_sequence}
        for message in self._held.values():
            await message.in_progress()  # keeps JetStream from redelivering them while we wait
        done = [s for p in packages for s in p.sequences] + self._assembler.take_abandoned()
        prepared = asyncio.create_task(self._prepare(packages, after)) if packages else None
        turn_seconds, self._turn_seconds = self._turn_seconds, 0.0
        gathered, self._gathered = self._gathered, None
        return _Batch(messages, packages, by_sequence, dead_lettered, done, pulled_at,
                      round(time.perf_counter() - pulled_at - turn_seconds, 4), prepared, turn_seconds, gathered)

    def _accept(self, numbered: Sequence[tuple[int, bytes]]) -> tuple[list[ReceivedPackage],
                                                                       list[tuple[int, PackageError]]]:
        """The whole packages among (stream sequence, data), in order, and the messages that are no
        package; runs on a worker thread."""
        packages: list[ReceivedPackage] = []
        undecodable: list[tuple[int, PackageError]] = []
        for sequence, data in numbered:
            try:
                package = self._assembler.accept(sequence, data)
            except PackageError as error:
                undecodable.append((sequence, error))
                continue
            if package is not None:
                packages.append(package)
        return packages, undecodable

    async def _prepare(self, packages: list[ReceivedPackage], after: _Batch | None) -> PreparedBatch | None:
        """Decode and fold in Spark. Behind a batch in flight, this waits for that batch's own
        preparation (schemas resolve in stream order) and is skipped when the schema changes."""
        # Spark's work runs in other processes: only a batch decoded here goes to the CPU threads.
        run = self._on_cpu if self.applier.decodes_in_driver(packages) else asyncio.to_thread
        if after is None:
            if run is not asyncio.to_thread and not self.applier.schemas.is_current(packages):
                # A new column list waits on the target, which is no work for the CPU threads.
                await asyncio.to_thread(self.applier.ensure_schema, packages)
            return await run(self.applier.prepare, packages)
        if after.early is not None:
            with contextlib.suppress(Exception):
                await after.early
        return await run(self.applier.prepare_early, packages)

    async def _on_cpu(self, function: Callable[..., _Result], *args: object) -> _Result:
        """`function(*args)` on the run's CPU threads (`cpu_executor`), else on a worker thread."""
        if self.cpu_executor is None:
            return await asyncio.to_thread(function, *args)
        return await asyncio.get_running_loop().run_in_executor(self.cpu_executor, function, *args)

    async def _finish(self, batch: _Batch) -> BatchReport | None:
        """Applies the batch, acks it, reports it."""
        timings: dict[str, float] = {"pull": batch.pull_seconds}
        applied: AppliedBatch | None = None
        warnings: list[str] = []
        created = False
        dead_lettered = list(batch.dead_lettered)
        apply_started = time.perf_counter()
        if batch.packages:
            applied, rejected = await self.strategy.apply(batch.packages, batch.by_sequence, batch.early)
            dead_lettered += rejected
            warnings = self.applier.schemas.take_warnings()
            created = self.applier.schemas.take_created()
        elif batch.early is not None:
            await batch.early
        started = time.perf_counter()
        apply_seconds = started - apply_started
        acked = {s for s in batch.done if s in batch.by_sequence and s not in dead_lettered}
        await _ack([batch.by_sequence[s] for s in batch.done if s in acked])
        self._forget_acked(acked)
        timings["ack"] = round(time.perf_counter() - started, 4)
        if not batch.packages and not dead_lettered:
            return None
        schema_changed = False
        if applied is not None:
            timings.update(applied.seconds)
            # What the apply waited beyond its own phases: for a CPU or apply thread, or for the
            # batch before it (a phase of a batch prepared early ran before this wait began).
            timings["queued"] = round(batch.turn_seconds + max(0.0, apply_seconds - sum(applied.seconds.values())), 4)
            schema_changed = self._last_schema is not None and applied.schema != self._last_schema
            self._last_schema = applied.schema
        report = self._report(batch.messages, batch.packages, applied, dead_lettered, batch.pulled_at, timings,
                              await self._pending_after(batch), warnings, batch.gathered)
        if schema_changed or created:
            report = dataclasses.replace(report, schema_changed=schema_changed, created_table=created)
        return report

    def _forget_acked(self, sequences: set[int]) -> None:
        """Stops marking acked messages in progress; an older copy of an acked sequence (a slice
        held, then delivered again) is done with too."""
        for key, message in list(self._unacked.items()):
            if message.is_acked or message.metadata.sequence.stream in sequences:
                del self._unacked[key]

    async def _pending_after(self, batch: _Batch) -> int:
        if self.exact_pending or not batch.messages:
            return await self._pending()
        return int(batch.messages[-1].metadata.num_pending or 0)

    async def _pending(self) -> int:
        """Messages still to apply; held slices count as applied-later, not as pending work."""
        return max(0, await self.queue.pending(self.durable) - len(self._held))

    def _report(self, messages: Sequence[Msg], packages: Sequence[ReceivedPackage], applied: AppliedBatch | None,
                dead_lettered: list[int], pulled_at: float, timings: dict[str, float], pending: int,
                warnings: list[str], gathered: str | None = None) -> BatchReport:
        sequences = [m.metadata.sequence.stream for m in messages]
        applied_packages = [p for p in packages if p.sequence not in dead_lettered]
        operations: dict[str, int] = {}
        for package in applied_packages:
            for name, count in package.operations.items():
                operations[name] = operations.get(name, 0) + count
        now_us = time.time() * 1_000_000
        commit_times = [t for p in applied_packages for t in (p.oldest_commit_time_us, p.newest_commit_time_us) if t]
        return BatchReport(
            target=self.target.name, table=self.table.name,
            first_sequence=min(sequences), last_sequence=max(sequences), messages=len(messages),
            events=sum(operations.values()), rows_by_operation=operations,
            rows_applied=applied.rows if applied is not None else 0,
            applied_lsn=max((p.last_commit_lsn for p in applied_packages), default=0),
            latency_seconds=time.perf_counter() - pulled_at,
            lag_oldest_seconds=(now_us - min(commit_times)) / 1e6 if commit_times else 0.0,
            lag_newest_seconds=(now_us - max(commit_times)) / 1e6 if commit_times else 0.0,
            pending=pending, dead_lettered=tuple(dead_lettered),
            unchanged_values_filled=applied.toast.total if applied is not None else 0,
            seconds=timings, warnings=tuple(warnings),
            prepared_early=applied.prepared_early if applied is not None else False,
            load_path=applied.load_path if applied is not None else None,
            decoded_in_driver=applied.in_driver if applied is not None else False,
            gathered=gathered,
        )


@dataclass
class _Batch:
    """Messages pulled together, assembled into packages, waiting to be applied and acked."""

    messages: Sequence[Msg]
    packages: list[ReceivedPackage]
    by_sequence: dict[int, Msg]  # its messages and the slices held from earlier batches
    dead_lettered: list[int]
    done: list[int]  # stream sequences to ack once the batch is applied
    pulled_at: float
    pull_seconds: float
    early: asyncio.Task[PreparedBatch | None] | None  # its Spark work, started when it was assembled
    turn_seconds: float = 0.0  # how long it waited for a group run's turn before taking its messages
    gathered: str | None = None  # how a group run's batch gathered its messages (GATHERED_*)


def fetch_step(messages_left: int, bytes_left: int, message_bytes: float, least: int = _FETCH_STEP) -> int:
    """Messages to ask for in one pull request: what the byte budget left holds at `message_bytes`
    a message, never fewer than `least` (by default `_FETCH_STEP`, the overshoot a batch always
    allowed) nor more than the messages left or `_FETCH_STEP_MAX`."""
    fits = int(bytes_left / message_bytes) if message_bytes > 0 else _FETCH_STEP_MAX
    return max(1, min(messages_left, _FETCH_STEP_MAX, max(least, fits)))


def _outcome_seen(task: asyncio.Task[Any]) -> None:
    """Marks a task's outcome as seen, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _below(limit: int | None, count: int) -> bool:
    return limit is None or count < limit


async def _ack(messages: Sequence[Msg]) -> None:
    """Acks in order, each message once (a sequence named twice, as a superseded slice and its
    resent copy, is one message); waiting for the last ack's confirmation means every earlier one
    was processed."""
    unique = [m for m in {id(m): m for m in messages}.values() if not m.is_acked]
    if not unique:
        return
    for message in unique[:-1]:
        await message.ack()
    # nats-py waits 1 s by default: a busy server or run would fail an applied batch for nothing.
    await unique[-1].ack_sync(timeout=_ACK_CONFIRM_SECONDS)


__all__ = ["BatchReport", "RetryPolicy", "RunSummary", "StreamApplyError", "StreamConsumer"]
