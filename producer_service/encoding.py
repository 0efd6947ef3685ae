"""The protobuf wire encoding of `Event`s, written by hand for the producer's hot path.

Building a `pb.Event` per change, copying it into a `pb.Package` and serializing that costs about
2 µs per event; the bytes of an event are simple enough to write directly for a tenth of that.
The result is ordinary protobuf (proto/siphon.proto is unchanged): an encoded event is the bytes
of `Package.events` entry, that is the field tag, the length, and the Event message, whose fields
come in field-number order as protobuf itself writes them. `tests/unit/test_producer_encoding.py`
checks every shape against the generated code.

Event fields: 1 operation, 2 xid, 3 commit_lsn, 4 position, 5 commit_time_us (varints; proto3
leaves out zeros), 6 new_row and 7 old_row (a `Row` whose field 1 holds the TupleData bytes),
8 old_row_is_full, 9 old_row_is_key (bools, left out when false).
"""

from __future__ import annotations

from siphon_core.wire import fields
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.tuple_data import Buffer

# Tags come from the generated descriptors (siphon_core.wire.fields); a bool field set to true is
# its tag and the byte 1.
_OPERATION, _XID, _COMMIT_LSN = fields.EVENT_OPERATION_TAG, fields.EVENT_XID_TAG, fields.EVENT_COMMIT_LSN_TAG
_POSITION, _COMMIT_TIME = fields.EVENT_POSITION_TAG, fields.EVENT_COMMIT_TIME_TAG
_NEW_ROW, _OLD_ROW = fields.EVENT_NEW_ROW_TAG, fields.EVENT_OLD_ROW_TAG
_OLD_FULL, _OLD_KEY = fields.EVENT_OLD_IS_FULL_TAG + b"\x01", fields.EVENT_OLD_IS_KEY_TAG + b"\x01"
_ROW_TUPLE = fields.ROW_TUPLE_TAG
PACKAGE_EVENT_TAG = fields.PACKAGE_EVENTS_TAG

_UINT64 = (1 << 64) - 1


def varint(value: int) -> bytes:
    """Base-128 varint; negative int64 values as their 64-bit two's complement, as protobuf does."""
    value &= _UINT64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Lengths and positions below this get their encodings from tables instead of `varint` calls.
CACHED = 1 << 14
_VARINTS = [varint(n) for n in range(CACHED)]
POSITION_FIELDS = [_POSITION + v for v in _VARINTS]
POSITION_FIELD_LENGTHS = [len(f) for f in POSITION_FIELDS]
FRAMES = [PACKAGE_EVENT_TAG + v for v in _VARINTS]


def _row_header(tag: bytes, length: int) -> bytes:
    inner = _ROW_TUPLE + varint(length)
    return tag + varint(len(inner) + length) + inner


NEW_ROW_HEADERS = [_row_header(_NEW_ROW, n) for n in range(CACHED)]
NEW_ROW_HEADER_LENGTHS = [len(h) for h in NEW_ROW_HEADERS]
OLD_ROW_HEADERS = [_row_header(_OLD_ROW, n) for n in range(CACHED)]


def position_field(position: int) -> bytes:
    return POSITION_FIELDS[position] if position < CACHED else _POSITION + varint(position)


def frame(length: int) -> bytes:
    """The tag and length that make an Event of `length` bytes one entry of `Package.events`."""
    return FRAMES[length] if length < CACHED else PACKAGE_EVENT_TAG + varint(length)


def new_row_header(length: int) -> bytes:
    return NEW_ROW_HEADERS[length] if length < CACHED else _row_header(_NEW_ROW, length)


def old_row_header(length: int) -> bytes:
    return OLD_ROW_HEADERS[length] if length < CACHED else _row_header(_OLD_ROW, length)


_OPERATION_FIELDS = {op: _OPERATION + varint(op) for op in (pb.INSERT, pb.UPDATE, pb.DELETE, pb.TRUNCATE)}


class TransactionFields:
    """What every event of one transaction shares, encoded once at Begin.

    An event is `prefix(op) + position_field(p) + time + rows`, where the prefix holds operation,
    xid and commit_lsn and `time` holds commit_time_us. Made once per transaction, so kept cheap.
    """

    __slots__ = ("shared", "time", "insert_prefix", "update_prefix", "insert_fixed")

    def __init__(self, xid: int, commit_lsn: int, commit_time_us: int) -> None:
        shared = (_XID + varint(xid) if xid else b"") + (_COMMIT_LSN + varint(commit_lsn) if commit_lsn else b"")
        self.shared = shared
        self.time = _COMMIT_TIME + varint(commit_time_us) if commit_time_us else b""
        self.insert_prefix = _OPERATION_FIELDS[pb.INSERT] + shared
        self.update_prefix = _OPERATION_FIELDS[pb.UPDATE] + shared
        # Bytes of an INSERT or UPDATE event besides its position field and its row.
        self.insert_fixed = len(self.insert_prefix) + len(self.time)

    def prefix(self, operation: int) -> bytes:
        return _OPERATION_FIELDS[operation] + self.shared

    def unpacked(self) -> tuple[int, bytes, bytes, bytes]:
        """(insert_fixed, time, INSERT prefix, UPDATE prefix), for a loop's local variables."""
        return self.insert_fixed, self.time, self.insert_prefix, self.update_prefix


def encode_event(fields: TransactionFields, operation: int, position: int, new: Buffer | None = None,
                 old: Buffer | None = None, old_kind: str | None = None) -> bytes:
    """One framed event (a `Package.events` entry). `old_kind` is pgoutput's 'K' (key) or 'O' (full row)."""
    parts = [fields.prefix(operation), position_field(position) if position else b"", fields.time]
    if new is not None:
        parts += (new_row_header(len(new)), new)
    if old is not None:
        parts += (old_row_header(len(old)), old)
        if old_kind == "O":
            parts.append(_OLD_FULL)
        elif old_kind == "K":
            parts.append(_OLD_KEY)
    body = b"".join(parts)
    return frame(len(body)) + body


def unframe(framed: bytes) -> bytes:
    """The serialized Event inside a framed event."""
    pos = 1
    while framed[pos] & 0x80:
        pos += 1
    return framed[pos + 1 :]
