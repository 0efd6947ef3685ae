"""Reads one block range of a table exactly as of a temporary replication slot's consistent point.

The temporary slot is created on a replication connection that stays open while the range is
read (its exported snapshot lives only that long) with a TID range scan in a REPEATABLE READ
transaction that imports the snapshot. Every row read is as of the slot's consistent point, and
every change after it reaches the queue with a greater version, so the rows get version
(consistent point, 0) and any number of such reads converge with the stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from psycopg import sql

from producer_service.replication import ReplicationConnection, ReplicationError, SlotInfo
from siphon_core.logs import get_logger
from siphon_dagster.partitions import BlockRange
from siphon_dagster.source import connect
from siphon_dagster.targets.base import TableSchema

log = get_logger("snapshot")
CHUNK_BYTES = 8 * 1024 * 1024


class NoFreeSlotError(RuntimeError):
    """Every replication slot of the source is taken, and waiting did not free one."""


@dataclass
class SnapshotProgress:
    rows: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def seconds(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)


def _slot_is_unavailable(error: ReplicationError) -> bool:
    text = str(error).lower()
    return "replication slots are in use" in text or "number of requested standby connections" in text \
        or "too many clients" in text


@contextmanager
def exported_snapshot(dsn: str, wait_seconds: float = 600.0,
                      on_wait: Callable[[str], None] | None = None) -> Iterator[SlotInfo]:
    """A temporary pgoutput slot with an exported snapshot, valid until the block exits."""
    deadline = time.monotonic() + wait_seconds
    name = f"siphon_snap_{uuid.uuid4().hex[:16]}"
    while True:
        replication = ReplicationConnection(dsn, application_name="siphon snapshot")
        try:
            slot = replication.create_slot(name, temporary=True, export_snapshot=True)
            break
        except ReplicationError as error:
            replication.close()
            if not _slot_is_unavailable(error) or time.monotonic() > deadline:
                if _slot_is_unavailable(error):
                    raise NoFreeSlotError(f"no free replication slot on the source after {wait_seconds:.0f}s: "
                                          f"{error}; raise max_replication_slots or lower the snapshot pool limit")\
                        from None
                raise
            message = f"no free replication slot on the source ({error}); waiting"
            (on_wait or log.warning)(message)
            time.sleep(5.0)
    try:
        yield slot
    finally:
        replication.close()  # a temporary slot disappears with its connection


def copy_query(table: TableSchema, block_range: BlockRange) -> sql.Composed:
    first, last = block_range.ctid_bounds
    return sql.SQL("COPY (SELECT {columns} FROM {table} WHERE ctid >= {first}::tid AND ctid <= {last}::tid) "
                   "TO STDOUT").format(
        columns=sql.SQL(", ").join(sql.Identifier(name) for name in table.column_names),
        table=sql.Identifier(table.schema, table.table),
        first=sql.Literal(first),
        last=sql.Literal(last),
    )


def read_range(dsn: str, snapshot_name: str, table: TableSchema, block_range: BlockRange,
               progress: SnapshotProgress, chunk_bytes: int = CHUNK_BYTES,
               on_progress: Callable[[SnapshotProgress], None] | None = None) -> Iterator[bytes]:
    """COPY text of the range as chunks of whole lines, at most about `chunk_bytes` each."""
    with connect(dsn, application_name="siphon snapshot") as connection:
        connection.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        connection.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
        pending: list[bytes] = []
        pending_bytes = 0
        last_report = time.monotonic()
        with connection.cursor().copy(copy_query(table, block_range)) as copy:
            for data in copy:
                # psycopg yields one row per item for COPY text: group rows into chunks.
                piece = bytes(data)
                pending.append(piece)
                pending_bytes += len(piece)
                if pending_bytes >= chunk_bytes:
                    chunk = b"".join(pending)
                    pending, pending_bytes = [], 0
                    progress.rows += chunk.count(b"\n")
                    progress.bytes += len(chunk)
                    yield chunk
                    if on_progress is not None and time.monotonic() - last_report > 5.0:
                        on_progress(progress)
                        last_report = time.monotonic()
        if pending:
            chunk = b"".join(pending)
            progress.rows += chunk.count(b"\n")
            progress.bytes += len(chunk)
            yield chunk
        connection.rollback()
