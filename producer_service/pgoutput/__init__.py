"""Decoding of pgoutput, PostgreSQL's logical replication output plugin (protocol versions 1 and 2)."""

from producer_service.pgoutput.decoders import MessageDecoder, PgoutputError, decode_message
from producer_service.pgoutput.messages import (
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

__all__ = [
    "Begin",
    "Commit",
    "Delete",
    "Insert",
    "LogicalMessage",
    "MessageDecoder",
    "Origin",
    "PgoutputError",
    "PgoutputMessage",
    "Relation",
    "RelationColumn",
    "StreamAbort",
    "StreamCommit",
    "StreamStart",
    "StreamStop",
    "Truncate",
    "Type",
    "Update",
    "decode_message",
]
