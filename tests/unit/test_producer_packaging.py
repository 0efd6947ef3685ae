"""Packaging rules added with encoded events: idle flushing, the message limit as a byte cap, and
packages that stay valid protobuf with the column list and events joined as bytes."""

from producer_service.encoding import TransactionFields, encode_event
from producer_service.packaging import PackageLimits, Packager
from producer_service.relations import RelationInfo
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import decode_package, encode_package, message_id
from siphon_core.wire.tuple_data import encode_tuple


def relation(relation_id: int = 1) -> RelationInfo:
    columns = (pb.Column(name="id", type_oid=20, type_name="bigint", primary_key=True),
               pb.Column(name="body", type_oid=25, type_name="text", nullable=True))
    return RelationInfo(relation_id, "public", f"t{relation_id}", columns, None, "d")


def add(packager: Packager, rel: RelationInfo, position: int, body: bytes = b"x", ordinal: int = 0) -> None:
    fields = TransactionFields(9, 0x100, 5)
    framed = encode_event(fields, pb.INSERT, position, encode_tuple([str(position).encode(), body]))
    packager.add_encoded(packager.buffer_for(rel), framed, 0x100, position, ordinal)


def test_a_cut_package_is_the_message_protobuf_would_make():
    out = []
    packager = Packager("app", PackageLimits(3, 10**6, 3, 10**6), out.append, producer_version="9.9")
    rel = relation()
    for position in (1, 2, 3):
        add(packager, rel, position)
    package = out[0].package
    assert [c.name for c in package.columns] == ["id", "body"]
    assert [(e.commit_lsn, e.position, e.xid) for e in package.events] == [(0x100, 1, 9), (0x100, 2, 9), (0x100, 3, 9)]
    assert (package.first_position, package.last_position, package.producer_version) == (1, 3, "9.9")
    assert out[0].message_id == message_id(package) and out[0].table == "public.t1"
    assert decode_package(encode_package(package)) == package


def test_idle_flush_cuts_only_tables_with_nothing_in_flight():
    out = []
    packager = Packager("app", PackageLimits(1000, 10**6, 3, 10**6), out.append)
    busy, idle = relation(1), relation(2)
    add(packager, busy, 1)
    add(packager, idle, 2)
    packager.flush_idle(lambda relation_id: relation_id == 2)
    assert [p.relation_id for p in out] == [2]
    packager.flush_idle(lambda relation_id: True)
    assert [p.relation_id for p in out] == [2, 1]


def test_packages_stay_below_the_message_limit_whatever_max_bytes_says():
    out = []
    limits = PackageLimits(max_events=10**6, max_bytes=800_000, max_age_seconds=3, max_message_bytes=65_536)
    packager = Packager("app", limits, out.append)
    for position in range(1, 200):
        add(packager, relation(), position, body=b"y" * 1000)
    packager.flush_all()
    assert len(out) > 3 and all(len(p.package.SerializeToString()) < 65_536 for p in out)
    assert sum(p.event_count for p in out) == 199


def test_idle_flush_waits_for_the_minimum_age():
    out = []
    now = [100.0]
    limits = PackageLimits(1000, 10**6, 3, 10**6, idle_min_age_seconds=0.5)
    packager = Packager("app", limits, out.append, clock=lambda: now[0])
    table = relation(1)
    add(packager, table, 1)
    now[0] += 0.4
    packager.flush_idle(lambda relation_id: True)
    assert out == []  # too young: the next burst joins it
    add(packager, table, 2)
    now[0] += 0.2
    packager.flush_idle(lambda relation_id: True)
    assert [p.event_count for p in out] == [2]


def test_with_many_tables_waiting_each_waits_longer_so_idle_cuts_keep_to_their_budget():
    out = []
    now = [100.0]
    limits = PackageLimits(1000, 10**6, 3, 10**6, idle_min_age_seconds=0.5, idle_packages_per_second=4)
    packager = Packager("app", limits, out.append, clock=lambda: now[0])
    tables = [relation(i) for i in range(1, 11)]
    for position, table in enumerate(tables, start=1):
        add(packager, table, position)
    assert limits.idle_age(10) == 2.5  # 10 tables at 4 packages a second
    now[0] += 2.4
    packager.flush_idle(lambda relation_id: True)
    assert out == []
    now[0] += 0.2
    packager.flush_idle(lambda relation_id: True)
    assert sorted(p.relation_id for p in out) == list(range(1, 11))
    # Few tables waiting: the minimum age; very many: never past the longest wait.
    assert limits.idle_age(1) == 0.5
    assert limits.idle_age(1000) == 3
    assert PackageLimits(1000, 10**6, 3, 10**6, idle_min_age_seconds=0.5).idle_age(1000) == 0.5
