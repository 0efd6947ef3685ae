"""ChangeEncoder.consume, the producer's hot path, on raw replication messages: what it buffers
must be exactly the events the pgoutput decoders and the generated protobuf code describe."""

from __future__ import annotations

import pytest

from producer_service.pgoutput.messages import POSTGRES_EPOCH_OFFSET_US
from tests.helpers.change_encoder import (
    RELATION_ID,
    Harness,
    begin,
    commit,
    delete,
    events_of,
    expected_events,
    insert,
    keepalive,
    logical_message,
    relation,
    truncate,
    update,
)


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
