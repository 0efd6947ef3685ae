"""One decoder per pgoutput message type, and the dispatch on the message's first byte.

The layout (type bytes, field structs, markers) is `producer_service.pgoutput.layout`, which the
producer's hot path reads too; each decoder's docstring repeats its message's layout. Strings are
UTF-8: the replication connection pins client_encoding. Inside a streamed block the changes carry
an xid; only the caller knows whether it is inside such a block, so it says so (or uses
`MessageDecoder`).

Insert, Update and Delete keep their tuples as raw TupleData bytes: the hot path never looks at a
value.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import producer_service.pgoutput.messages as m
from producer_service.pgoutput import layout
from producer_service.pgoutput.layout import PgoutputError
from siphon_core.wire.tuple_data import Buffer

_OID = layout.OID.unpack_from
_XID = layout.STREAMED_XID.unpack_from
_EPOCH = m.POSTGRES_EPOCH_OFFSET_US


def decode_message(payload: Buffer, in_stream: bool = False) -> m.PgoutputMessage:
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

    def decode(self, payload: Buffer) -> m.PgoutputMessage:
        message = decode_message(payload, self.in_stream)
        kind = type(message)
        if kind is m.StreamStart:
            self.in_stream = True
        elif kind is m.StreamStop:
            self.in_stream = False
        return message


def decode_begin(data: Buffer, in_stream: bool = False) -> m.Begin:
    """Byte1('B'), Int64 final LSN of the transaction, Int64 commit timestamp, Int32 xid."""
    final_lsn, commit_time, xid = layout.BEGIN_FIELDS.unpack_from(data, 1)
    return m.Begin(final_lsn, commit_time + _EPOCH, xid)


def decode_commit(data: Buffer, in_stream: bool = False) -> m.Commit:
    """Byte1('C'), Int8 flags (unused, 0), Int64 commit LSN, Int64 end LSN of the transaction,
    Int64 commit timestamp."""
    flags, commit_lsn, end_lsn, commit_time = layout.COMMIT_FIELDS.unpack_from(data, 1)
    return m.Commit(flags, commit_lsn, end_lsn, commit_time + _EPOCH)


def decode_origin(data: Buffer, in_stream: bool = False) -> m.Origin:
    """Byte1('O'), Int64 commit LSN on the origin server, String origin name."""
    data = bytes(data)
    (commit_lsn,) = layout.ORIGIN_LSN.unpack_from(data, 1)
    name, _ = _string(data, 1 + layout.ORIGIN_LSN.size)
    return m.Origin(commit_lsn, name)


def decode_relation(data: Buffer, in_stream: bool = False) -> m.Relation:
    """Byte1('R'), [Int32 xid], Int32 relation OID, String namespace, String relation name,
    Int8 replica identity setting, Int16 column count, then per column: Int8 flags (1: part of the
    key), String name, Int32 type OID, Int32 type modifier."""
    data = bytes(data)
    xid, pos = _xid(data, in_stream)
    (relation_id,) = _OID(data, pos)
    namespace, pos = _string(data, pos + layout.OID.size)
    name, pos = _string(data, pos)
    replica_identity, count = layout.RELATION_TAIL.unpack_from(data, pos)
    pos += layout.RELATION_TAIL.size
    columns = []
    for _ in range(count):
        flags = data[pos]
        column_name, pos = _string(data, pos + 1)
        type_oid, type_modifier = layout.COLUMN_TYPE.unpack_from(data, pos)
        pos += layout.COLUMN_TYPE.size
        columns.append(m.RelationColumn(flags, column_name, type_oid, type_modifier))
    return m.Relation(relation_id, namespace, name, chr(replica_identity), tuple(columns), xid)


def decode_type(data: Buffer, in_stream: bool = False) -> m.Type:
    """Byte1('Y'), [Int32 xid], Int32 type OID, String namespace (empty for pg_catalog),
    String type name."""
    data = bytes(data)
    xid, pos = _xid(data, in_stream)
    (type_oid,) = _OID(data, pos)
    namespace, pos = _string(data, pos + layout.OID.size)
    name, _ = _string(data, pos)
    return m.Type(type_oid, namespace, name, xid)


def decode_insert(data: Buffer, in_stream: bool = False) -> m.Insert:
    """Byte1('I'), [Int32 xid], Int32 relation OID, Byte1('N'), TupleData new row."""
    xid, pos = _xid(data, in_stream)
    (relation_id,) = _OID(data, pos)
    marker = pos + layout.OID.size
    layout.expect_marker(data, marker, layout.INSERT_MARKERS)
    return m.Insert(relation_id, bytes(data[marker + 1 :]), xid)


def decode_update(data: Buffer, in_stream: bool = False) -> m.Update:
    """Byte1('U'), [Int32 xid], Int32 relation OID, optionally Byte1('K') TupleData old key or
    Byte1('O') TupleData old row (REPLICA IDENTITY FULL), then Byte1('N') TupleData new row.
    The old part is present only when the key changed or the identity is FULL."""
    xid, pos = _xid(data, in_stream)
    (relation_id,) = _OID(data, pos)
    marker = pos + layout.OID.size
    kind = layout.expect_marker(data, marker, layout.UPDATE_MARKERS)
    if kind == layout.NEW_TUPLE:
        return m.Update(relation_id, None, None, bytes(data[marker + 1 :]), xid)
    end = layout.old_tuple_end(data, marker)
    return m.Update(relation_id, chr(kind), bytes(data[marker + 1 : end]), bytes(data[end + 1 :]), xid)


def decode_delete(data: Buffer, in_stream: bool = False) -> m.Delete:
    """Byte1('D'), [Int32 xid], Int32 relation OID, Byte1('K') TupleData old key or Byte1('O')
    TupleData old row (REPLICA IDENTITY FULL)."""
    xid, pos = _xid(data, in_stream)
    (relation_id,) = _OID(data, pos)
    marker = pos + layout.OID.size
    kind = layout.expect_marker(data, marker, layout.DELETE_MARKERS)
    return m.Delete(relation_id, chr(kind), bytes(data[marker + 1 :]), xid)


def decode_truncate(data: Buffer, in_stream: bool = False) -> m.Truncate:
    """Byte1('T'), [Int32 xid], Int32 relation count, Int8 options (1: CASCADE, 2: RESTART
    IDENTITY), then Int32 relation OID per relation."""
    xid, pos = _xid(data, in_stream)
    count, options = layout.TRUNCATE_HEAD.unpack_from(data, pos)
    pos += layout.TRUNCATE_HEAD.size
    relation_ids = struct.unpack_from(f">{count}I", data, pos)
    return m.Truncate(options, relation_ids, xid)


def decode_logical_message(data: Buffer, in_stream: bool = False) -> m.LogicalMessage:
    """Byte1('M'), [Int32 xid], Int8 flags (1: transactional), Int64 LSN of the message,
    String prefix, Int32 content length, Byte(n) content."""
    data = bytes(data)
    xid, pos = _xid(data, in_stream)
    flags, lsn = layout.MESSAGE_HEAD.unpack_from(data, pos)
    prefix, pos = _string(data, pos + layout.MESSAGE_HEAD.size)
    (length,) = layout.CONTENT_LENGTH.unpack_from(data, pos)
    pos += layout.CONTENT_LENGTH.size
    content = data[pos : pos + length]
    if len(content) != length:
        raise ValueError(f"the content of {length} bytes at offset {pos} runs past the end")
    return m.LogicalMessage(bool(flags & 1), lsn, prefix, content, xid)


def decode_stream_start(data: Buffer, in_stream: bool = False) -> m.StreamStart:
    """Byte1('S'), Int32 xid, Int8 1 if this is the transaction's first segment, else 0."""
    xid, first_segment = layout.STREAM_START_FIELDS.unpack_from(data, 1)
    return m.StreamStart(xid, first_segment == 1)


