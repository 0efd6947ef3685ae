"""The producer's main loop: replication stream -> decoded changes -> packages -> JetStream -> confirmed LSN.

One asyncio loop does everything. WAL is read without blocking whenever the replication socket is
readable; packages are serialized at once and published concurrently (bounded), and the LSN sent
to PostgreSQL only ever moves to the end of a transaction whose every package JetStream acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from producer_service import ownership
from producer_service.metrics import MetricsServer, ProducerMetrics
from producer_service.packaging import OutgoingPackage, PackageLimits, Packager
from producer_service.pgoutput import messages as m
from producer_service.pgoutput.decoders import decode_message
from producer_service.progress import ProgressTracker
from producer_service.publication import check_replica_identities, ensure_publication, ensure_slot
from producer_service.relations import RelationCatalog
from producer_service.replication import Keepalive, ReplicationConnection, XLogData
from siphon_core import naming
from siphon_core.config import SiphonConfig
from siphon_core.logs import get_logger
from siphon_core.queue import JetStreamQueue, StreamSettings
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import encode_package, message_id
from siphon_core.wire.tuple_data import project_tuple

PRODUCER_VERSION = "0.1.0"
HEARTBEAT_PREFIX = "siphon.heartbeat"
log = get_logger("producer")

_OPERATION_NAMES = {pb.INSERT: "insert", pb.UPDATE: "update", pb.DELETE: "delete", pb.TRUNCATE: "truncate"}


@dataclass
class _Transaction:
    xid: int
    commit_lsn: int
    commit_time_us: int
    ordinal: int
    position: int = 0


class ProducerService:
    def __init__(self, config: SiphonConfig, metrics: ProducerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ProducerMetrics()
        self.slot = config.producer.slot_name or naming.slot_name(config.application_identifier)
        self.publication = config.producer.publication_name or naming.publication_name(config.application_identifier)
        self._stop = asyncio.Event()
        self._tracker = ProgressTracker()
        self._transaction: _Transaction | None = None
        self._ready: list[OutgoingPackage] = []
        self._in_flight: set[asyncio.Task[None]] = set()
        self._publish_slots = asyncio.Semaphore(config.producer.max_unacked_packages)
        self._publish_failure: BaseException | None = None
        self._server_wal_end = 0
        self._last_received = 0
        self._last_status_sent = 0.0
        self._last_activity = time.monotonic()
        self._last_heartbeat = 0.0
        self.confirmed_lsn = 0
        excluded = {(t.schema_name, t.table_name): set(t.exclude_columns) for t in config.tables}
        self._excluded = excluded
        self._catalog: RelationCatalog | None = None
        self._queue: JetStreamQueue | None = None
        self._subjects: dict[int, str] = {}
        limits = PackageLimits(
            max_events=config.producer.max_package_events,
            max_bytes=config.producer.max_package_bytes,
            max_age_seconds=config.producer.flush_interval_seconds,
            max_message_bytes=config.queue.max_message_bytes,
        )
        self._packager = Packager(config.application_identifier, limits, self._ready.append,
                                  hold=self._tracker.hold, producer_version=PRODUCER_VERSION)

    def request_stop(self) -> None:
        self._stop.set()

    # -- set-up ---------------------------------------------------------------------------------

    def _prepare_source(self, connection: psycopg.Connection[Any]) -> None:
        ownership.acquire(connection, self.config.application_identifier,
                          wait=self.config.producer.on_lock_held == "wait", log=log)
        check_replica_identities(connection, self.config.tables)
        change = ensure_publication(connection, self.publication, self.config.tables)
        if change.created:
            log.info("publication created", publication=self.publication, tables=",".join(change.added))
        for name in change.added if not change.created else []:
            # A table joining an existing publication has history the stream never carried.
            log.warning("table added to the publication: take its snapshot (materialize all partitions)",
                        table=name)
        for name in change.dropped:
            log.info("table dropped from the publication", table=name)
        if ensure_slot(connection, self.slot):
            log.info("replication slot created", slot=self.slot)

    async def run(self) -> None:
        """Runs until `request_stop`, then flushes, waits for acks, confirms and returns."""
        config = self.config
        health_server = None
        if config.producer.metrics_port is not None:
            health_server = MetricsServer(self.metrics, config.producer.metrics_host, config.producer.metrics_port,
                                          self._health)
            health_server.start()
            log.info("metrics and health endpoint", url=f"http://{config.producer.metrics_host}:{health_server.port}")
        control = psycopg.connect(config.source.dsn, autocommit=True,
                                  application_name=f"siphon-producer {config.application_identifier}")
        try:
            self._prepare_source(control)
            self._catalog = RelationCatalog(control, self._excluded)
            self._queue = JetStreamQueue(config.queue.url, StreamSettings(
                config.application_identifier, config.queue.duplicate_window_seconds, config.queue.replicas,
                config.queue.max_message_bytes), name=f"siphon-producer {config.application_identifier}")
            await self._queue.connect()
            await self._queue.ensure_stream()
            await self._stream(control)
        finally:
            if self._queue is not None:
                await self._queue.close()
            control.close()
            if health_server is not None:
                health_server.stop()

    async def _stream(self, control: psycopg.Connection[Any]) -> None:
        replication = ReplicationConnection(self.config.source.dsn,
                                            application_name=f"siphon-producer {self.config.application_identifier}")
        try:
            replication.start(self.slot, [self.publication], start_lsn=0, messages=True)
            self.metrics.healthy = True
            log.info("streaming", slot=self.slot, publication=self.publication)
            readable = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.add_reader(replication.fileno(), readable.set)
            try:
                await self._loop(replication, control, readable)
            finally:
                loop.remove_reader(replication.fileno())
            await self._drain(replication)
        finally:
            self.metrics.healthy = False
            replication.close()

    # -- the loop -------------------------------------------------------------------------------

    async def _loop(self, replication: ReplicationConnection, control: psycopg.Connection[Any],
                    readable: asyncio.Event) -> None:
        producer = self.config.producer
        while not self._stop.is_set():
            self._raise_publish_failure()
            readable.clear()
            batch = replication.read_batch(timeout=0, max_messages=2000)
            if batch:
                started = time.perf_counter()
                for item in batch:
                    if isinstance(item, XLogData):
                        self._on_wal(item)
                    elif isinstance(item, Keepalive):
                        self._server_wal_end = max(self._server_wal_end, item.wal_end)
                        if item.reply_requested:
                            self._send_status(replication, force=True)
                self.metrics.decode_seconds.observe(time.perf_counter() - started)
            self._packager.flush_due()
            await self._dispatch()
            # Let publish acks run even while WAL keeps arriving.
            await asyncio.sleep(0)
            self._send_status(replication)
            if time.monotonic() - self._last_activity >= producer.heartbeat_interval_seconds \
                    and time.monotonic() - self._last_heartbeat >= producer.heartbeat_interval_seconds:
                self._heartbeat(control)
            if not batch:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(readable.wait(), timeout=min(0.2, producer.flush_interval_seconds))

    def _on_wal(self, item: XLogData) -> None:
        self._last_received = max(self._last_received, item.wal_end or item.data_start)
        message = decode_message(item.payload)
        kind = type(message)
        if kind is m.Insert:
            self._change(message.relation_id, pb.INSERT, message.new_tuple, None, None)
        elif kind is m.Update:
            self._change(message.relation_id, pb.UPDATE, message.new_tuple, message.old_tuple, message.old_kind)
        elif kind is m.Delete:
            self._change(message.relation_id, pb.DELETE, None, message.old_tuple, message.old_kind)
        elif kind is m.Begin:
            self._transaction = _Transaction(message.xid, message.final_lsn, message.commit_time,
                                             self._tracker.begin())
        elif kind is m.Commit:
            self._tracker.commit(message.end_lsn)
            self._transaction = None
            self._last_activity = time.monotonic()
        elif kind is m.Relation:
            assert self._catalog is not None
            relation = self._catalog.update(message)
            self._subjects[relation.relation_id] = naming.table_subject(
                self.config.application_identifier, relation.schema, relation.table)
        elif kind is m.Truncate:
            for relation_id in message.relation_ids:
                self._change(relation_id, pb.TRUNCATE, None, None, None)
        elif kind is m.LogicalMessage and not message.transactional:
            self._tracker.idle_position(message.lsn)
        # Origin and Type messages carry nothing a consumer needs: values travel as text.

    def _change(self, relation_id: int, operation: int, new_tuple: bytes | None, old_tuple: bytes | None,
                old_kind: str | None) -> None:
        transaction = self._transaction
        if transaction is None:
            raise RuntimeError(f"change for relation {relation_id} outside a transaction")
        assert self._catalog is not None
        relation = self._catalog.get(relation_id)
        transaction.position += 1
        event = pb.Event(operation=operation, xid=transaction.xid, commit_lsn=transaction.commit_lsn,
                         position=transaction.position, commit_time_us=transaction.commit_time_us)
        size = 0
        keep = relation.keep_indexes
        if new_tuple is not None:
            event.new_row.tuple = project_tuple(new_tuple, keep) if keep is not None else bytes(new_tuple)
            size += len(event.new_row.tuple)
        if old_tuple is not None:
            event.old_row.tuple = project_tuple(old_tuple, keep) if keep is not None else bytes(old_tuple)
            event.old_row_is_full = old_kind == "O"
            event.old_row_is_key = old_kind == "K"
            size += len(event.old_row.tuple)
        self.metrics.events.labels(relation.qualified_name, _OPERATION_NAMES[operation]).inc()
        self._packager.add(relation, event, size, transaction.ordinal)

    # -- publishing -----------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        ready, self._ready[:] = list(self._ready), []
        for outgoing in ready:
            started = time.perf_counter()
            payload = encode_package(outgoing.package)
            self.metrics.serialize_seconds.observe(time.perf_counter() - started)
            await self._publish_slots.acquire()
            self._raise_publish_failure()
            task = asyncio.create_task(self._publish(outgoing, payload))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
        self.metrics.buffered_events.set(self._packager.buffered_events)
        self.metrics.buffered_bytes.set(self._packager.buffered_bytes)
        self.metrics.in_flight_packages.set(len(self._in_flight))

    async def _publish(self, outgoing: OutgoingPackage, payload: bytes) -> None:
        assert self._queue is not None
        package = outgoing.package
        subject = self._subjects[package.relation_id]
        started = time.perf_counter()
        try:
            async for attempt in AsyncRetrying(stop=stop_after_attempt(5), wait=wait_exponential(0.2, max=5),
                                               retry=retry_if_exception_type(Exception), reraise=True):
                with attempt:
                    await self._queue.publish(subject, payload, message_id(package))
        except BaseException as error:
            self._publish_failure = error
            log.error("publish failed", subject=subject, first_lsn=naming.format_lsn(package.first_commit_lsn),
                      error=repr(error))
            raise
        finally:
            self._publish_slots.release()
        self.metrics.publish_seconds.observe(time.perf_counter() - started)
        table = f"{package.schema}.{package.table}"
        self.metrics.packages.labels(table).inc()
        self.metrics.package_bytes.labels(table).inc(len(payload))
        self._tracker.release(outgoing.first_ordinal)

    def _raise_publish_failure(self) -> None:
        if self._publish_failure is not None:
            raise RuntimeError(f"publishing to JetStream failed: {self._publish_failure!r}") from self._publish_failure

    # -- progress -------------------------------------------------------------------------------

    def _send_status(self, replication: ReplicationConnection, force: bool = False) -> None:
        if not self._tracker.in_flight and self._transaction is None:
            self._tracker.idle_position(self._server_wal_end)
        confirmed = self._tracker.confirmed_lsn
        now = time.monotonic()
        if not force and confirmed == self.confirmed_lsn \
                and now - self._last_status_sent < self.config.producer.status_interval_seconds:
            return
        replication.send_status(max(self._last_received, confirmed), confirmed, confirmed)
        self._last_status_sent = now
        self.confirmed_lsn = confirmed
        self.metrics.acked_lsn.set(confirmed)
        self.metrics.received_lsn.set(self._last_received)
        self.metrics.slot_lag_bytes.set(max(0, max(self._server_wal_end, self._last_received) - confirmed))

    def _heartbeat(self, control: psycopg.Connection[Any]) -> None:
        # A non-transactional logical message gives the slot a position to move to on an idle source.
        control.execute("select pg_logical_emit_message(false, %s, now()::text)", (HEARTBEAT_PREFIX,))
        self._last_heartbeat = time.monotonic()
        self.metrics.heartbeats.inc()

    async def _drain(self, replication: ReplicationConnection) -> None:
        """On stop: everything buffered goes out, every ack is awaited, the final LSN is confirmed."""
        self._packager.flush_all()
        await self._dispatch()
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        self._raise_publish_failure()
        self._send_status(replication, force=True)
        log.info("stopped", confirmed_lsn=naming.format_lsn(self.confirmed_lsn))

    def _health(self) -> tuple[bool, dict[str, object]]:
        return self.metrics.healthy, {
            "streaming": self.metrics.healthy,
            "confirmed_lsn": naming.format_lsn(self.confirmed_lsn),
            "received_lsn": naming.format_lsn(self._last_received),
            "in_flight_packages": len(self._in_flight),
            "buffered_events": self._packager.buffered_events,
        }
