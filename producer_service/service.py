"""The producer's main loop: replication stream -> encoded changes -> packages -> JetStream -> confirmed LSN.

One asyncio loop does everything. WAL is read without blocking whenever the replication socket is
readable; changes go straight from pgoutput's bytes to protobuf bytes in per-table buffers
(`changes`, `encoding`), packages are cut per table (`packaging`) and published in order
(`publisher`), and the LSN sent to PostgreSQL only ever moves to the end of a transaction whose
every package JetStream acked (`progress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from typing import Any

import nats.errors
import psycopg
from psycopg import sql

from producer_service import ownership
from producer_service.changes import ChangeEncoder
from producer_service.config_watch import ConfigWatcher, TableListChange
from producer_service.connecting import connect_unless_stopped
from producer_service.metrics import MetricsServer, ProducerMetrics
from producer_service.packaging import OutgoingPackage, PackageLimits, Packager
from producer_service.pgoutput import messages as m
from producer_service.progress import ProgressTracker
from producer_service.publication import (
    SourceSetupError,
    check_replica_identities,
    ensure_publication,
    replica_identity_problems,
)
from producer_service.publisher import Publisher
from producer_service.relations import RelationCatalog, RelationInfo
from producer_service.slot_loss import SlotGuard
from siphon_core import naming
from siphon_core.config import SiphonConfig
from siphon_core.logs import get_logger
from siphon_core.queue import JetStreamQueue, QueueError
from siphon_core.redaction import redact_dsn, redact_url
from siphon_core.replication import ReplicationConnection, ReplicationError

PRODUCER_VERSION = "0.1.0"
HEARTBEAT_PREFIX = "siphon.heartbeat"
# How long altering the publication for a table added or removed may wait for the table's lock
# while streaming: the replication stream is not read meanwhile (status replies, acks).
TABLE_CHANGE_LOCK_TIMEOUT_MS = 2000
log = get_logger("producer")

_GAUGE_SECONDS = 0.5
_PUBLISH_TIMEOUT_SECONDS = 5.0
_STATUS_MIN_SECONDS = 0.1
# A stop waits this long for the walsender to take the final confirmed position and end the stream
# (it finishes sending the transaction it is decoding first).
_END_STREAM_SECONDS = 10.0


class ProducerService:
    def __init__(self, config: SiphonConfig, metrics: ProducerMetrics | None = None, accept_slot_loss: bool = False,
                 config_path: str | None = None) -> None:
        self.config = config
        # The operator's acknowledgement that a lost slot may be replaced under on_slot_lost: stop.
        self.accept_slot_loss = accept_slot_loss
        self.config_path = config_path
        self.recorded_slot_loss = False
        self.metrics = metrics or ProducerMetrics()
        self.slot = config.producer.slot_name or naming.slot_name(config.application_identifier)
        self.publication = config.producer.publication_name or naming.publication_name(config.application_identifier)
        self._stop = asyncio.Event()
        self._tracker = ProgressTracker()
        self._publisher: Publisher | None = None
        # Times on the monotonic clock, which counts from the machine's boot: "never" is -inf, not 0,
        # or on a machine up for less than an interval the first one waited for the uptime to pass it.
        self._last_status_sent = -math.inf
        self._last_heartbeat = -math.inf
        self._gauges_at = -math.inf
        self._buffered_events = 0
        self.confirmed_lsn = 0
        self._excluded = {(t.schema_name, t.table_name): set(t.exclude_columns) for t in config.tables}
        self._catalog: RelationCatalog | None = None
        self._watcher = ConfigWatcher(config_path, config) if config_path else None
        self._config_checked_at = -math.inf
        self._table_change_error: str | None = None
        self._queue: JetStreamQueue | None = None
        limits = PackageLimits(
            max_events=config.producer.max_package_events,
            max_bytes=config.producer.max_package_bytes,
            max_age_seconds=config.producer.flush_interval_seconds,
            max_message_bytes=config.queue.max_message_bytes,
            idle_min_age_seconds=config.producer.idle_flush_min_age_seconds,
            idle_packages_per_second=config.producer.idle_flush_packages_per_second,
        )
        self._packager = Packager(config.application_identifier, limits, self._submit,
                                  hold=self._tracker.hold, producer_version=PRODUCER_VERSION)
        self._changes = ChangeEncoder(self._packager, self._tracker, self.metrics, self._describe, self._subject)

    def request_stop(self) -> None:
        self._stop.set()

    def request_config_check(self) -> None:
        """Read siphon.yaml for table changes at the next turn of the loop (SIGHUP)."""
        if self._watcher is not None:
            self._watcher.request_check()
            self._config_checked_at = -math.inf

    # -- set-up ---------------------------------------------------------------------------------

    async def _take_ownership(self, control: psycopg.Connection[Any]) -> bool:
        """The application's lock; False when asked to stop while waiting for it."""
        announced = False
        while not self._stop.is_set():
            refusal = ownership.try_acquire(control, self.config.application_identifier)
            if refusal is None:
                return True
            if self.config.producer.on_lock_held != "wait":
                raise ownership.LockHeldError(refusal + ownership.NOT_WAITING_HINT)
            if not announced:
                log.warning("waiting for the application lock", reason=refusal)
                announced = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=2.0)
        return False

    def _prepare_source(self, connection: psycopg.Connection[Any]) -> None:
        change = ensure_publication(connection, self.publication, self.config.tables)
        if change.created:
            log.info("publication created", publication=self.publication, tables=",".join(change.added))
        for name in change.added if not change.created else []:
            # A table joining an existing publication has history the stream never carried.
            log.warning("table added to the publication: take its snapshot (materialize all partitions)",
                        table=name, publication=self.publication)
        for name in change.dropped:
            log.info("table dropped from the publication", table=name, publication=self.publication)

    async def _secure_slot(self, control: psycopg.Connection[Any], queue: JetStreamQueue) -> None:
        """The slot exists and is usable; a lost one is recorded on the queue before a new one streams.
        After the publication (pgoutput reads it as of each change) and the queue (the gap's record)."""
        guard = SlotGuard(control, queue, self.config.application_identifier, self.slot, self.config.tables,
                          self.metrics, self.config.producer.on_slot_lost, self.accept_slot_loss, self.config_path)
        try:
            await guard.ensure()
        finally:
            self.recorded_slot_loss = guard.recorded_lost

    async def run(self) -> None:
        """Runs until `request_stop`, then flushes, waits for acks, confirms and returns."""
        config = self.config
        health_server = None
        # UTF8 as on the replication connection: in a SQL_ASCII database psycopg would otherwise
        # return catalog names as bytes.
        control = await connect_unless_stopped(
            lambda: psycopg.connect(config.source.conninfo(), autocommit=True, client_encoding="UTF8",
                                    application_name=f"siphon-producer {config.application_identifier}"),
            self._stop, f"PostgreSQL at {redact_dsn(config.source.dsn)}")
        if control is None:
            return
        try:
            if not await self._take_ownership(control):
                return
            if config.producer.metrics_port is not None:
                health_server = MetricsServer(self.metrics, config.producer.metrics_host,
                                              config.producer.metrics_port, self._health)
                health_server.start()
                log.info("metrics and health endpoint",
                         url=f"http://{config.producer.metrics_host}:{health_server.port}")
            check_replica_identities(control, self.config.tables)
            # The queue first: a start that cannot reach it leaves no new publication or slot behind.
            self._queue = JetStreamQueue.from_config(config.queue, config.application_identifier,
                                                     name=f"siphon-producer {config.application_identifier}")
            await self._connect_queue(self._queue)
            self._prepare_source(control)
            self.metrics.configured_tables.set(len(self.config.tables))
            self._catalog = RelationCatalog(control, self._excluded)
            await self._secure_slot(control, self._queue)
            budget = config.producer.publish_retry_seconds
            # An ack that may take longer than the whole budget would leave no room for a retry.
            self._publisher = Publisher(self._queue, self.metrics, self._on_acked,
                                        config.producer.max_unacked_packages,
                                        publish_timeout_seconds=min(_PUBLISH_TIMEOUT_SECONDS, budget / 3),
                                        retry_seconds=budget)
            await self._stream(control)
        finally:
            # Every step runs even when one before it fails: the control connection holds the
            # application's lock, and leaking it would lock out the next attempt.
            try:
                # After a failure nothing of this connection may reach the stream once a new one started.
                if self._publisher is not None:
                    await self._publisher.close()
                if self._queue is not None:
                    await _close_quietly(self._queue)
            finally:
                control.close()
                if health_server is not None:
                    health_server.stop()

    async def _connect_queue(self, queue: JetStreamQueue) -> None:
        """Connects and creates or updates the stream within the publish retry budget: the NATS
        client retries an unreachable server forever, and the producer must instead give up."""
        budget = self.config.producer.publish_retry_seconds
        connected = False

        async def connect() -> None:
            nonlocal connected
            await queue.connect()
            connected = True
            await queue.ensure_stream()

        try:
            await asyncio.wait_for(connect(), budget)
        except TimeoutError:
            what = "did not answer the stream's set-up" if connected else "did not accept a connection"
            raise QueueError(f"NATS at {redact_url(queue.url)} {what} within {budget:g}s "
                             "(producer.publish_retry_seconds)") from None
        except nats.errors.Error as error:  # e.g. JetStream not ready on a server that just started
            raise QueueError(f"cannot create or update the stream {queue.settings.stream} at {redact_url(queue.url)}: "
                             f"{error!r}") from None

    async def _stream(self, control: psycopg.Connection[Any]) -> None:
        replication = ReplicationConnection(self.config.source.conninfo(),
                                            application_name=f"siphon-producer {self.config.application_identifier}")
        try:
            replication.start(self.slot, [self.publication], start_lsn=0, messages=True)
            # The file may have changed since it was loaded: its table list is in force before the
            # producer reports itself streaming, so a change written after that is never taken for
            # one written before.
            if self.config_check_due(time.monotonic()):
                self._check_config(control, time.monotonic())
            self.metrics.healthy = True
            log.info("streaming", slot=self.slot, publication=self.publication)
            await self._loop(replication, control)
            await self._drain(replication)
            self._end_stream(replication)
        finally:
            self.metrics.healthy = False
            replication.close()

    # -- the loop -------------------------------------------------------------------------------

    async def _loop(self, replication: ReplicationConnection, control: psycopg.Connection[Any]) -> None:
        producer = self.config.producer
        publisher = self._publisher
        assert publisher is not None
        packager = self._packager
        changes = self._changes
        while not self._stop.is_set():
            self._raise_publish_failure()
            batch = replication.read_copy_data(max_messages=2000)
            if batch:
                started = time.perf_counter()
                if changes.consume(batch):
                    self._send_status(replication, force=True)
                self.metrics.decode_seconds.observe(time.perf_counter() - started)
            else:
                # Caught up with the server: what waits in a buffer may leave now.
                packager.flush_idle(publisher.table_is_idle)
            packager.flush_due()
            while not await publisher.wait_for_room(timeout=1.0):
                # The queue is slow or away: the walsender must still hear from us, or it drops us.
                self._send_status(replication, force=True)
            # Let publish acks run even while WAL keeps arriving.
            await asyncio.sleep(0)
            self._send_status(replication)
            now = time.monotonic()
            if now - changes.last_commit_at >= producer.heartbeat_interval_seconds \
                    and now - self._last_heartbeat >= producer.heartbeat_interval_seconds:
                self._heartbeat(control)
            if now - self._gauges_at >= _GAUGE_SECONDS:
                self._update_gauges()
            if self.config_check_due(now):
                self._check_config(control, now)
            if not batch:
                await self._wait_readable(replication.fileno(), min(0.2, producer.flush_interval_seconds))

    async def _wait_readable(self, fileno: int, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(fileno, lambda: readable.done() or readable.set_result(None))
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(readable, timeout)
        finally:
            loop.remove_reader(fileno)

    # -- tables added and removed ----------------------------------------------------------------

    def config_check_due(self, now: float) -> bool:
        """Whether the loop reads siphon.yaml at this turn (`now` on the monotonic clock): every
        producer.config_check_seconds (0: only on SIGHUP), once as streaming starts, and at the turn
        after a SIGHUP."""
        if self._watcher is None:
            return False
        if self._config_checked_at == -math.inf:
            return True
        seconds = self.config.producer.config_check_seconds
        return bool(seconds) and now - self._config_checked_at >= seconds

    def _check_config(self, control: psycopg.Connection[Any], now: float) -> None:
        assert self._watcher is not None
        self._config_checked_at = now
        change = self._watcher.poll()
        if change is not None:
            self._apply_table_change(control, change)

    def _apply_table_change(self, control: psycopg.Connection[Any], change: TableListChange) -> None:
        """The publication follows the new table list. An added table that cannot be replicated yet
        (missing, no primary key) is left out while the others are applied; it, or a change that
        cannot be applied at all (a privilege, a lock held too long), is tried again at every
        check, its error logged once."""
        assert self._watcher is not None
        added = [t for t in change.config.tables if t.name in change.added]
        for table in added:
            # Read by the catalog at the table's first Relation message. Set before the publication
            # is altered: a change that fails part-way leaves the tables added before the failure
            # published, and their columns must be left out from their first change on.
            self._excluded[(table.schema_name, table.table_name)] = set(table.exclude_columns)
        try:
            waiting = replica_identity_problems(control, added)
            applied = change.config.model_copy(
                update={"tables": [t for t in change.config.tables if t.name not in waiting]})
            # Altering the publication waits for each table's lock (a long CREATE INDEX, a VACUUM),
            # and the stream waits with it: past the timeout the change is tried at the next check.
            control.execute(sql.SQL("set lock_timeout = {}").format(sql.Literal(f"{TABLE_CHANGE_LOCK_TIMEOUT_MS}ms")))
            try:
                publication = ensure_publication(control, self.publication, applied.tables)
            finally:
                control.execute("reset lock_timeout")
        except (SourceSetupError, psycopg.Error) as error:
            self._refused(" ".join(str(error).split()), change.added, change.removed)
            self._watcher.retry_later()
            return
        self._watcher.accept(dataclasses.replace(change, config=applied))
        self.config = applied
        self.metrics.configured_tables.set(len(applied.tables))
        if waiting:
            # The file is read again at the next check: the tables left out are added once they can be.
            self._refused(" ".join("\n".join(waiting.values()).split()), sorted(waiting), [])
            self._watcher.retry_later()
        else:
            self._table_change_error = None
        for name in publication.added:
            log.warning("table added to the publication: its changes stream from now on; its earlier rows are "
                        "its snapshot's (reload the Dagster code location: with snapshots.auto_load it loads the "
                        "table by itself)", table=name, publication=self.publication)
        for name in publication.dropped:
            log.info("table dropped from the publication", table=name, publication=self.publication)

    def _refused(self, message: str, added: list[str], removed: list[str]) -> None:
        """Logs a table change that cannot be applied yet, once per distinct error."""
        if message != self._table_change_error:
            log.error("siphon.yaml changed its tables, but the change cannot be applied yet; streaming goes "
                      "on without it", added=",".join(added), removed=",".join(removed), error=message)
            self._table_change_error = message

    # -- publishing -----------------------------------------------------------------------------

    def _describe(self, message: m.Relation) -> RelationInfo:
        assert self._catalog is not None
        return self._catalog.update(message)

    def _subject(self, relation: RelationInfo) -> str:
        return naming.table_subject(self.config.application_identifier, relation.schema, relation.table)

    def _submit(self, outgoing: OutgoingPackage) -> None:
        assert self._publisher is not None
        self._publisher.submit(outgoing, self._changes.subject_of(outgoing.relation_id))

    def _on_acked(self, outgoing: OutgoingPackage) -> None:
        self._tracker.release(outgoing.first_ordinal)

    def _raise_publish_failure(self) -> None:
        failure = self._publisher.failure if self._publisher is not None else None
        if failure is not None:
            if isinstance(failure, QueueError):
                raise failure
            raise QueueError(f"publishing to JetStream failed: {failure!r}") from failure

    def _update_gauges(self) -> None:
        self._gauges_at = time.monotonic()
        self._buffered_events = self._packager.buffered_events
        self.metrics.buffered_events.set(self._buffered_events)
        self.metrics.buffered_bytes.set(self._packager.buffered_bytes)
        self.metrics.in_flight_packages.set(self._publisher.pending if self._publisher is not None else 0)

    # -- progress -------------------------------------------------------------------------------

    def _send_status(self, replication: ReplicationConnection, force: bool = False) -> None:
        tracker, changes = self._tracker, self._changes
        if not changes.in_transaction and not tracker.has_pending:
            tracker.idle_position(changes.server_wal_end)
        confirmed = tracker.confirmed_lsn
        now = time.monotonic()
        # A new confirmed position goes out at once, but not more often than _STATUS_MIN_SECONDS:
        # the walsender may save the slot to disk (with fsync) on each one.
        since = now - self._last_status_sent
        if not force and since < self.config.producer.status_interval_seconds \
                and (confirmed == self.confirmed_lsn or since < _STATUS_MIN_SECONDS):
            return
        replication.send_status(max(changes.last_received, confirmed), confirmed, confirmed)
        self._last_status_sent = now
        self.confirmed_lsn = confirmed
        self.metrics.acked_lsn.set(confirmed)
        self.metrics.received_lsn.set(changes.last_received)
        self.metrics.slot_lag_bytes.set(max(0, max(changes.server_wal_end, changes.last_received) - confirmed))

    def _heartbeat(self, control: psycopg.Connection[Any]) -> None:
        # A non-transactional logical message gives the slot a position to move to on an idle source.
        control.execute("select pg_logical_emit_message(false, %s, now()::text)", (HEARTBEAT_PREFIX,))
        self._last_heartbeat = time.monotonic()
        self.metrics.heartbeats.inc()

    async def _drain(self, replication: ReplicationConnection) -> None:
        """On stop: everything buffered goes out, every ack is awaited, the final LSN is confirmed."""
        assert self._publisher is not None
        self._packager.flush_all()
        await self._publisher.wait_for_acks()
        self._raise_publish_failure()
        self._update_gauges()
        self._send_status(replication, force=True)
        log.info("stopped", confirmed_lsn=naming.format_lsn(self.confirmed_lsn))

    def _end_stream(self, replication: ReplicationConnection) -> None:
        """Makes sure the server took the final confirmed position before the connection closes."""
        try:
            if replication.end_stream(_END_STREAM_SECONDS):
                return
            problem = f"it did not end the stream within {_END_STREAM_SECONDS:g}s"
        except ReplicationError as error:
            problem = str(error)
        # Every ack is in: at worst a restart resends what the server had not taken yet.
        log.warning("the source may not have taken the last confirmed position; a restart may resend changes "
                    "after the one it took", confirmed_lsn=naming.format_lsn(self.confirmed_lsn), problem=problem)

    def _health(self) -> tuple[bool, dict[str, object]]:
        return self.metrics.healthy, {
            "streaming": self.metrics.healthy,
            "confirmed_lsn": naming.format_lsn(self.confirmed_lsn),
            "received_lsn": naming.format_lsn(self._changes.last_received),
            "in_flight_packages": self._publisher.pending if self._publisher is not None else 0,
            "buffered_events": self._buffered_events,  # as of the last gauge update (this runs in another thread)
        }


async def _close_quietly(queue: JetStreamQueue) -> None:
    """Closes a connection being dropped; a failure to close (NATS is away) must not hide why."""
    try:
        await queue.close()
    except Exception as error:  # nats-py raises several unrelated types here
        log.warning("closing the NATS connection failed", url=queue.url, error=repr(error))
