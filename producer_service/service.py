"""The producer's main loop: replication stream -> encoded changes -> packages -> JetStream -> confirmed LSN.

One asyncio loop does everything. WAL is read without blocking whenever the replication socket is
readable; changes are encoded straight from pgoutput's bytes into protobuf bytes
(`producer_service.encoding`), packages are cut per table (`packaging`) and published in order
per table (`publisher`), and the LSN sent to PostgreSQL only ever moves to the end of a transaction
whose every package JetStream acked (`progress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from typing import Any

import psycopg

from producer_service import ownership
from producer_service.encoding import (
    CACHED,
    FRAMES,
    NEW_ROW_HEADER_LENGTHS,
    NEW_ROW_HEADERS,
    POSITION_FIELD_LENGTHS,
    POSITION_FIELDS,
    TransactionFields,
    encode_event,
    frame,
    new_row_header,
    position_field,
)
from producer_service.metrics import MetricsServer, ProducerMetrics
from producer_service.packaging import OutgoingPackage, PackageLimits, Packager, TableBuffer
from producer_service.pgoutput import messages as m
from producer_service.pgoutput.decoders import PgoutputError, decode_message
from producer_service.progress import ProgressTracker
from producer_service.publication import check_replica_identities, ensure_publication, ensure_slot
from producer_service.publisher import Publisher
from producer_service.relations import RelationCatalog, RelationInfo
from producer_service.replication import XLOG_PAYLOAD_START, ReplicationConnection
from siphon_core import naming
from siphon_core.config import SiphonConfig
from siphon_core.logs import get_logger
from siphon_core.queue import JetStreamQueue, QueueError, StreamSettings
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.tuple_data import project_tuple, tuple_end

PRODUCER_VERSION = "0.1.0"
HEARTBEAT_PREFIX = "siphon.heartbeat"
log = get_logger("producer")

_XLOG_DATA = ord("w")
_BEGIN, _COMMIT, _INSERT, _UPDATE, _DELETE, _TRUNCATE = b"BCIUDT"
_NEW, _KEY, _OLD = b"NKO"
_P = XLOG_PAYLOAD_START  # offset of the pgoutput message in a raw XLogData
_UINT32 = struct.Struct(">I").unpack_from
_BEGIN_BODY = struct.Struct(">QqI").unpack_from
_COMMIT_BODY = struct.Struct(">BQQq").unpack_from
_KEEPALIVE_BODY = struct.Struct(">QqB").unpack_from
_XLOG_POSITIONS = struct.Struct(">QQ").unpack_from
_GAUGE_SECONDS = 0.5
_STATUS_MIN_SECONDS = 0.1


class _Route:
    """Where the changes of one relation go: its column metadata, buffer, subject and counters."""

    __slots__ = ("relation", "keep", "buffer", "subject", "counts")

    def __init__(self, relation: RelationInfo, buffer: TableBuffer, subject: str, metrics: ProducerMetrics) -> None:
        self.relation = relation
        self.keep = relation.keep_indexes
        self.buffer = buffer
        self.subject = subject
        self.counts = metrics.events.for_table(relation.qualified_name)  # indexed by pb.Operation


class ProducerService:
    def __init__(self, config: SiphonConfig, metrics: ProducerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ProducerMetrics()
        self.slot = config.producer.slot_name or naming.slot_name(config.application_identifier)
        self.publication = config.producer.publication_name or naming.publication_name(config.application_identifier)
        self._stop = asyncio.Event()
        self._tracker = ProgressTracker()
        self._publisher: Publisher | None = None
        self._server_wal_end = 0
        self._last_received = 0
        self._last_status_sent = 0.0
        self._last_activity = time.monotonic()
        self._last_heartbeat = 0.0
        self._gauges_at = 0.0
        self._buffered_events = 0
        self.confirmed_lsn = 0
        self._excluded = {(t.schema_name, t.table_name): set(t.exclude_columns) for t in config.tables}
        self._catalog: RelationCatalog | None = None
        self._queue: JetStreamQueue | None = None
        self._routes: dict[int, _Route] = {}
        # The open transaction: its shared event fields, commit LSN, ordinal and last position.
        self._fields: TransactionFields | None = None
        self._commit_lsn = 0
        self._ordinal = -1
        self._position = 0
        limits = PackageLimits(
            max_events=config.producer.max_package_events,
            max_bytes=config.producer.max_package_bytes,
            max_age_seconds=config.producer.flush_interval_seconds,
            max_message_bytes=config.queue.max_message_bytes,
        )
        self._packager = Packager(config.application_identifier, limits, self._submit,
                                  hold=self._tracker.hold, producer_version=PRODUCER_VERSION)

    def request_stop(self) -> None:
        self._stop.set()

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
        check_replica_identities(connection, self.config.tables)
        change = ensure_publication(connection, self.publication, self.config.tables)
        if change.created:
            log.info("publication created", publication=self.publication, tables=",".join(change.added))
        for name in change.added if not change.created else []:
            # A table joining an existing publication has history the stream never carried.
            log.warning("table added to the publication: take its snapshot (materialize all partitions)",
                        table=name, publication=self.publication)
        for name in change.dropped:
            log.info("table dropped from the publication", table=name, publication=self.publication)
        if ensure_slot(connection, self.slot):
            log.info("replication slot created", slot=self.slot)

    async def run(self) -> None:
        """Runs until `request_stop`, then flushes, waits for acks, confirms and returns."""
        config = self.config
        health_server = None
        # UTF8 as on the replication connection: in a SQL_ASCII database psycopg would otherwise
        # return catalog names as bytes.
        control = psycopg.connect(config.source.dsn, autocommit=True, client_encoding="UTF8",
                                  application_name=f"siphon-producer {config.application_identifier}")
        try:
            if not await self._take_ownership(control):
                return
            if config.producer.metrics_port is not None:
                health_server = MetricsServer(self.metrics, config.producer.metrics_host,
                                              config.producer.metrics_port, self._health)
                health_server.start()
                log.info("metrics and health endpoint",
                         url=f"http://{config.producer.metrics_host}:{health_server.port}")
            self._prepare_source(control)
            self._catalog = RelationCatalog(control, self._excluded)
            self._queue = JetStreamQueue(config.queue.url, StreamSettings(
                config.application_identifier, config.queue.duplicate_window_seconds, config.queue.replicas,
                config.queue.max_message_bytes), name=f"siphon-producer {config.application_identifier}")
            await self._queue.connect()
            await self._queue.ensure_stream()
            self._publisher = Publisher(self._queue, self.metrics, self._on_acked,
                                        config.producer.max_unacked_packages)
            await self._stream(control)
        finally:
            # After a failure nothing of this session may reach the stream once a new one started.
            if self._publisher is not None:
                await self._publisher.close()
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
            await self._loop(replication, control)
            await self._drain(replication)
        finally:
            self.metrics.healthy = False
            replication.close()

    # -- the loop -------------------------------------------------------------------------------

    async def _loop(self, replication: ReplicationConnection, control: psycopg.Connection[Any]) -> None:
        producer = self.config.producer
        publisher = self._publisher
        assert publisher is not None
        packager = self._packager
        while not self._stop.is_set():
            self._raise_publish_failure()
            batch = replication.read_copy_data(max_messages=2000)
            if batch:
                started = time.perf_counter()
                if self._consume(batch):
                    self._send_status(replication, force=True)
                self.metrics.decode_seconds.observe(time.perf_counter() - started)
            else:
                # Caught up with the server: what waits in a buffer may leave now.
                packager.flush_idle(publisher.table_is_idle)
            packager.flush_due()
            await publisher.wait_for_room()
            # Let publish acks run even while WAL keeps arriving.
            await asyncio.sleep(0)
            self._send_status(replication)
            now = time.monotonic()
            if now - self._last_activity >= producer.heartbeat_interval_seconds \
                    and now - self._last_heartbeat >= producer.heartbeat_interval_seconds:
                self._heartbeat(control)
            if now - self._gauges_at >= _GAUGE_SECONDS:
                self._update_gauges()
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

    def _consume(self, batch: list[memoryview]) -> bool:
        """Turns a batch of raw replication messages into buffered events; True when the server
        asked for a status reply. The hot path: INSERT and UPDATE without an old row are encoded
        inline, everything else through `encode_event` and the pgoutput decoders."""
        routes = self._routes
        packager = self._packager
        add, cut, max_events, max_bytes = packager.add_encoded, packager.cut, packager.max_events, packager.max_bytes
        tracker = self._tracker
        fields, commit_lsn, ordinal, position = self._fields, self._commit_lsn, self._ordinal, self._position
        if fields is not None:
            fixed, time_field, insert_prefix, update_prefix = fields.unpacked()
        reply = False
        last_xlog: memoryview | None = None
        try:
            for data in batch:
                if data[0] != _XLOG_DATA:
                    wal_end, _, reply_requested = _KEEPALIVE_BODY(data, 1)
                    if wal_end > self._server_wal_end:
                        self._server_wal_end = wal_end
                    reply = reply or reply_requested == 1
                    continue
                last_xlog = data
                kind = data[_P]
                if kind == _INSERT or (kind == _UPDATE and data[_P + 5] == _NEW):
                    route = routes.get(_UINT32(data, _P + 1)[0]) or self._unknown_relation(data)
                    if kind == _INSERT:
                        if data[_P + 5] != _NEW:
                            raise PgoutputError(f"pgoutput 'I' message: expected 'N' at offset 5, "
                                                f"found {bytes([data[_P + 5]])!r}")
                        prefix = insert_prefix
                        route.counts[pb.INSERT] += 1
                    else:
                        prefix = update_prefix
                        route.counts[pb.UPDATE] += 1
                    new = data[_P + 6:]
                    if route.keep is not None:
                        new = project_tuple(new, route.keep)
                    position += 1
                    length = len(new)
                    if position < CACHED and length < CACHED:
                        pos_field, row_header = POSITION_FIELDS[position], NEW_ROW_HEADERS[length]
                        size = fixed + POSITION_FIELD_LENGTHS[position] + NEW_ROW_HEADER_LENGTHS[length] + length
                    else:
                        pos_field, row_header = position_field(position), new_row_header(length)
                        size = fixed + len(pos_field) + len(row_header) + length
                    framed = b"".join((FRAMES[size] if size < CACHED else frame(size), prefix, pos_field, time_field,
                                       row_header, new))
                    # The packager's add_encoded, inlined for its common case: the buffer is open and has room.
                    buffer = route.buffer
                    events = buffer.events
                    total = buffer.bytes + size
                    if events and total <= max_bytes:
                        events.append(framed)
                        buffer.bytes = total
                        buffer.last_lsn = commit_lsn
                        buffer.last_position = position
                        if len(events) >= max_events or total >= max_bytes:
                            cut(buffer)
                    else:
                        add(buffer, framed, commit_lsn, position, ordinal, size)
                elif kind == _BEGIN:
                    final_lsn, commit_time, xid = _BEGIN_BODY(data, _P + 1)
                    commit_lsn = final_lsn
                    fields = TransactionFields(xid, final_lsn, commit_time + m.POSTGRES_EPOCH_OFFSET_US)
                    fixed, time_field, insert_prefix, update_prefix = fields.unpacked()
                    ordinal = tracker.begin()
                    position = 0
                elif kind == _COMMIT:
                    tracker.commit(_COMMIT_BODY(data, _P + 1)[2])
                    fields = None
                    self._last_activity = time.monotonic()
                elif kind in (_UPDATE, _DELETE):
                    route = routes.get(_UINT32(data, _P + 1)[0]) or self._unknown_relation(data)
                    old_kind = data[_P + 5]
                    if old_kind not in (_KEY, _OLD):
                        raise PgoutputError(f"pgoutput {chr(kind)!r} message: expected 'K' or 'O' at offset 5, "
                                            f"found {bytes([old_kind])!r}")
                    if kind == _UPDATE:
                        end = tuple_end(data, _P + 6)
                        if data[end] != _NEW:
                            raise PgoutputError(f"pgoutput 'U' message: expected 'N' after the old tuple, "
                                                f"found {bytes([data[end]])!r}")
                        old, new = data[_P + 6:end], data[end + 1:]
                    else:
                        old, new = data[_P + 6:], None
                    if route.keep is not None:
                        old = project_tuple(old, route.keep)
                        new = project_tuple(new, route.keep) if new is not None else None
                    position += 1
                    operation = pb.UPDATE if kind == _UPDATE else pb.DELETE
                    route.counts[operation] += 1
                    add(route.buffer, encode_event(fields, operation, position, new, old, chr(old_kind)),  # type: ignore[arg-type]
                        commit_lsn, position, ordinal)
                elif kind == _TRUNCATE:
                    message = decode_message(data[_P:])
                    for relation_id in message.relation_ids:  # type: ignore[union-attr]
                        route = routes.get(relation_id) or self._unknown_relation(data, relation_id)
                        position += 1
                        route.counts[pb.TRUNCATE] += 1
                        add(route.buffer, encode_event(fields, pb.TRUNCATE, position), commit_lsn, position,  # type: ignore[arg-type]
                            ordinal)
                else:
                    self._on_other(decode_message(data[_P:]), fields is None)
        finally:
            self._fields, self._commit_lsn, self._ordinal, self._position = fields, commit_lsn, ordinal, position
        if last_xlog is not None:
            received = max(_XLOG_POSITIONS(last_xlog, 1))
            if received > self._last_received:
                self._last_received = received
        return reply

    def _unknown_relation(self, data: memoryview, relation_id: int | None = None) -> _Route:
        if relation_id is None:
            relation_id = _UINT32(data, _P + 1)[0]
        raise RuntimeError(f"change for relation {relation_id} arrived before its Relation message")

    def _on_other(self, message: m.PgoutputMessage, outside_transaction: bool) -> None:
        kind = type(message)
        if kind is m.Relation:
            assert self._catalog is not None
            relation = self._catalog.update(message)  # type: ignore[arg-type]
            # Cuts the events buffered under the table's previous column list (and subject) first.
            buffer = self._packager.buffer_for(relation)
            subject = naming.table_subject(self.config.application_identifier, relation.schema, relation.table)
            self._routes[relation.relation_id] = _Route(relation, buffer, subject, self.metrics)
        elif kind is m.LogicalMessage and not message.transactional and outside_transaction:  # type: ignore[union-attr]
            self._tracker.idle_position(message.lsn)  # type: ignore[union-attr]
        # Origin and Type messages carry nothing a consumer needs: values travel as text.

    # -- publishing -----------------------------------------------------------------------------

    def _submit(self, outgoing: OutgoingPackage) -> None:
        assert self._publisher is not None
        self._publisher.submit(outgoing, self._routes[outgoing.relation_id].subject)

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
        tracker = self._tracker
        if self._fields is None and not tracker.has_pending:
            tracker.idle_position(self._server_wal_end)
        confirmed = tracker.confirmed_lsn
        now = time.monotonic()
        # A new confirmed position goes out at once, but not more often than _STATUS_MIN_SECONDS:
        # the walsender may save the slot to disk (with fsync) on each one.
        since = now - self._last_status_sent
        if not force and since < self.config.producer.status_interval_seconds \
                and (confirmed == self.confirmed_lsn or since < _STATUS_MIN_SECONDS):
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
        assert self._publisher is not None
        self._packager.flush_all()
        await self._publisher.wait_for_acks()
        self._raise_publish_failure()
        self._update_gauges()
        self._send_status(replication, force=True)
        log.info("stopped", confirmed_lsn=naming.format_lsn(self.confirmed_lsn))

    def _health(self) -> tuple[bool, dict[str, object]]:
        return self.metrics.healthy, {
            "streaming": self.metrics.healthy,
            "confirmed_lsn": naming.format_lsn(self.confirmed_lsn),
            "received_lsn": naming.format_lsn(self._last_received),
            "in_flight_packages": self._publisher.pending if self._publisher is not None else 0,
            "buffered_events": self._buffered_events,  # as of the last gauge update (this runs in another thread)
        }
