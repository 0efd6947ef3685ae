"""One decoder per pgoutput message type, and the dispatch on the message's first byte.

Layouts follow PostgreSQL's "Logical Replication Message Formats": integers are big-endian,
String is NUL-terminated (UTF-8: the replication connection pins client_encoding), LSNs are
unsigned Int64, timestamps signed Int64 microseconds since 2000-01-01. Inside a streamed block
(protocol version 2, between Stream Start and Stream Stop) Relation, Type, Insert, Update, Delete,
Truncate and transactional Message carry an Int32 xid right after the type byte; only the caller
knows whether it is inside such a block, so it says so (or uses `MessageDecoder`).

Insert, Update and Delete keep their tuples as raw TupleData bytes: the hot path never looks at a
value.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from producer_service.pgoutput.messages import (
    POSTGRES_EPOCH_OFFSET_US,
    Begin,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Origin,
    PgoutputMessage,
    Relation,
    RelationColumn,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
)
from siphon_core.wire.tuple_data import Buffer, tuple_end

_UINT32 = struct.Struct(">I").unpack_from
_INT16 = struct.Struct(">h").unpack_from
_BEGIN = struct.Struct(">QqI").unpack_from
_COMMIT = struct.Struct(">BQQq").unpack_from
_ORIGIN_LSN = struct.Struct(">Q").unpack_from
_COLUMN_TYPE = struct.Struct(">Ii").unpack_from
_MESSAGE_HEAD = struct.Struct(">BQ").unpack_from
_TRUNCATE_HEAD = struct.Struct(">IB").unpack_from
_STREAM_START = struct.Struct(">IB").unpack_from
_STREAM_COMMIT = struct.Struct(">IBQQq").unpack_from
_STREAM_ABORT = struct.Struct(">II").unpack_from

_NEW, _KEY, _OLD = b"NKO"


class PgoutputError(ValueError):
    """A pgoutput message that cannot be decoded; the message names the type byte and the offset."""


def decode_message(payload: Buffer, in_stream: bool = False) -> PgoutputMessage:
    """Decodes one pgoutput message (the payload of one XLogData)."""
    if not payload:
        raise PgoutputError("empty pgoutput message")
    kind = payload[0]
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise PgoutputError(f"unknown pgoutput message type {bytes([kind])!r} (0x{kind:02x}) at offset 0 "
                            f"of a {len(payload)}-byte message")
    try:
        return decoder(payload, in_stream)
    except PgoutputError:
        raise
    except (struct.error, IndexError, ValueError) as error:  # ValueError covers UTF-8 and TupleData
        raise PgoutputError(f"malformed pgoutput {chr(kind)!r} message of {len(payload)} bytes: {error}") from None


class MessageDecoder:
    """Decodes a walsender's messages in order, following Stream Start/Stop blocks."""

    __slots__ = ("in_stream",)

    def __init__(self) -> None:
        self.in_stream = False

    def decode(self, payload: Buffer) -> PgoutputMessage:
        message = decode_message(payload, self.in_stream)
        kind = type(message)
        if kind is StreamStart:
            self.in_stream = True
        elif kind is StreamStop:
            self.in_stream = False
        return message


def decode_begin(data: Buffer, in_stream: bool = False) -> Begin:
    """Byte1('B'), Int64 final LSN of the transaction, Int64 commit timestamp, Int32 xid."""
    final_lsn, commit_time, xid = _BEGIN(data, 1)
    return Begin(final_lsn, commit_time + POSTGRES_EPOCH_OFFSET_US, xid)


def decode_commit(data: Buffer, in_stream: bool = False) -> Commit:
    """Byte1('C'), Int8 flags (unused, 0), Int64 commit LSN, Int64 end LSN of the transaction,
    Int64 commit timestamp."""
    flags, commit_lsn, end_lsn, commit_time = _COMMIT(data, 1)
    return Commit(flags, commit_lsn, end_lsn, commit_time + POSTGRES_EPOCH_OFFSET_US)


