"""Per-table buffers of encoded events, cut into packages by count, size, age and idleness.

Memory stays bounded whatever the transaction size: a buffer is cut as soon as it reaches its
count or byte limit, so a large transaction simply spans several packages. A buffer is also cut
when it is older than the age limit, and, for low latency, as soon as the source has nothing more
to send right now, the buffer is at least `idle_min_age_seconds` old and the table has no package
waiting for its ack (`flush_idle`): under load, events gather while the previous package is
acknowledged, so packages stay large.

An event that alone exceeds the queue's message limit is serialized and sliced (see `Chunk` in
the proto). Events travel as bytes (`producer_service.encoding`), so cutting a package is one
join: envelope, column list, events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from producer_service.encoding import frame, unframe
from producer_service.relations import RelationInfo
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import message_id

# Room for the package envelope (column list, identifiers) around the events.
_ENVELOPE_BYTES = 16_384
_EVENT_OVERHEAD_BYTES = 40


@dataclass(frozen=True)
class PackageLimits:
    max_events: int
    max_bytes: int
    max_age_seconds: float
    max_message_bytes: int  # the queue's hard limit for one message
    # How old a buffer must be before an idle moment of the source cuts it (see `flush_idle`).
    idle_min_age_seconds: float = 0.0
    # Idle cuts over all tables, per second: with more tables holding events than this budget
    # allows at `idle_min_age_seconds`, each buffer waits longer (up to `max_age_seconds`).
    idle_packages_per_second: float | None = None

    def idle_age(self, tables_waiting: int) -> float:
        """How old a buffer must be before an idle moment cuts it, with `tables_waiting` buffers
        holding events."""
        spread = tables_waiting / self.idle_packages_per_second if self.idle_packages_per_second else 0.0
        return min(self.max_age_seconds, max(self.idle_min_age_seconds, spread))

    @property
    def effective_max_bytes(self) -> int:
        """A package never outgrows the queue's message limit, whatever max_bytes says."""
        return min(self.max_bytes, self.max_message_bytes - _ENVELOPE_BYTES)


@dataclass
class OutgoingPackage:
    """A cut package: its serialized (uncompressed) bytes and what publishing it needs."""

    payload: bytes
    relation_id: int
    table: str  # schema.table
    message_id: str
    first_ordinal: int  # earliest transaction with events in it (for progress tracking)
    event_count: int
    raw_bytes: int
    first_commit_lsn: int

    @property
    def package(self) -> pb.Package:
        """The package as a message, parsed from the payload (for tests and diagnostics; the
        publisher keeps only the compressed bytes once it took the package)."""
        package = pb.Package()
        package.ParseFromString(self.payload)
        return package


class TableBuffer:
    """The events of one table (under one column list) waiting to be cut into a package."""

    __slots__ = ("relation", "events", "bytes", "first_ordinal", "first_lsn", "first_position", "last_lsn",
                 "last_position", "opened_at")

    def __init__(self, relation: RelationInfo) -> None:
        self.relation = relation
        self.events: list[bytes] = []
        self.bytes = 0
        self.first_ordinal = -1
        self.first_lsn = self.first_position = self.last_lsn = self.last_position = 0
        self.opened_at = 0.0


