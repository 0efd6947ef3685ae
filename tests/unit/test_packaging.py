from producer_service.packaging import PackageLimits, Packager
from producer_service.relations import RelationInfo
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import ChunkReassembler, decode_package, encode_package, message_id


def relation(relation_id=1, table="notes"):
    columns = (pb.Column(name="id", type_oid=20, type_name="bigint", primary_key=True),
               pb.Column(name="note", type_oid=25, type_name="text", nullable=True))
    return RelationInfo(relation_id, "public", table, columns, None, "d")


def event(lsn, position, payload=b"x" * 10):
    e = pb.Event(operation=pb.INSERT, xid=7, commit_lsn=lsn, position=position)
    e.new_row.tuple = payload
    return e


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(limits, clock=None):
    out, holds = [], []
    packager = Packager("app", limits, out.append, hold=holds.append, clock=clock or Clock())
    return packager, out, holds


def test_cut_by_count_keeps_order_and_identity():
    packager, out, holds = make(PackageLimits(max_events=3, max_bytes=10**6, max_age_seconds=3, max_message_bytes=10**6))
    rel = relation()
    for position in range(1, 8):
        packager.add(rel, event(100, position), 10, ordinal=0)
    assert [p.event_count for p in out] == [3, 3]
    assert packager.buffered_events == 1
    first = out[0].package
    assert (first.first_commit_lsn, first.first_position, first.last_position) == (100, 1, 3)
    assert [c.name for c in first.columns] == ["id", "note"]
    assert message_id(out[0].package) != message_id(out[1].package)
    assert holds == [0, 0, 0]  # every buffer opening holds its first transaction


def test_cut_by_bytes_and_by_age():
    clock = Clock()
    packager, out, _ = make(PackageLimits(max_events=1000, max_bytes=200, max_age_seconds=3, max_message_bytes=10**6),
                            clock)
    rel = relation()
    packager.add(rel, event(1, 1), 100, ordinal=0)
    packager.add(rel, event(1, 2), 100, ordinal=0)  # would exceed 200 bytes with overhead: first one leaves
    assert len(out) == 1
    clock.now = 2.9
    packager.flush_due()
    assert len(out) == 1
    clock.now = 3.1
    packager.flush_due()
    assert len(out) == 2 and out[1].package.first_position == 2


def test_a_column_change_cuts_the_old_buffer_first():
    packager, out, _ = make(PackageLimits(1000, 10**6, 3, 10**6))
    packager.add(relation(), event(1, 1), 10, ordinal=0)
    changed = relation()  # a new Relation message makes a new RelationInfo object
    packager.add(changed, event(2, 1), 10, ordinal=1)
    assert len(out) == 1 and out[0].package.last_commit_lsn == 1


def test_an_event_larger_than_a_message_is_sliced_and_reassembled():
    packager, out, holds = make(PackageLimits(1000, 10**6, 3, max_message_bytes=70_000))
    rel = relation()
    big = event(5, 1, payload=bytes(range(256)) * 1000)  # 256 kB
    packager.add(rel, big, len(big.new_row.tuple), ordinal=4)
    assert len(out) > 3
    assert all(p.package.HasField("chunk") and not p.package.events for p in out)
    assert sum(p.event_count for p in out) == 1
    assert holds == [4] * len(out)
    joiner = ChunkReassembler()
    results = [joiner.accept(decode_package(encode_package(p.package))) for p in out]
    assert results[:-1] == [None] * (len(out) - 1)
    assert results[-1].events[0] == big


def test_packages_survive_the_wire():
    packager, out, _ = make(PackageLimits(2, 10**6, 3, 10**6))
    rel = relation()
    packager.add(rel, event(9, 1), 10, ordinal=0)
    packager.add(rel, event(9, 2), 10, ordinal=0)
    decoded = decode_package(encode_package(out[0].package))
    assert decoded == out[0].package
