"""ProducerService._consume, the hot path, on raw replication messages: what it buffers must be
exactly the events the pgoutput decoders and the generated protobuf code describe."""

from __future__ import annotations

import struct

import pytest

from producer_service.pgoutput import decode_message
from producer_service.pgoutput.messages import POSTGRES_EPOCH_OFFSET_US
from producer_service.relations import RelationInfo
from producer_service.service import ProducerService
from siphon_core.config import parse_config
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


def make_service(excluded: set[str] = frozenset(), **producer) -> tuple[ProducerService, list]:
    config = parse_config({"application_identifier": "unit", "source": {"dsn": "postgresql://u@127.0.0.1:1/db"},
                           "queue": {"max_message_bytes": producer.pop("max_message_bytes", 1_048_576)},
                           "producer": {"max_package_events": 100_000, **producer},
                           "tables": [{"name": "public.items", "exclude_columns": sorted(excluded)}]})
    service = ProducerService(config)
    service._catalog = FakeCatalog(set(excluded))
    out: list = []
    service._packager._emit = out.append  # instead of the publisher
    return service, out


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
            for _ in message.relation_ids if name == "Truncate" else [None]:
                position += 1
                event = pb.Event(operation=operations[name], xid=txn.xid, commit_lsn=txn.final_lsn,
                                 position=position, commit_time_us=txn.commit_time)
                new = project(getattr(message, "new_tuple", None))
                old = project(getattr(message, "old_tuple", None))
                if new is not None:
                    event.new_row.tuple = new
                if old is not None:
                    event.old_row.tuple = old
                    event.old_row_is_full = message.old_kind == "O"
                    event.old_row_is_key = message.old_kind == "K"
                events.append(event)
    return events


def test_every_change_shape_is_buffered_as_the_decoders_describe_it():
    service, out = make_service()
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
    reply = service._consume([xlog(p) for p in payloads] + [keepalive(0x6000, True)])
    service._packager.flush_all()

    events = events_of(out)
    assert events == expected_events(payloads)
    assert events[0].commit_time_us == 1_234_567 + POSTGRES_EPOCH_OFFSET_US
    assert [e.position for e in events] == list(range(1, 9))
    assert reply and service._server_wal_end == 0x6000
    assert out[0].package.columns[0].name == "id" and out[0].package.first_commit_lsn == 0x5000


def test_excluded_columns_leave_new_and_old_rows():
    service, out = make_service(excluded={"secret"})
    payloads = [
        begin(0x10, 5),
        relation(["id", "secret", "note"]),
        insert([b"1", b"hunter2", b"a"]),
        update([b"1", b"swordfish", b"b"]),
        update([b"2", b"swordfish", b"b"], old=[b"1", b"swordfish", b"b"], kind=b"O"),
        delete([b"2", None, None]),
        commit(0x10, 0x20),
    ]
    service._consume([xlog(p) for p in payloads])
    service._packager.flush_all()

    events = events_of(out)
    assert events == expected_events(payloads, keep=[0, 2])
    assert [c.name for c in out[0].package.columns] == ["id", "note"]
    assert b"hunter2" not in out[0].payload and b"swordfish" not in out[0].payload


def test_positions_and_packages_of_a_large_transaction():
    service, out = make_service(max_package_events=7_000)
    rows = 20_000  # positions beyond the cached position fields
    payloads = [begin(0x7000, 77), relation(["id", "v"])]
    payloads += [insert([str(i).encode(), b"v"]) for i in range(rows)]
    payloads.append(commit(0x7000, 0x7100))
    batch = [xlog(p) for p in payloads]
    for start in range(0, len(batch), 2000):  # as the loop reads it
        service._consume(batch[start:start + 2000])
    service._packager.flush_all()

    assert [o.event_count for o in out] == [7_000, 7_000, 6_000]
    events = events_of(out)
    assert [e.position for e in events] == list(range(1, rows + 1))
    assert events[-1] == expected_events(payloads)[-1]
    assert (out[1].package.first_position, out[1].package.last_position) == (7_001, 14_000)


def test_an_event_above_the_message_limit_is_sliced():
    service, out = make_service(max_message_bytes=65_536)
    payloads = [begin(0x10, 5), relation(["id", "body"]), insert([b"1", bytes(range(256)) * 600]),
                insert([b"2", b"small"]), commit(0x10, 0x20)]
    service._consume([xlog(p) for p in payloads])
    service._packager.flush_all()

    assert sum(1 for o in out if o.package.HasField("chunk")) >= 3
    assert events_of(out) == expected_events(payloads)


def test_progress_follows_commits_and_heartbeats():
    service, out = make_service()
    service._consume([xlog(begin(0x10, 5)), xlog(relation(["id"])), xlog(insert([b"1"])), xlog(commit(0x10, 0x20))])
    assert service._tracker.confirmed_lsn == 0  # the event waits in a buffer
    service._packager.flush_all()
    for outgoing in out:
        service._tracker.release(outgoing.first_ordinal)  # as the publisher's acks do
    assert service._tracker.confirmed_lsn == 0x20
    service._consume([xlog(logical_message(0x30))])  # a heartbeat on an idle source
    assert service._tracker.confirmed_lsn == 0x30


def test_a_new_column_list_cuts_the_buffered_events_first():
    service, out = make_service()
    service._consume([xlog(begin(0x10, 5)), xlog(relation(["id"])), xlog(insert([b"1"])),
                      xlog(relation(["id", "added"])), xlog(insert([b"2", b"x"])), xlog(commit(0x10, 0x20))])
    service._packager.flush_all()
    assert [len(o.package.columns) for o in out] == [1, 2]
    assert [e.position for e in events_of(out)] == [1, 2]


def test_a_change_before_its_relation_is_a_clear_error():
    service, _ = make_service()
    with pytest.raises(RuntimeError, match="relation 16384 arrived before its Relation message"):
        service._consume([xlog(begin(0x10, 5)), xlog(insert([b"1"]))])
