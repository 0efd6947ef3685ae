"""ChangeEncoder.consume, the producer's hot path, on raw replication messages: what it buffers
must be exactly the events the pgoutput decoders and the generated protobuf code describe."""

from __future__ import annotations

import struct

import pytest

from producer_service.changes import ChangeEncoder
from producer_service.metrics import ProducerMetrics
from producer_service.packaging import PackageLimits, Packager
from producer_service.pgoutput import decode_message
from producer_service.pgoutput.messages import POSTGRES_EPOCH_OFFSET_US
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


def test_every_change_shape_is_buffered_as_the_decoders_describe_it():
    harness = Harness()
    payloads = [
        begin(0x5000, 901, time_us=1_234_567),
        relation(["id", "name", "note"]),
        insert([b"1", b"one", None]),
        insert([b"2", "ünï".encode(), b"x" * 20_000]),  # a tuple beyond the cached length tables
        update([b"1", b"uno", None]),
        update([b"3", b"two", None], old=[b"2", None, None], kind=b"K"),
        update([b"1", b"uno", b"n"], old=[b"1", b"uno", None], kind=b"O"),
        delete([b"1", None, None]),
        delete([b"3", b"two", None], kind=b"O"),
        truncate(RELATION_ID),
        commit(0x5000, 0x5100),
    ]
    reply = harness.consume([*payloads, keepalive(0x6000, True)])
    out = harness.flush()

    events = events_of(out)
    assert events == expected_events(payloads)
    assert events[0].commit_time_us == 1_234_567 + POSTGRES_EPOCH_OFFSET_US
    assert [e.position for e in events] == list(range(1, 9))
    assert reply and harness.encoder.server_wal_end == 0x6000
    assert out[0].package.columns[0].name == "id" and out[0].package.first_commit_lsn == 0x5000


def test_excluded_columns_leave_new_and_old_rows():
    harness = Harness(excluded={"secret"})
    payloads = [
        begin(0x10, 5),
        relation(["id", "secret", "note"]),
        insert([b"1", b"hunter2", b"a"]),
        update([b"1", b"swordfish", b"b"]),
        update([b"2", b"swordfish", b"b"], old=[b"1", b"swordfish", b"b"], kind=b"O"),
        delete([b"2", None, None]),
        commit(0x10, 0x20),
    ]
    harness.consume(payloads)
    out = harness.flush()

    events = events_of(out)
    assert events == expected_events(payloads, keep=[0, 2])
    assert [c.name for c in out[0].package.columns] == ["id", "note"]
    assert b"hunter2" not in out[0].payload and b"swordfish" not in out[0].payload


def test_positions_and_packages_of_a_large_transaction():
    harness = Harness(max_package_events=7_000)
    rows = 20_000  # positions beyond the cached position fields
    payloads = [begin(0x7000, 77), relation(["id", "v"])]
    payloads += [insert([str(i).encode(), b"v"]) for i in range(rows)]
    payloads.append(commit(0x7000, 0x7100))
    for start in range(0, len(payloads), 2000):  # as the loop reads it
        harness.consume(payloads[start:start + 2000])
    out = harness.flush()

    assert [o.event_count for o in out] == [7_000, 7_000, 6_000]
    events = events_of(out)
    assert [e.position for e in events] == list(range(1, rows + 1))
    assert events[-1] == expected_events(payloads)[-1]
    assert (out[1].package.first_position, out[1].package.last_position) == (7_001, 14_000)


def test_an_event_above_the_message_limit_is_sliced():
    harness = Harness(max_message_bytes=65_536)
    payloads = [begin(0x10, 5), relation(["id", "body"]), insert([b"1", bytes(range(256)) * 600]),
                insert([b"2", b"small"]), commit(0x10, 0x20)]
    harness.consume(payloads)
    out = harness.flush()

    assert sum(1 for o in out if o.package.HasField("chunk")) >= 3
    assert events_of(out) == expected_events(payloads)


def test_progress_follows_commits_and_heartbeats():
    harness = Harness()
    harness.consume([begin(0x10, 5), relation(["id"]), insert([b"1"]), commit(0x10, 0x20)])
    assert harness.tracker.confirmed_lsn == 0  # the event waits in a buffer
    for outgoing in harness.flush():
        harness.tracker.release(outgoing.first_ordinal)  # as the publisher's acks do
    assert harness.tracker.confirmed_lsn == 0x20
    harness.consume([logical_message(0x30)])  # a heartbeat on an idle source
    assert harness.tracker.confirmed_lsn == 0x30


def test_a_new_column_list_cuts_the_buffered_events_first():
    harness = Harness()
    harness.consume([begin(0x10, 5), relation(["id"]), insert([b"1"]), relation(["id", "added"]),
                     insert([b"2", b"x"]), commit(0x10, 0x20)])
    out = harness.flush()
    assert [len(o.package.columns) for o in out] == [1, 2]
    assert [e.position for e in events_of(out)] == [1, 2]


def test_a_change_before_its_relation_is_a_clear_error():
    harness = Harness()
    with pytest.raises(RuntimeError, match="relation 16384 arrived before its Relation message"):
        harness.consume([begin(0x10, 5), insert([b"1"])])
