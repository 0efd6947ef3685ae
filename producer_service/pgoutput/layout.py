"""pgoutput's byte layout, defined once for the decoders and the producer's hot path.

PostgreSQL's "Logical Replication Message Formats": every message starts with a type byte;
integers are big-endian, String is NUL-terminated, LSNs are unsigned Int64, timestamps signed
Int64 microseconds since 2000-01-01. Inside a streamed block (protocol version 2, between Stream
Start and Stream Stop) Relation, Type, Insert, Update, Delete, Truncate and transactional Message
carry an Int32 xid right after the type byte. Insert, Update and Delete put a marker byte before
each TupleData: 'N' new row, 'K' old key, 'O' old row (REPLICA IDENTITY FULL). TupleData itself
('n' null, 'u' unchanged TOASTed value, 't' text, 'b' binary) is the value encoding of the wire
contract too, so it is defined in `siphon_core.wire.tuple_data` and re-exported here.

`producer_service.pgoutput.decoders` turns each layout into a message object;
`producer_service.changes` reads the same offsets and structs in place, without one.
"""

from __future__ import annotations

import struct

from siphon_core.wire.tuple_data import BINARY, NULL, TEXT, UNCHANGED, Buffer, tuple_end  # noqa: F401  (re-exports TupleData's kinds)

# Message type bytes.
BEGIN, COMMIT, ORIGIN, RELATION, TYPE, MESSAGE = b"BCORYM"
INSERT, UPDATE, DELETE, TRUNCATE = b"IUDT"
STREAM_START, STREAM_STOP, STREAM_COMMIT, STREAM_ABORT = b"SEcA"

# The marker before each TupleData of Insert, Update and Delete, and the markers each of them may
# start with (Update has an old part only when the key changed or the identity is FULL).
NEW_TUPLE, OLD_KEY, OLD_ROW = b"NKO"
INSERT_MARKERS, UPDATE_MARKERS, DELETE_MARKERS = b"N", b"NKO", b"KO"

# Field groups, each read with one unpack_from at the offset the decoder has reached.
STREAMED_XID = struct.Struct(">I")  # after the type byte, inside a streamed block only
OID = struct.Struct(">I")  # relation OID (Relation, Insert, Update, Delete), type OID (Type)
BEGIN_FIELDS = struct.Struct(">QqI")  # final LSN, commit timestamp, xid
COMMIT_FIELDS = struct.Struct(">BQQq")  # flags (0), commit LSN, end LSN, commit timestamp
ORIGIN_LSN = struct.Struct(">Q")  # the commit's LSN on the origin server; then String name
RELATION_TAIL = struct.Struct(">Bh")  # after the two Strings: replica identity, column count
COLUMN_TYPE = struct.Struct(">Ii")  # after a column's flags and String name: type OID, modifier
MESSAGE_HEAD = struct.Struct(">BQ")  # flags (1: transactional), LSN; then String prefix
CONTENT_LENGTH = struct.Struct(">I")  # Message's content length, after the prefix
TRUNCATE_HEAD = struct.Struct(">IB")  # relation count, options; then an OID per relation
STREAM_START_FIELDS = struct.Struct(">IB")  # xid, 1 on the transaction's first segment
STREAM_COMMIT_FIELDS = struct.Struct(">IBQQq")  # xid, flags (0), commit LSN, end LSN, commit timestamp
STREAM_ABORT_FIELDS = struct.Struct(">II")  # xid, subtransaction xid

# Where the fields after the type byte start, outside and inside a streamed block.
BODY = 1
STREAMED_BODY = BODY + STREAMED_XID.size

# Insert, Update and Delete outside a streamed block (the only kind the producer asks for):
# type byte, relation OID, the first marker, its TupleData.
CHANGE_RELATION_ID = BODY
CHANGE_MARKER = CHANGE_RELATION_ID + OID.size
CHANGE_TUPLE = CHANGE_MARKER + 1


class PgoutputError(ValueError):
    """A pgoutput message that cannot be decoded; the message names the type byte and the offset."""


def expect_marker(data: Buffer, pos: int, allowed: bytes, start: int = 0) -> int:
    """The marker byte at `pos`, one of `allowed`; `start` is where the message begins in `data`."""
    marker = data[pos]
    if marker not in allowed:
        raise unexpected(data, pos, _one_of(allowed), start)
    return marker


def old_tuple_end(data: Buffer, marker: int, start: int = 0) -> int:
    """The offset of the 'N' marker that follows an Update's old tuple (whose marker is at `marker`)."""
    end = tuple_end(data, marker + 1)
    expect_marker(data, end, INSERT_MARKERS, start)  # what follows is the new row, as in an Insert
    return end


def unexpected(data: Buffer, pos: int, expected: str, start: int = 0) -> PgoutputError:
    """The error for the byte at `pos`, which is not what the layout puts there."""
    return PgoutputError(f"pgoutput {chr(data[start])!r} message: expected {expected} at offset {pos - start}, "
                         f"found {bytes([data[pos]])!r}")


def _one_of(allowed: bytes) -> str:
    names = [repr(chr(byte)) for byte in allowed]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
