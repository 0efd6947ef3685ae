"""The pgoutput messages, as decoded by `producer_service.pgoutput.decoders`.

LSNs are integers (format them with `siphon_core.naming.format_lsn`); times are microseconds since
the Unix epoch, UTC. `xid` on a change, relation, type or message is set only inside a streamed
block (protocol version 2), where it names the (sub)transaction the change belongs to.
Row values stay undecoded TupleData bytes (see `siphon_core.wire.tuple_data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

# pgoutput counts time from 2000-01-01 (PostgreSQL's epoch).
from siphon_core.replication import POSTGRES_EPOCH_OFFSET_US  # noqa: F401  (re-exported for the decoders)

KEY_COLUMN_FLAG = 1
TRUNCATE_CASCADE = 1
TRUNCATE_RESTART_IDENTITY = 2


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_time: int
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


@dataclass(frozen=True, slots=True)
class Origin:
    commit_lsn: int  # the commit's LSN on the origin server
    name: str


@dataclass(frozen=True, slots=True)
class RelationColumn:
    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        return bool(self.flags & KEY_COLUMN_FLAG)


@dataclass(frozen=True, slots=True)
class Relation:
    relation_id: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[RelationColumn, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Type:
    type_oid: int
    namespace: str
    name: str
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Insert:
    relation_id: int
    new_tuple: bytes
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Update:
    relation_id: int
    old_kind: str | None  # 'K' old key, 'O' old full row (REPLICA IDENTITY FULL), None: key unchanged
    old_tuple: bytes | None
    new_tuple: bytes
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    relation_id: int
    old_kind: str  # 'K' old key, 'O' old full row (REPLICA IDENTITY FULL)
    old_tuple: bytes
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Truncate:
    options: int
    relation_ids: tuple[int, ...]
    xid: int | None = None

    @property
    def cascade(self) -> bool:
        return bool(self.options & TRUNCATE_CASCADE)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & TRUNCATE_RESTART_IDENTITY)


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    """A message written with pg_logical_emit_message."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class StreamStart:
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    pass


@dataclass(frozen=True, slots=True)
class StreamCommit:
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


@dataclass(frozen=True, slots=True)
class StreamAbort:
    xid: int
    subxid: int  # equals xid when the whole transaction aborted


PgoutputMessage: TypeAlias = (
    Begin | Commit | Origin | Relation | Type | Insert | Update | Delete | Truncate | LogicalMessage
    | StreamStart | StreamStop | StreamCommit | StreamAbort
)
