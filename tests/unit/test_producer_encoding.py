"""The producer's hand-written protobuf encoding of events against the generated code."""

import pytest

from producer_service.encoding import (
    CACHED,
    TransactionFields,
    encode_event,
    frame,
    unframe,
    varint,
)
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.tuple_data import encode_tuple


def reference(operation, xid, lsn, time_us, position, new=None, old=None, old_kind=None) -> pb.Event:
    event = pb.Event(operation=operation, xid=xid, commit_lsn=lsn, position=position, commit_time_us=time_us)
    if new is not None:
        event.new_row.tuple = new
    if old is not None:
        event.old_row.tuple = old
        event.old_row_is_full = old_kind == "O"
        event.old_row_is_key = old_kind == "K"
    return event


ROW = encode_tuple([b"1", None, b"x" * 300])
BIG_ROW = encode_tuple([b"y" * 70_000])

CASES = {
    "insert": (pb.INSERT, 7, 0x16B3F2A8, 1_795_344_973_779_264, 1, ROW, None, None),
    "update without old row": (pb.UPDATE, 7, 0x16B3F2A8, 1_795_344_973_779_264, 2, ROW, None, None),
    "update with old key": (pb.UPDATE, 2**32 - 1, 2**64 - 1, 1, 127, ROW, encode_tuple([b"1", None, None]), "K"),
    "update with old row": (pb.UPDATE, 1, 1, 1, 128, ROW, ROW, "O"),
    "delete": (pb.DELETE, 3, 5, 9, 16_383, None, encode_tuple([b"1"]), "K"),
    "delete full": (pb.DELETE, 3, 5, 9, CACHED, None, ROW, "O"),
    "truncate": (pb.TRUNCATE, 3, 5, 9, 2**32 - 1, None, None, None),
    "zeros are left out": (pb.INSERT, 0, 0, 0, 1, ROW, None, None),
    "time before 1970": (pb.INSERT, 1, 2, -1_000_000, 3, ROW, None, None),
    "a row beyond the length tables": (pb.INSERT, 1, 2, 3, 4, BIG_ROW, None, None),
    "an empty tuple": (pb.INSERT, 1, 2, 3, 4, encode_tuple([]), None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_encoded_event_is_what_protobuf_writes(case):
    operation, xid, lsn, time_us, position, new, old, old_kind = CASES[case]
    fields = TransactionFields(xid, lsn, time_us)
    framed = encode_event(fields, operation, position, new, old, old_kind)
    expected = reference(operation, xid, lsn, time_us, position, new, old, old_kind).SerializeToString()
    assert unframe(framed) == expected
    assert framed == frame(len(expected)) + expected
    package = pb.Package()
    package.ParseFromString(framed)  # a framed event is one entry of Package.events
    assert package.events[0] == reference(operation, xid, lsn, time_us, position, new, old, old_kind)


def test_insert_fields_match_the_inline_encoding_of_the_service():
    fields = TransactionFields(42, 0x1_0000_0000, 1_700_000_000_000_000)
    fixed, time_field, insert_prefix, update_prefix = fields.unpacked()
    assert insert_prefix == fields.prefix(pb.INSERT) and update_prefix == fields.prefix(pb.UPDATE)
    assert fixed == len(insert_prefix) + len(time_field) == len(update_prefix) + len(time_field)


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16_383, 16_384, 2**32, 2**63 - 1, -1, -(2**63)])
def test_varint_matches_protobuf(value):
    message = pb.Event(commit_time_us=value) if value < 0 or value >= 2**32 else pb.Event(position=value or 1)
    serialized = message.SerializeToString()
    assert serialized[1:] == varint(value if value < 0 or value >= 2**32 else value or 1)
