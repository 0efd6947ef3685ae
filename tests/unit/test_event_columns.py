"""The compiled event reader against the generated protobuf classes, on random packages and on
byte layouts the producer never writes but protobuf allows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.event_columns import (
    UNKNOWN_OPERATION,
    PackageSummary,
    gather_spans,
    gather_spans_into,
    read_events,
    read_package,
    summarize_package,
)
from siphon_core.wire.packages import PackageError


def _random_event(rng: random.Random) -> pb.Event:
    event = pb.Event(operation=rng.choice([1, 2, 3, 4, 5, 77]), xid=rng.randrange(2**32),
                     commit_lsn=rng.choice([0, 1, rng.randrange(2**64)]), position=rng.randrange(2**32),
                     commit_time_us=rng.choice([0, -1, rng.randrange(-2**63, 2**63)]))
    if rng.random() < 0.8:
        event.new_row.tuple = rng.randbytes(rng.choice([0, 1, 200, 3000]))
    if rng.random() < 0.3:
        event.old_row.tuple = rng.randbytes(rng.randrange(0, 50))
        event.old_row_is_full = rng.random() < 0.5
        event.old_row_is_key = not event.old_row_is_full
    if rng.random() < 0.05:
        event.old_row.SetInParent()  # an empty old row is still an old row
    return event


def _expected(package: pb.Package, serialized: bytes) -> list[tuple]:
    def span(row: pb.Row) -> bytes:
        return row.tuple

    return [(e.operation, e.commit_lsn, e.position, e.commit_time_us, e.HasField("new_row"), span(e.new_row),
             e.HasField("old_row"), span(e.old_row), e.old_row_is_full, e.old_row_is_key) for e in package.events]


def _read(serialized: bytes) -> list[tuple]:
    columns = read_events(serialized)
    assert columns is not None
    data = columns.data
    return [(int(columns.operations[i]), int(columns.commit_lsns[i]), int(columns.positions[i]),
             int(columns.commit_times_us[i]), bool(columns.has_new_row[i]),
             bytes(data[columns.new_starts[i]:columns.new_starts[i] + columns.new_lengths[i]]),
             bool(columns.has_old_row[i]),
             bytes(data[columns.old_starts[i]:columns.old_starts[i] + columns.old_lengths[i]]),
             bool(columns.old_is_full[i]), bool(columns.old_is_key[i])) for i in range(len(columns))]


@pytest.mark.parametrize("seed", range(5))
def test_random_packages_read_as_the_generated_classes_read_them(seed):
    rng = random.Random(seed)
    package = pb.Package(schema="public", table="notes", first_commit_lsn=rng.randrange(2**64), sequence=seed)
    package.columns.append(pb.Column(name="id", type_oid=20, primary_key=True))
    package.events.extend(_random_event(rng) for _ in range(rng.randrange(0, 300)))
    serialized = package.SerializeToString()

    assert _read(serialized) == _expected(package, serialized)


def test_fields_in_any_order_unknown_fields_and_a_row_sent_twice():
    first = pb.Event(operation=pb.UPDATE, commit_lsn=5, position=2)
    first.new_row.tuple = b"first"
    first.old_row.tuple = b"key"
    second = pb.Event(operation=pb.INSERT, commit_lsn=6, position=1)
    second.new_row.tuple = b"second"
    # Unknown field 99 (varint) inside an event, a second new_row without a tuple (merges: keeps
    # "first"), events between envelope fields, and an unknown length-delimited package field.
    unknown_varint = bytes([99 << 3 & 0x7F | 0x80, 99 >> 4, 7])
    empty_row = bytes([6 << 3 | 2, 0])
    first_bytes = first.SerializeToString() + unknown_varint + empty_row
    serialized = (pb.Package(schema="public").SerializeToString()
                  + bytes([6 << 3 | 2, len(first_bytes)]) + first_bytes
                  + pb.Package(table="notes").SerializeToString()
                  + bytes([200 << 3 & 0x7F | 0x82, 200 >> 4, 3]) + b"abc"
                  + pb.Package(events=[second]).SerializeToString())
    package = pb.Package.FromString(serialized)

    assert _read(serialized) == _expected(package, serialized)
    assert [row[5] for row in _read(serialized)] == [b"first", b"second"]


@pytest.mark.parametrize("serialized", [
    bytes([6 << 3 | 2, 5, 8]),  # an event longer than the package
    bytes([6 << 3 | 2, 2, 8 << 3 | 2, 0]),  # old_row_is_full sent length-delimited
    bytes([6 << 3 | 2, 1, 0x80]),  # a varint cut short
    bytes([3 << 3 | 3]),  # a group
])
def test_what_the_loop_does_not_read_is_left_to_the_generated_classes(serialized):
    assert read_events(serialized) is None


def test_spans_are_gathered_into_binary_column_parts():
    data = np.frombuffer(b"0123456789", np.uint8)
    offsets, out = gather_spans(data, np.array([2, 0, 9]), np.array([3, 0, 1]))
    assert offsets.tolist() == [0, 3, 3, 4] and bytes(out) == b"2349"


def test_spans_of_several_sources_are_gathered_into_one_column():
    first, second = np.frombuffer(b"0123456789", np.uint8), np.frombuffer(b"abcdef", np.uint8)
    out, offsets = np.zeros(7, np.uint8), np.zeros(6, np.int64)
    gather_spans_into(first, np.array([2, 0, 9]), np.array([3, 0, 1]), out, offsets, 0)
    gather_spans_into(second, np.array([4, 0]), np.array([2, 1]), out, offsets, 3)
    assert offsets.tolist() == [0, 3, 3, 4, 6, 7] and bytes(out) == b"2349efa"


def test_a_package_reads_as_its_envelope_and_its_events():
    package = pb.Package(schema="public", table="notes", first_commit_lsn=7, chunk=pb.Chunk(index=0, count=1))
    package.columns.append(pb.Column(name="id", type_oid=20, primary_key=True))
    package.events.extend(_random_event(random.Random(9)) for _ in range(20))
    serialized = package.SerializeToString()

    envelope, events = read_package(serialized)

    assert events is not None and len(events) == 20
    assert [events.event(i) for i in range(20)] == list(package.events)
    package.ClearField("events")
    assert envelope == package


def test_a_package_the_loop_cannot_read_is_parsed_whole():
    serialized = pb.Package(schema="public").SerializeToString() + bytes([3 << 3 | 3])  # a group
    with pytest.raises(PackageError, match="not a Siphon package"):
        read_package(serialized, "stream sequence 3")


def test_a_package_only_the_generated_classes_read_still_reads_as_columns():
    event = pb.Event(operation=pb.INSERT, commit_lsn=5, position=1)
    event.new_row.tuple = b"row"
    event_bytes = event.SerializeToString() + bytes([15 << 3 | 3, 15 << 3 | 4])  # an empty unknown group
    serialized = pb.Package(schema="public").SerializeToString() + bytes([6 << 3 | 2, len(event_bytes)]) + event_bytes
    assert read_events(serialized) is None

    package, events = read_package(serialized)

    assert package.schema == "public" and len(events) == 1
    assert events.event(0) == event


def _summary_of(package: pb.Package) -> PackageSummary:
    """What the summary must say, from the generated classes."""
    events = list(package.events)
    counts: dict[int, int] = {}
    for event in events:
        value = event.operation if 0 <= event.operation < 15 else UNKNOWN_OPERATION
        counts[value] = counts.get(value, 0) + 1
    truncates = [e for e in events if e.operation == pb.TRUNCATE]
    return PackageSummary(
        event_count=len(events), operation_counts=counts,
        first_commit_lsn=events[0].commit_lsn if events else 0, last_commit_lsn=events[-1].commit_lsn if events else 0,
        first_commit_time_us=events[0].commit_time_us if events else 0,
        last_commit_time_us=events[-1].commit_time_us if events else 0,
        last_truncate=(truncates[-1].commit_lsn, truncates[-1].position) if truncates else None)


@pytest.mark.parametrize("seed", range(5))
def test_a_summary_says_what_the_generated_classes_read(seed):
    rng = random.Random(100 + seed)
    package = pb.Package(schema="public", table="notes", last_commit_lsn=rng.randrange(2**64), sequence=seed)
    package.columns.append(pb.Column(name="id", type_oid=20, primary_key=True))
    package.events.extend(_random_event(rng) for _ in range(rng.randrange(0, 300)))
    serialized = package.SerializeToString()

    envelope, summary = summarize_package(serialized)

    assert summary == _summary_of(package)
    package.ClearField("events")
    assert envelope == package


def test_a_summary_of_a_package_the_walk_cannot_read_comes_from_the_generated_classes():
    event = pb.Event(operation=pb.TRUNCATE, commit_lsn=9, position=4)
    # old_row_is_full sent length-delimited inside an event: protobuf reads it (as an unknown
    # field), the walk leaves it to the generated classes.
    odd = event.SerializeToString() + bytes([8 << 3 | 2, 0])
    serialized = pb.Package(table="notes").SerializeToString() + bytes([6 << 3 | 2, len(odd)]) + odd
    assert read_events(serialized) is None

    envelope, summary = summarize_package(serialized)

    assert envelope.table == "notes" and not envelope.events
    assert summary == _summary_of(pb.Package.FromString(serialized))
    assert summary.last_truncate == (9, 4)
    with pytest.raises(PackageError, match="stream sequence 8: not a Siphon package"):
        summarize_package(bytes([3 << 3 | 3]), "stream sequence 8")
