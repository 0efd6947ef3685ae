"""The two readers of pgoutput's layout give the same answers: messages captured from a real
PostgreSQL go through the decoders and through ChangeEncoder.consume, the producer's hot path,
which reads the same bytes in place. Streamed blocks are the decoders' alone: the producer does not
ask for them."""

from __future__ import annotations

import struct

import pytest

from producer_service.pgoutput import decode_message
from producer_service.pgoutput.layout import PgoutputError
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.tuple_data import UNCHANGED_TOAST, decode_tuple
from tests.helpers.change_encoder import (
    RELATION_ID,
    Harness,
    begin,
    events_of,
    expected_events,
    relation,
    xlog,
)
from tests.unit.pgoutput.conftest import CAPTURES_PATH, Captures

TRANSACTION_SCENARIOS = [s for s in Captures(CAPTURES_PATH).scenarios() if not s.startswith("stream_")]


def _with_relations(captures, scenario: str) -> list:
    """The scenario's messages, after the Relation messages of earlier scenarios that its changes
    name without describing them (the walsender sends a Relation once per session)."""
    described = {}
    for other in TRANSACTION_SCENARIOS:
        for message in captures.all(other):
            if message.payload[:1] == b"R":
                described.setdefault(decode_message(message.payload).relation_id, message)
    messages = captures.all(scenario)
    own = {decode_message(m.payload).relation_id for m in messages if m.payload[:1] == b"R"}
    named = set()
    for message in messages:
        decoded = decode_message(message.payload)
        named.update(getattr(decoded, "relation_ids", ()))
        if hasattr(decoded, "relation_id") and message.payload[:1] != b"R":
            named.add(decoded.relation_id)
    return [described[oid] for oid in sorted(named - own)] + messages


def _run_both(captures, scenario: str, excluded: set[str] = frozenset()):
    messages = _with_relations(captures, scenario)
    harness = Harness(excluded=excluded)
    harness.consume([xlog(m.payload, m.data_start) for m in messages])
    out = harness.flush()
    for outgoing in out:
        harness.tracker.release(outgoing.first_ordinal)
    return harness, out, [m.payload for m in messages]


def _confirmable(payloads: list[bytes]) -> int:
    """What the slot may confirm once every package is acked, by the decoders: the last commit's
    end, or a later heartbeat's position outside any transaction."""
    position, in_transaction = 0, False
    for payload in payloads:
        message = decode_message(payload)
        kind = type(message).__name__
        if kind == "Begin":
            in_transaction = True
        elif kind == "Commit":
            position, in_transaction = message.end_lsn, False
        elif kind == "LogicalMessage" and not message.transactional and not in_transaction:
            position = message.lsn
    return position


@pytest.mark.parametrize("scenario", TRANSACTION_SCENARIOS)
def test_the_hot_path_buffers_what_the_decoders_read(captures, scenario):
    harness, out, payloads = _run_both(captures, scenario)

    events = sorted(events_of(out), key=lambda e: e.position)  # packages come per table
    assert events == expected_events(payloads)
    changes = sum(type(decode_message(p)).__name__ in ("Insert", "Update", "Delete") for p in payloads)
    truncated = sum(len(decode_message(p).relation_ids) for p in payloads if p[:1] == b"T")
    assert len(events) == changes + truncated
    assert harness.tracker.confirmed_lsn == _confirmable(payloads)
    assert harness.encoder.last_received == max(m.data_start for m in _with_relations(captures, scenario))


def test_an_update_of_the_key_keeps_the_old_key_on_both_paths(captures):
    _, out, _ = _run_both(captures, "update_primary_key")

    (event,) = events_of(out)
    assert event.operation == pb.UPDATE and event.old_row_is_key and not event.old_row_is_full
    assert decode_tuple(event.old_row.tuple)[0] == [b"11", None, None, None, None]
    assert decode_tuple(event.new_row.tuple)[0] == [b"111", b"eleven", b"11.00", None, None]


def test_replica_identity_full_keeps_the_old_rows_on_both_paths(captures):
    _, out, _ = _run_both(captures, "replica_identity_full")

    update, delete = events_of(out)
    assert update.old_row_is_full and decode_tuple(update.old_row.tuple)[0] == [b"1", b"before"]
    assert delete.operation == pb.DELETE and delete.old_row_is_full and not delete.HasField("new_row")
    assert decode_tuple(delete.old_row.tuple)[0] == [b"2", b"doomed"]


def test_an_unchanged_toasted_value_stays_unchanged_on_both_paths(captures):
    _, out, _ = _run_both(captures, "toast_unchanged")

    (event,) = events_of(out)
    assert decode_tuple(event.new_row.tuple)[0] == [b"1", b"renamed", UNCHANGED_TOAST]


def test_binary_values_and_nulls_pass_through_on_both_paths(captures):
    _, out, _ = _run_both(captures, "insert_binary")

    (event,) = events_of(out)
    values = decode_tuple(event.new_row.tuple)[0]
    assert event.new_row.tuple[2:3] == b"b" and values[0] == (5).to_bytes(4, "big") and values[4] is None


def test_a_truncate_of_several_relations_is_an_event_per_relation_on_both_paths(captures):
    _, out, _ = _run_both(captures, "truncate_cascade")

    events = events_of(out)
    assert [(e.operation, e.position) for e in events] == [(pb.TRUNCATE, 1), (pb.TRUNCATE, 2)]
    assert [o.package.table for o in out] == ["parents", "children"]


def test_excluded_columns_leave_both_rows_alike_on_both_paths(captures):
    _, out, payloads = _run_both(captures, "update_primary_key", excluded={"name", "price"})

    assert events_of(out) == expected_events(payloads, keep=[0, 3, 4])
    assert [c.name for c in out[0].package.columns] == ["id", "tags", "note"]


@pytest.mark.parametrize("change", [
    b"I" + struct.pack(">I", RELATION_ID) + b"X\x00\x00",
    b"U" + struct.pack(">I", RELATION_ID) + b"Z",
    b"U" + struct.pack(">I", RELATION_ID) + b"K\x00\x01n" + b"X",
    b"D" + struct.pack(">I", RELATION_ID) + b"N\x00\x00",
], ids=["insert", "update", "update_after_old_key", "delete"])
def test_a_misplaced_marker_is_the_same_error_on_both_paths(change):
    with pytest.raises(PgoutputError) as decoded:
        decode_message(change)
    harness = Harness()

    with pytest.raises(PgoutputError) as fast:
        harness.consume([begin(0x10, 5), relation(["id"]), change])
    assert str(fast.value) == str(decoded.value)
    assert "offset" in str(fast.value)
