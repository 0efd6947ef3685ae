"""Field numbers and tags of proto/siphon.proto, read from the generated descriptors.

The producer writes events as bytes and the consumers' compiled loops walk packages by field
number, both without the generated classes (that is where their speed comes from); they take
every number from here, so the .proto file stays the one place a field's number is decided. The
wire types the fast paths assume are checked at import: a change to the .proto that they cannot
follow fails loudly, never silently misreads.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from siphon_core.wire import siphon_pb2 as pb

VARINT, LENGTH_DELIMITED = 0, 2
_VARINT_TYPES = {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT64,
                 FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_ENUM}
_LENGTH_TYPES = {FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_STRING}


def number(message: Descriptor, field: str, wire_type: int) -> int:
    """The field's number, after checking it is encoded with `wire_type`."""
    descriptor = message.fields_by_name[field]
    expected = _VARINT_TYPES if wire_type == VARINT else _LENGTH_TYPES
    if descriptor.type not in expected:
        raise ImportError(f"proto/siphon.proto: {message.name}.{field} is no longer encoded as wire type "
                          f"{wire_type}; the fast encoders and readers must follow the change")
    return descriptor.number


def tag(message: Descriptor, field: str, wire_type: int) -> bytes:
    """The field's key as it precedes its value on the wire (one byte for numbers below 16)."""
    key = number(message, field, wire_type) << 3 | wire_type
    if key >= 0x80:
        raise ImportError(f"proto/siphon.proto: {message.name}.{field} needs a key of more than one byte")
    return bytes([key])


_EVENT, _ROW, _PACKAGE = pb.Event.DESCRIPTOR, pb.Row.DESCRIPTOR, pb.Package.DESCRIPTOR

PACKAGE_EVENTS = number(_PACKAGE, "events", LENGTH_DELIMITED)
EVENT_OPERATION = number(_EVENT, "operation", VARINT)
EVENT_XID = number(_EVENT, "xid", VARINT)
EVENT_COMMIT_LSN = number(_EVENT, "commit_lsn", VARINT)
EVENT_POSITION = number(_EVENT, "position", VARINT)
EVENT_COMMIT_TIME = number(_EVENT, "commit_time_us", VARINT)
EVENT_NEW_ROW = number(_EVENT, "new_row", LENGTH_DELIMITED)
EVENT_OLD_ROW = number(_EVENT, "old_row", LENGTH_DELIMITED)
EVENT_OLD_IS_FULL = number(_EVENT, "old_row_is_full", VARINT)
EVENT_OLD_IS_KEY = number(_EVENT, "old_row_is_key", VARINT)
ROW_TUPLE = number(_ROW, "tuple", LENGTH_DELIMITED)

PACKAGE_EVENTS_TAG = tag(_PACKAGE, "events", LENGTH_DELIMITED)
EVENT_OPERATION_TAG = tag(_EVENT, "operation", VARINT)
EVENT_XID_TAG = tag(_EVENT, "xid", VARINT)
EVENT_COMMIT_LSN_TAG = tag(_EVENT, "commit_lsn", VARINT)
EVENT_POSITION_TAG = tag(_EVENT, "position", VARINT)
EVENT_COMMIT_TIME_TAG = tag(_EVENT, "commit_time_us", VARINT)
EVENT_NEW_ROW_TAG = tag(_EVENT, "new_row", LENGTH_DELIMITED)
EVENT_OLD_ROW_TAG = tag(_EVENT, "old_row", LENGTH_DELIMITED)
EVENT_OLD_IS_FULL_TAG = tag(_EVENT, "old_row_is_full", VARINT)
EVENT_OLD_IS_KEY_TAG = tag(_EVENT, "old_row_is_key", VARINT)
ROW_TUPLE_TAG = tag(_ROW, "tuple", LENGTH_DELIMITED)


def _contiguous(message: Descriptor) -> tuple[int, int]:
    numbers = sorted(f.number for f in message.fields)
    if numbers != list(range(numbers[0], numbers[-1] + 1)):
        raise ImportError(f"proto/siphon.proto: the compiled event walk takes {message.name}'s fields "
                          f"{numbers} to be one range; it must learn of the gap")
    return numbers[0], numbers[-1]


# Every field number an Event has: a known field met in an unexpected wire type is left to the
# generated classes, any other number is skipped as protobuf skips unknown fields.
EVENT_FIELD_RANGE = _contiguous(_EVENT)