class Packager:
    """Collects events per table; `emit` receives each package as soon as it is cut."""

    def __init__(
        self,
        application_identifier: str,
        limits: PackageLimits,
        emit: Callable[[OutgoingPackage], None],
        hold: Callable[[int], None] = lambda ordinal: None,
        producer_version: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._application_identifier = application_identifier
        self._limits = limits
        self.max_events = limits.max_events
        self.max_bytes = limits.effective_max_bytes
        # A single event above this is sliced across messages.
        self.slice_above = limits.max_message_bytes - _ENVELOPE_BYTES
        self._emit = emit
        # Called with a transaction ordinal whenever a buffer or a slice starts holding its events;
        # the package that leaves carries the ordinal so its ack can release it.
        self._hold = hold
        self._producer_version = producer_version
        self._clock = clock
        self._buffers: dict[int, TableBuffer] = {}
        self._sequence: dict[int, int] = {}

    def buffer_for(self, relation: RelationInfo) -> TableBuffer:
        """The buffer of `relation`; events under an older column list of the table go out first."""
        buffer = self._buffers.get(relation.relation_id)
        if buffer is not None and buffer.relation is not relation:
            self.cut(buffer)
            buffer = None
        if buffer is None:
            buffer = self._buffers[relation.relation_id] = TableBuffer(relation)
        return buffer

    def add(self, relation: RelationInfo, event: pb.Event, size_hint: int, ordinal: int) -> None:
        """Adds one event given as a message (the slow path; the service adds encoded events)."""
        body = event.SerializeToString()
        self.add_encoded(self.buffer_for(relation), frame(len(body)) + body, event.commit_lsn, event.position,
                         ordinal, size_hint + _EVENT_OVERHEAD_BYTES)

    def add_encoded(self, buffer: TableBuffer, framed: bytes, commit_lsn: int, position: int, ordinal: int,
                    size: int | None = None) -> None:
        """Adds one framed event (see `producer_service.encoding`) of transaction `ordinal`."""
        if size is None:
            size = len(framed)
        if len(framed) > self.slice_above:
            self.cut(buffer)
            self._emit_sliced(buffer.relation, unframe(framed), commit_lsn, position, ordinal)
            return
        events = buffer.events
        if events and buffer.bytes + size > self.max_bytes:
            self.cut(buffer)
            events = buffer.events
        if not events:
            self.open(buffer, commit_lsn, position, ordinal)
        events.append(framed)
        buffer.bytes += size
        buffer.last_lsn = commit_lsn
        buffer.last_position = position
        if len(events) >= self.max_events or buffer.bytes >= self.max_bytes:
            self.cut(buffer)

    def open(self, buffer: TableBuffer, commit_lsn: int, position: int, ordinal: int) -> None:
        buffer.first_ordinal = ordinal
        buffer.first_lsn = commit_lsn
        buffer.first_position = position
        buffer.opened_at = self._clock()
        self._hold(ordinal)

    def flush_due(self) -> None:
        """Cuts every buffer older than the age limit."""
        deadline = self._clock() - self._limits.max_age_seconds
        for buffer in self._buffers.values():
            if buffer.events and buffer.opened_at <= deadline:
                self.cut(buffer)

    def flush_idle(self, table_is_idle: Callable[[int], bool]) -> None:
        """The source has nothing more right now: cuts the buffers of tables with nothing in flight
        that are at least `idle_min_age_seconds` old. A source that commits in bursts (many small
        transactions a second) is idle between them: without the minimum age each burst would cut
        a package per table, and the queue and every consumer pay per package. With hundreds of
        tables changing, the age grows so that idle cuts stay near `idle_packages_per_second`."""
        waiting = [(relation_id, buffer) for relation_id, buffer in self._buffers.items() if buffer.events]
        opened_by = self._clock() - self._limits.idle_age(len(waiting))
        for relation_id, buffer in waiting:
            if buffer.opened_at <= opened_by and table_is_idle(relation_id):
                self.cut(buffer)

    def flush_all(self) -> None:
        for buffer in self._buffers.values():
            if buffer.events:
                self.cut(buffer)

    @property
    def buffered_events(self) -> int:
        return sum(len(b.events) for b in self._buffers.values())

    @property
    def buffered_bytes(self) -> int:
        return sum(b.bytes for b in self._buffers.values())

    def _envelope(self, relation: RelationInfo, **fields: Any) -> pb.Package:
        sequence = self._sequence.get(relation.relation_id, 0)
        self._sequence[relation.relation_id] = sequence + 1
        return pb.Package(
            application_identifier=self._application_identifier,
            schema=relation.schema,
            table=relation.table,
            relation_id=relation.relation_id,
            value_encoding=pb.PGOUTPUT_TUPLE,
            producer_version=self._producer_version,
            sequence=sequence,
            **fields,
        )

    def cut(self, buffer: TableBuffer) -> None:
        events = buffer.events
        if not events:
            return
        relation = buffer.relation
        envelope = self._envelope(relation, first_commit_lsn=buffer.first_lsn, first_position=buffer.first_position,
                                  last_commit_lsn=buffer.last_lsn, last_position=buffer.last_position)
        count = len(events)
        # Protobuf fields may come in any order: the envelope, then the columns, then the events.
        events[:0] = (envelope.SerializeToString(), relation.columns_wire)
        outgoing = OutgoingPackage(b"".join(events), relation.relation_id, relation.qualified_name,
                                   message_id(envelope), buffer.first_ordinal, count, buffer.bytes,
                                   buffer.first_lsn)
        buffer.events = []
        buffer.bytes = 0
        buffer.first_ordinal = -1
        self._emit(outgoing)

    def _emit_sliced(self, relation: RelationInfo, data: bytes, commit_lsn: int, position: int, ordinal: int) -> None:
        step = max(1024, self.slice_above)
        count = (len(data) + step - 1) // step
        for index in range(count):
            self._hold(ordinal)
            package = self._envelope(relation, first_commit_lsn=commit_lsn, last_commit_lsn=commit_lsn,
                                     first_position=position, last_position=position,
                                     chunk=pb.Chunk(index=index, count=count),
                                     event_chunk=data[index * step:(index + 1) * step])
            package.columns.extend(relation.columns)
            self._emit(OutgoingPackage(package.SerializeToString(), relation.relation_id, relation.qualified_name,
                                       message_id(package), ordinal, 1 if index == count - 1 else 0,
                                       len(package.event_chunk), commit_lsn))
