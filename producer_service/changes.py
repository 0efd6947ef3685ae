"""Raw replication messages -> encoded events in the table buffers: the producer's hot path.

`ChangeEncoder.consume` takes the CopyData messages exactly as libpq hands them over and, for the
common INSERT and UPDATE (no old row), goes from pgoutput's TupleData straight to the bytes of a
`Package.events` entry without building any object per change: the few header fields are read
with `struct`, the event's bytes are joined from per-transaction prefixes and cached length
fields (`producer_service.encoding`), and the event lands in its table's buffer by the
packager's rule, inlined. Everything else goes through the pgoutput decoders and `encode_event`.
It also keeps the transaction bookkeeping the progress tracker needs (Begin, Commit) and the
server's WAL positions seen in the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
from producer_service.metrics import ProducerMetrics
from producer_service.packaging import Packager, TableBuffer
from producer_service.pgoutput import layout
from producer_service.pgoutput import messages as m
from producer_service.pgoutput.decoders import decode_message
from producer_service.progress import ProgressTracker
from producer_service.relations import RelationInfo
from siphon_core.replication import KEEPALIVE_FIELDS, XLOG_DATA, XLOG_HEADER, XLOG_PAYLOAD_START
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.tuple_data import project_tuple

# pgoutput's layout (producer_service.pgoutput.layout) at its place in a raw XLogData, where the
# pgoutput message starts after the XLogData header.
_KIND = XLOG_PAYLOAD_START
_BODY = _KIND + layout.BODY
_RELATION_ID = _KIND + layout.CHANGE_RELATION_ID
_MARKER = _KIND + layout.CHANGE_MARKER
_TUPLE = _KIND + layout.CHANGE_TUPLE
_BEGIN, _COMMIT, _INSERT, _UPDATE, _DELETE, _TRUNCATE = (
    layout.BEGIN, layout.COMMIT, layout.INSERT, layout.UPDATE, layout.DELETE, layout.TRUNCATE)
_NEW = layout.NEW_TUPLE
_DELETE_MARKERS = layout.DELETE_MARKERS
_OID = layout.OID.unpack_from
_BEGIN_FIELDS = layout.BEGIN_FIELDS.unpack_from
_COMMIT_FIELDS = layout.COMMIT_FIELDS.unpack_from
_XLOG_DATA = XLOG_DATA
_XLOG_HEADER = XLOG_HEADER.unpack_from
_KEEPALIVE_FIELDS = KEEPALIVE_FIELDS.unpack_from


class Route:
    """Where the changes of one relation go: its column metadata, buffer, subject and counters."""

    __slots__ = ("relation", "keep", "buffer", "subject", "counts")

    def __init__(self, relation: RelationInfo, buffer: TableBuffer, subject: str, metrics: ProducerMetrics) -> None:
        self.relation = relation
        self.keep = relation.keep_indexes
        self.buffer = buffer
        self.subject = subject
        self.counts = metrics.events.for_table(relation.qualified_name)  # indexed by pb.Operation


class ChangeEncoder:
    """Turns a walsender's messages into events buffered per table, in commit order."""

    def __init__(self, packager: Packager, tracker: ProgressTracker, metrics: ProducerMetrics,
                 describe: Callable[[m.Relation], RelationInfo], subject: Callable[[RelationInfo], str]) -> None:
        self._packager = packager
        self._tracker = tracker
        self._metrics = metrics
        self._describe = describe  # column metadata of a Relation message (RelationCatalog.update)
        self._subject = subject
        self.routes: dict[int, Route] = {}
        # The open transaction: its shared event fields, commit LSN, ordinal and last position.
        self._fields: TransactionFields | None = None
        self._commit_lsn = 0
        self._ordinal = -1
        self._position = 0
        self.server_wal_end = 0  # from keepalives
        self.last_received = 0  # the WAL position of the last message
        self.last_commit_at = time.monotonic()

    @property
    def in_transaction(self) -> bool:
        return self._fields is not None

    def subject_of(self, relation_id: int) -> str:
        return self.routes[relation_id].subject

    def consume(self, batch: list[memoryview]) -> bool:
        """Turns a batch of raw replication messages into buffered events; True when the server
        asked for a status reply. The hot path: INSERT and UPDATE without an old row are encoded
        inline; Begin, Commit and DELETE are handled inline too, since a call per message costs a few
        percent there; the rarer messages go to the methods below."""
        routes = self.routes
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
                    reply = self._keepalive(data) or reply
                    continue
                last_xlog = data
                kind = data[_KIND]
                if kind == _INSERT or (kind == _UPDATE and data[_MARKER] == _NEW):
                    route = routes.get(_OID(data, _RELATION_ID)[0]) or self._unknown_relation(data)
                    if kind == _INSERT:
                        if data[_MARKER] != _NEW:
                            layout.expect_marker(data, _MARKER, layout.INSERT_MARKERS, _KIND)
                        prefix = insert_prefix
                        route.counts[pb.INSERT] += 1
                    else:
                        prefix = update_prefix
                        route.counts[pb.UPDATE] += 1
                    new = data[_TUPLE:]
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
                    final_lsn, commit_time, xid = _BEGIN_FIELDS(data, _BODY)
                    commit_lsn = final_lsn
                    fields = TransactionFields(xid, final_lsn, commit_time + m.POSTGRES_EPOCH_OFFSET_US)
                    fixed, time_field, insert_prefix, update_prefix = fields.unpacked()
                    ordinal = tracker.begin()
                    position = 0
                elif kind == _COMMIT:
                    tracker.commit(_COMMIT_FIELDS(data, _BODY)[2])  # the transaction's end LSN
                    fields = None
                    self.last_commit_at = time.monotonic()
                elif kind == _DELETE:
                    route = routes.get(_OID(data, _RELATION_ID)[0]) or self._unknown_relation(data)
                    old_kind = data[_MARKER]
                    if old_kind not in _DELETE_MARKERS:
                        layout.expect_marker(data, _MARKER, _DELETE_MARKERS, _KIND)
                    old = data[_TUPLE:]
                    if route.keep is not None:
                        old = project_tuple(old, route.keep)
                    position += 1
                    route.counts[pb.DELETE] += 1
                    add(route.buffer, encode_event(fields, pb.DELETE, position, None, old, chr(old_kind)),  # type: ignore[arg-type]
                        commit_lsn, position, ordinal)
                elif kind == _UPDATE:  # with the old key or row
                    position = self._update_with_old_row(data, fields, commit_lsn, ordinal, position)  # type: ignore[arg-type]
                elif kind == _TRUNCATE:
                    position = self._truncate(data, fields, commit_lsn, ordinal, position)  # type: ignore[arg-type]
                else:
                    self._on_other(decode_message(data[_KIND:]), fields is None)
        finally:
            self._fields, self._commit_lsn, self._ordinal, self._position = fields, commit_lsn, ordinal, position
        if last_xlog is not None:
            self._received(last_xlog)
        return reply

    def _keepalive(self, data: memoryview) -> bool:
        """Notes the server's WAL end; True when it asks for a reply."""
        wal_end, _, reply_requested = _KEEPALIVE_FIELDS(data, 1)
        if wal_end > self.server_wal_end:
            self.server_wal_end = wal_end
        return reply_requested == 1

    def _received(self, xlog: memoryview) -> None:
        received = max(_XLOG_HEADER(xlog, 1)[:2])  # the data's start and the server's WAL end
        if received > self.last_received:
            self.last_received = received

    def _update_with_old_row(self, data: memoryview, fields: TransactionFields, commit_lsn: int, ordinal: int,
                             position: int) -> int:
        """An UPDATE that changed the key or whose identity is FULL (rare: kept out of the loop);
        returns the transaction's new position."""
        route = self.routes.get(_OID(data, _RELATION_ID)[0]) or self._unknown_relation(data)
        old_kind = layout.expect_marker(data, _MARKER, layout.UPDATE_MARKERS, _KIND)
        end = layout.old_tuple_end(data, _MARKER, _KIND)
        old, new = data[_TUPLE:end], data[end + 1:]
        if route.keep is not None:
            old, new = project_tuple(old, route.keep), project_tuple(new, route.keep)
        position += 1
        route.counts[pb.UPDATE] += 1
        self._packager.add_encoded(route.buffer, encode_event(fields, pb.UPDATE, position, new, old, chr(old_kind)),
                                   commit_lsn, position, ordinal)
        return position

    def _truncate(self, data: memoryview, fields: TransactionFields, commit_lsn: int, ordinal: int,
                  position: int) -> int:
        """One TRUNCATE event per relation the message names; returns the transaction's new position."""
        message = decode_message(data[_KIND:])
        for relation_id in message.relation_ids:  # type: ignore[union-attr]
            route = self.routes.get(relation_id) or self._unknown_relation(data, relation_id)
            position += 1
            route.counts[pb.TRUNCATE] += 1
            self._packager.add_encoded(route.buffer, encode_event(fields, pb.TRUNCATE, position), commit_lsn, position,
                                       ordinal)
        return position

    def _unknown_relation(self, data: memoryview, relation_id: int | None = None) -> Route:
        if relation_id is None:
            relation_id = _OID(data, _RELATION_ID)[0]
        raise RuntimeError(f"change for relation {relation_id} arrived before its Relation message")

    def _on_other(self, message: m.PgoutputMessage, outside_transaction: bool) -> None:
        kind = type(message)
        if kind is m.Relation:
            relation = self._describe(message)  # type: ignore[arg-type]
            # Cuts the events buffered under the table's previous column list (and subject) first.
            buffer = self._packager.buffer_for(relation)
            self.routes[relation.relation_id] = Route(relation, buffer, self._subject(relation), self._metrics)
        elif kind is m.LogicalMessage and not message.transactional and outside_transaction:  # type: ignore[union-attr]
            self._tracker.idle_position(message.lsn)  # type: ignore[union-attr]
        # Origin and Type messages carry nothing a consumer needs: values travel as text.
