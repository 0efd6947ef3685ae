"""pgoutput messages built by hand, and a ChangeEncoder (the producer's hot path) without servers:
its packages land in a list, and `expected_events` says what the decoders make of the same bytes."""

from __future__ import annotations

import struct

from producer_service.changes import ChangeEncoder
from producer_service.metrics import ProducerMetrics
from producer_service.packaging import PackageLimits, Packager
from producer_service.pgoutput import decode_message
from producer_service.progress import ProgressTracker
from producer_service.relations import RelationInfo
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import ChunkReassembler
from siphon_core.wire.tuple_data import decode_tuple, encode_tuple

RELATION_ID = 16_384


def xlog(payload: bytes, lsn: int = 0x100) -> memoryview:
    return memoryview(b"w" + struct.pack(">QQq", lsn, lsn, 0) + payload)


def keepalive(wal_end: int, reply: bool) -> memoryview:
    return memoryview(b"k" + struct.pack(">QqB", wal_end, 0, reply))


def begin(final_lsn: int, xid: int, time_us: int = 1_000_000) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, time_us, xid)


def commit(final_lsn: int, end_lsn: int, time_us: int = 1_000_000) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, final_lsn, end_lsn, time_us)


def relation(columns: list[str], relation_id: int = RELATION_ID, identity: bytes = b"d") -> bytes:
    body = b"R" + struct.pack(">I", relation_id) + b"public\0items\0" + identity + struct.pack(">h", len(columns))
    for index, name in enumerate(columns):
        body += bytes([1 if index == 0 else 0]) + name.encode() + b"\0" + struct.pack(">Ii", 25, -1)
    return body


def insert(values: list, relation_id: int = RELATION_ID) -> bytes:
    return b"I" + struct.pack(">I", relation_id) + b"N" + encode_tuple(values)


def update(new: list, old: list | None = None, kind: bytes = b"K") -> bytes:
    old_part = kind + encode_tuple(old) if old is not None else b""
    return b"U" + struct.pack(">I", RELATION_ID) + old_part + b"N" + encode_tuple(new)


def delete(old: list, kind: bytes = b"K") -> bytes:
    return b"D" + struct.pack(">I", RELATION_ID) + kind + encode_tuple(old)


def truncate(*relation_ids: int) -> bytes:
    return b"T" + struct.pack(">IB", len(relation_ids), 0) + struct.pack(f">{len(relation_ids)}I", *relation_ids)


def logical_message(lsn: int) -> bytes:
    return b"M" + struct.pack(">BQ", 0, lsn) + b"siphon.heartbeat\0" + struct.pack(">I", 1) + b"x"


class FakeCatalog:
    """RelationCatalog without a database: every column text, the first one the key."""

    def __init__(self, excluded: set[str] = frozenset()) -> None:
        self.excluded = excluded

    def update(self, message) -> RelationInfo:
        keep = [i for i, column in enumerate(message.columns) if column.name not in self.excluded]
        columns = tuple(pb.Column(name=message.columns[i].name, type_oid=25, type_name="text",
                                  primary_key=i == 0, type_modifier=-1, nullable=i != 0) for i in keep)
        return RelationInfo(message.relation_id, message.namespace, message.name, columns,
                            None if len(keep) == len(message.columns) else tuple(keep), message.replica_identity)


class Harness:
    """A ChangeEncoder with its packager and tracker; packages land in `out` instead of a queue."""

    def __init__(self, excluded: set[str] = frozenset(), max_package_events: int = 100_000,
                 max_message_bytes: int = 1_048_576) -> None:
        self.out: list = []
        self.tracker = ProgressTracker()
        self.packager = Packager("unit", PackageLimits(max_package_events, 800_000, 3.0, max_message_bytes),
                                 self.out.append, hold=self.tracker.hold)
        catalog = FakeCatalog(set(excluded))
        self.encoder = ChangeEncoder(self.packager, self.tracker, ProducerMetrics(), catalog.update,
                                     lambda relation: f"siphon.unit.{relation.schema}.{relation.table}")

    def consume(self, payloads: list[bytes | memoryview]) -> bool:
        return self.encoder.consume([p if isinstance(p, memoryview) else xlog(p) for p in payloads])

    def flush(self) -> list:
        self.packager.flush_all()
        return self.out


def events_of(out: list) -> list[pb.Event]:
    joiner = ChunkReassembler()
    events = []
    for outgoing in out:
        whole = joiner.accept(outgoing.package)
        if whole is not None:
            events.extend(whole.events)
    return events


def expected_events(payloads: list[bytes], keep: list[int] | None = None) -> list[pb.Event]:
    """What the decoders say, as generated-code events, positions counted per transaction."""
    events, position, txn = [], 0, None

    def project(data):
        if data is None or keep is None:
            return data
        values = decode_tuple(data)[0]
        return encode_tuple([values[i] for i in keep])

    for payload in payloads:
        message = decode_message(payload)
        name = type(message).__name__
        if name == "Begin":
            txn, position = message, 0
        elif name in ("Insert", "Update", "Delete", "Truncate"):
            operations = {"Insert": pb.INSERT, "Update": pb.UPDATE, "Delete": pb.DELETE, "Truncate": pb.TRUNCATE}
            count = len(message.relation_ids) if name == "Truncate" else 1
            for event_position in range(position + 1, position + count + 1):
                event = pb.Event(operation=operations[name], xid=txn.xid, commit_lsn=txn.final_lsn,
                                 position=event_position, commit_time_us=txn.commit_time)
                new = project(getattr(message, "new_tuple", None))
                old = project(getattr(message, "old_tuple", None))
                if new is not None:
                    event.new_row.tuple = new
                if old is not None:
                    event.old_row.tuple = old
                    event.old_row_is_full = message.old_kind == "O"
                    event.old_row_is_key = message.old_kind == "K"
                events.append(event)
            position += count
    return events