def decode_stream_stop(data: Buffer, in_stream: bool = False) -> m.StreamStop:
    """Byte1('E'): ends a streamed block."""
    return m.StreamStop()


def decode_stream_commit(data: Buffer, in_stream: bool = False) -> m.StreamCommit:
    """Byte1('c'), Int32 xid, Int8 flags (unused, 0), Int64 commit LSN, Int64 end LSN of the
    transaction, Int64 commit timestamp."""
    xid, flags, commit_lsn, end_lsn, commit_time = layout.STREAM_COMMIT_FIELDS.unpack_from(data, 1)
    return m.StreamCommit(xid, flags, commit_lsn, end_lsn, commit_time + _EPOCH)


def decode_stream_abort(data: Buffer, in_stream: bool = False) -> m.StreamAbort:
    """Byte1('A'), Int32 xid, Int32 subtransaction xid (the xid itself when the whole transaction
    aborted). Protocol version 4's abort LSN and time are not requested by Siphon."""
    xid, subxid = layout.STREAM_ABORT_FIELDS.unpack_from(data, 1)
    return m.StreamAbort(xid, subxid)


_DECODERS: dict[int, Callable[[Buffer, bool], m.PgoutputMessage]] = {
    layout.BEGIN: decode_begin,
    layout.COMMIT: decode_commit,
    layout.ORIGIN: decode_origin,
    layout.RELATION: decode_relation,
    layout.TYPE: decode_type,
    layout.INSERT: decode_insert,
    layout.UPDATE: decode_update,
    layout.DELETE: decode_delete,
    layout.TRUNCATE: decode_truncate,
    layout.MESSAGE: decode_logical_message,
    layout.STREAM_START: decode_stream_start,
    layout.STREAM_STOP: decode_stream_stop,
    layout.STREAM_COMMIT: decode_stream_commit,
    layout.STREAM_ABORT: decode_stream_abort,
}


def _xid(data: Buffer, in_stream: bool) -> tuple[int | None, int]:
    """The streamed block's xid, if any, and the offset after it."""
    if in_stream:
        return _XID(data, layout.BODY)[0], layout.STREAMED_BODY
    return None, layout.BODY


def _string(data: bytes, pos: int) -> tuple[str, int]:
    end = data.find(0, pos)
    if end < 0:
        raise ValueError(f"the string starting at offset {pos} has no terminating NUL byte")
    return data[pos:end].decode(), end + 1