def decode_origin(data: Buffer, in_stream: bool = False) -> Origin:
    """Byte1('O'), Int64 commit LSN on the origin server, String origin name."""
    data = bytes(data)
    (commit_lsn,) = _ORIGIN_LSN(data, 1)
    name, _ = _string(data, 9)
    return Origin(commit_lsn, name)


def decode_relation(data: Buffer, in_stream: bool = False) -> Relation:
    """Byte1('R'), [Int32 xid], Int32 relation OID, String namespace, String relation name,
    Int8 replica identity setting, Int16 column count, then per column: Int8 flags (1: part of the
    key), String name, Int32 type OID, Int32 type modifier."""
    data = bytes(data)
    xid, pos = _xid(data, in_stream)
    (relation_id,) = _UINT32(data, pos)
    namespace, pos = _string(data, pos + 4)
    name, pos = _string(data, pos)
    replica_identity = chr(data[pos])
    (count,) = _INT16(data, pos + 1)
    pos += 3
    columns = []
    for _ in range(count):
        flags = data[pos]
        column_name, pos = _string(data, pos + 1)
        type_oid, type_modifier = _COLUMN_TYPE(data, pos)
        pos += 8
        columns.append(RelationColumn(flags, column_name, type_oid, type_modifier))
    return Relation(relation_id, namespace, name, replica_identity, tuple(columns), xid)


def decode_type(data: Buffer, in_stream: bool = False) -> Type:
    """Byte1('Y'), [Int32 xid], Int32 type OID, String namespace (empty for pg_catalog),
    String type name."""
    data = bytes(data)
    xid, pos = _xid(data, in_stream)
    (type_oid,) = _UINT32(data, pos)
    namespace, pos = _string(data, pos + 4)
    name, _ = _string(data, pos)
    return Type(type_oid, namespace, name, xid)


def decode_insert(data: Buffer, in_stream: bool = False) -> Insert:
    """Byte1('I'), [Int32 xid], Int32 relation OID, Byte1('N'), TupleData new row."""
    xid, pos = _xid(data, in_stream)
    (relation_id,) = _UINT32(data, pos)
    _expect(data, pos + 4, _NEW)
    return Insert(relation_id, bytes(data[pos + 5 :]), xid)


def decode_update(data: Buffer, in_stream: bool = False) -> Update:
    """Byte1('U'), [Int32 xid], Int32 relation OID, optionally Byte1('K') TupleData old key or
    Byte1('O') TupleData old row (REPLICA IDENTITY FULL), then Byte1('N') TupleData new row.
    The old part is present only when the key changed or the identity is FULL."""
    xid, pos = _xid(data, in_stream)
    (relation_id,) = _UINT32(data, pos)
    pos += 4
    kind = data[pos]
    if kind == _NEW:
        return Update(relation_id, None, None, bytes(data[pos + 1 :]), xid)
    if kind != _KEY and kind != _OLD:
        raise _unexpected(data, pos, "'N', 'K' or 'O'")
    end = tuple_end(data, pos + 1)
    _expect(data, end, _NEW)
    return Update(relation_id, chr(kind), bytes(data[pos + 1 : end]), bytes(data[end + 1 :]), xid)


def decode_delete(data: Buffer, in_stream: bool = False) -> Delete:
    """Byte1('D'), [Int32 xid], Int32 relation OID, Byte1('K') TupleData old key or Byte1('O')
    TupleData old row (REPLICA IDENTITY FULL)."""
    xid, pos = _xid(data, in_stream)
    (relation_id,) = _UINT32(data, pos)
    pos += 4
    kind = data[pos]
    if kind != _KEY and kind != _OLD:
        raise _unexpected(data, pos, "'K' or 'O'")
    return Delete(relation_id, chr(kind), bytes(data[pos + 1 :]), xid)


