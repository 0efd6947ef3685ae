"""Per-table buffers of events, cut into packages by count, size and age.

Memory stays bounded whatever the transaction size: a buffer is cut as soon as it reaches its
count or byte limit, so a large transaction simply spans several packages. An event that alone
exceeds the queue's message limit is serialized and sliced (see `Chunk` in the proto).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from producer_service.relations import RelationInfo
from siphon_core.wire import siphon_pb2 as pb

# Room for the package envelope (column list, identifiers) around the events.
_ENVELOPE_BYTES = 16_384
_EVENT_OVERHEAD_BYTES = 40


@dataclass(frozen=True)
class PackageLimits:
    max_events: int
    max_bytes: int
    max_age_seconds: float
    max_message_bytes: int  # the queue's hard limit for one message


@dataclass
class OutgoingPackage:
    package: pb.Package
    first_ordinal: int  # earliest transaction with events in it (for progress tracking)
    event_count: int
    raw_bytes: int


@dataclass
class _TableBuffer:
    relation: RelationInfo
    events: list[pb.Event] = field(default_factory=list)
    bytes: int = 0
    first_ordinal: int = -1
    opened_at: float = 0.0


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
        self._emit = emit
        # Called with a transaction ordinal whenever a buffer or a slice starts holding its events;
        # the package that leaves carries the ordinal so its ack can release it.
        self._hold = hold
        self._producer_version = producer_version
        self._clock = clock
        self._buffers: dict[int, _TableBuffer] = {}
        self._sequence: dict[int, int] = {}

    def add(self, relation: RelationInfo, event: pb.Event, size_hint: int, ordinal: int) -> None:
        """Adds one event of transaction `ordinal`; `size_hint` is its tuples' byte length."""
        buffer = self._buffers.get(relation.relation_id)
        if buffer is not None and buffer.relation is not relation:
            # The table's columns changed: events under the old column list go out first.
            self._cut(buffer)
            buffer = None
        if buffer is None:
            buffer = self._buffers[relation.relation_id] = _TableBuffer(relation)
        size = size_hint + _EVENT_OVERHEAD_BYTES
        if size + _ENVELOPE_BYTES > self._limits.max_message_bytes:
            self._cut(buffer)
            self._emit_sliced(relation, event, ordinal)
            return
        if buffer.events and buffer.bytes + size > self._limits.max_bytes:
            self._cut(buffer)
        if not buffer.events:
            buffer.first_ordinal = ordinal
            buffer.opened_at = self._clock()
            self._hold(ordinal)
        buffer.events.append(event)
        buffer.bytes += size
        if len(buffer.events) >= self._limits.max_events or buffer.bytes >= self._limits.max_bytes:
            self._cut(buffer)

    def flush_due(self) -> None:
        """Cuts every buffer older than the age limit."""
        deadline = self._clock() - self._limits.max_age_seconds
        for buffer in self._buffers.values():
            if buffer.events and buffer.opened_at <= deadline:
                self._cut(buffer)

    def flush_all(self) -> None:
        for buffer in self._buffers.values():
            if buffer.events:
                self._cut(buffer)

    def forget(self, relation_id: int) -> None:
        buffer = self._buffers.pop(relation_id, None)
        if buffer is not None and buffer.events:
            self._cut(buffer)

    @property
    def buffered_events(self) -> int:
        return sum(len(b.events) for b in self._buffers.values())

    @property
    def buffered_bytes(self) -> int:
        return sum(b.bytes for b in self._buffers.values())

    def buffered_events_by_table(self) -> dict[str, int]:
        return {b.relation.qualified_name: len(b.events) for b in self._buffers.values()}

    def _envelope(self, relation: RelationInfo) -> pb.Package:
        sequence = self._sequence.get(relation.relation_id, 0)
        self._sequence[relation.relation_id] = sequence + 1
        package = pb.Package(
            application_identifier=self._application_identifier,
            schema=relation.schema,
            table=relation.table,
            relation_id=relation.relation_id,
            value_encoding=pb.PGOUTPUT_TUPLE,
            producer_version=self._producer_version,
            sequence=sequence,
        )
        package.columns.extend(relation.columns)
        return package

    def _cut(self, buffer: _TableBuffer) -> None:
        if not buffer.events:
            return
        package = self._envelope(buffer.relation)
        package.events.extend(buffer.events)
        first, last = buffer.events[0], buffer.events[-1]
        package.first_commit_lsn, package.first_position = first.commit_lsn, first.position
        package.last_commit_lsn, package.last_position = last.commit_lsn, last.position
        outgoing = OutgoingPackage(package, buffer.first_ordinal, len(buffer.events), buffer.bytes)
        buffer.events = []
        buffer.bytes = 0
        buffer.first_ordinal = -1
        self._emit(outgoing)

    def _emit_sliced(self, relation: RelationInfo, event: pb.Event, ordinal: int) -> None:
        data = event.SerializeToString()
        step = max(1024, self._limits.max_message_bytes - _ENVELOPE_BYTES)
        count = (len(data) + step - 1) // step
        for index in range(count):
            self._hold(ordinal)
            package = self._envelope(relation)
            package.first_commit_lsn = package.last_commit_lsn = event.commit_lsn
            package.first_position = package.last_position = event.position
            package.chunk.index, package.chunk.count = index, count
            package.event_chunk = data[index * step:(index + 1) * step]
            self._emit(OutgoingPackage(package, ordinal, 1 if index == count - 1 else 0, len(package.event_chunk)))