def decode_truncate(data: Buffer, in_stream: bool = False) -> Truncate:
    """Byte1('T'), [Int32 xid], Int32 relation count, Int8 options (1: CASCADE, 2: RESTART
    IDENTITY), then Int32 relation OID per relation."""
    xid, pos = _xid(data, in_stream)
    count, options = _TRUNCATE_HEAD(data, pos)
    pos += 5
    relation_ids = struct.unpack_from(f">{count}I", data, pos)
    return Truncate(options, relation_ids, xid)


def decode_logical_message(data: Buffer, in_stream: bool = False) -> LogicalMessage:
    """Byte1('M'), [Int32 xid], Int8 flags (1: transactional), Int64 LSN of the message,
    String prefix, Int32 content length, Byte(n) content."""
    data = bytes(data)
    xid, pos = _xid(data, in_stream)
    flags, lsn = _MESSAGE_HEAD(data, pos)
    prefix, pos = _string(data, pos + 9)
    (length,) = _UINT32(data, pos)
    content = data[pos + 4 : pos + 4 + length]
    if len(content) != length:
        raise ValueError(f"the content of {length} bytes at offset {pos + 4} runs past the end")
    return LogicalMessage(bool(flags & 1), lsn, prefix, content, xid)


def decode_stream_start(data: Buffer, in_stream: bool = False) -> StreamStart:
    """Byte1('S'), Int32 xid, Int8 1 if this is the transaction's first segment, else 0."""
    xid, first_segment = _STREAM_START(data, 1)
    return StreamStart(xid, first_segment == 1)


def decode_stream_stop(data: Buffer, in_stream: bool = False) -> StreamStop:
    """Byte1('E'): ends a streamed block."""
    return StreamStop()


def decode_stream_commit(data: Buffer, in_stream: bool = False) -> StreamCommit:
    """Byte1('c'), Int32 xid, Int8 flags (unused, 0), Int64 commit LSN, Int64 end LSN of the
    transaction, Int64 commit timestamp."""
    xid, flags, commit_lsn, end_lsn, commit_time = _STREAM_COMMIT(data, 1)
    return StreamCommit(xid, flags, commit_lsn, end_lsn, commit_time + POSTGRES_EPOCH_OFFSET_US)


def decode_stream_abort(data: Buffer, in_stream: bool = False) -> StreamAbort:
    """Byte1('A'), Int32 xid, Int32 subtransaction xid (the xid itself when the whole transaction
    aborted). Protocol version 4's abort LSN and time are not requested by Siphon."""
    xid, subxid = _STREAM_ABORT(data, 1)
    return StreamAbort(xid, subxid)


_DECODERS: dict[int, Callable[[Buffer, bool], PgoutputMessage]] = {
    ord("B"): decode_begin,
    ord("C"): decode_commit,
    ord("O"): decode_origin,
    ord("R"): decode_relation,
    ord("Y"): decode_type,
    ord("I"): decode_insert,
    ord("U"): decode_update,
    ord("D"): decode_delete,
    ord("T"): decode_truncate,
    ord("M"): decode_logical_message,
    ord("S"): decode_stream_start,
    ord("E"): decode_stream_stop,
    ord("c"): decode_stream_commit,
    ord("A"): decode_stream_abort,
}


def _xid(data: Buffer, in_stream: bool) -> tuple[int | None, int]:
    """The streamed block's xid, if any, and the offset after it."""
    if in_stream:
        return _UINT32(data, 1)[0], 5
    return None, 1


def _string(data: bytes, pos: int) -> tuple[str, int]:
    end = data.find(0, pos)
    if end < 0:
        raise ValueError(f"the string starting at offset {pos} has no terminating NUL byte")
    return data[pos:end].decode(), end + 1


def _expect(data: Buffer, pos: int, kind: int) -> None:
    if data[pos] != kind:
        raise _unexpected(data, pos, repr(chr(kind)))


def _unexpected(data: Buffer, pos: int, expected: str) -> PgoutputError:
    return PgoutputError(f"pgoutput {chr(data[0])!r} message: expected {expected} at offset {pos}, "
                         f"found {bytes([data[pos]])!r}")
