"""Reads one block range of a table exactly as of a temporary replication slot's consistent point.

The temporary slot is created on a replication connection that stays open while the range is
read (its exported snapshot lives only that long) with a TID range scan in a REPEATABLE READ
transaction that imports the snapshot. Every row read is as of the slot's consistent point, and
every change after it reaches the queue with a greater version, so the rows get version
(consistent point, 0) and any number of such reads converge with the stream.
"""

from __future__ import annotations

import select
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import tenacity
from psycopg import pq, sql

from siphon_core.logs import get_logger
from siphon_core.replication import ReplicationConnection, ReplicationError, SlotInfo
from siphon_dagster.partitions import BlockRange
from siphon_dagster.snapshot.blockers import (
    CHECK_SECONDS,
    WaitReport,
    watch_slot_wait,
)
from siphon_dagster.source import connect
from siphon_dagster.targets.base import TableSchema

log = get_logger("snapshot")
# Small enough that PostgreSQL, this process and the target work at once, and that the copies of a
# chunk on its way stay in the CPU's cache: 1 MiB chunks cost this process a third more CPU.
CHUNK_BYTES = 128 << 10
# How often a snapshot waiting for a free replication slot tries again.
SLOT_RETRY_SECONDS = 5.0


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
                      on_wait: Callable[[str], None] | None = None, *, table: str = "a table",
                      wait_limit_seconds: float = 0.0,
                      on_blocked: Callable[[WaitReport], None] | None = None,
                      check_seconds: float = CHECK_SECONDS) -> Iterator[SlotInfo]:
    """A temporary pgoutput slot with an exported snapshot, valid until the block exits.

    While the slot's creation waits for older transactions, `on_blocked` (default: `on_wait` with
    the report's text) hears which backends hold it; past `wait_limit_seconds` (0: no limit) the
    creation is ended and SnapshotWaitLimitError raised.
    """
    name = f"siphon_snap_{uuid.uuid4().hex[:16]}"
    report = on_blocked or (lambda r: (on_wait or log.warning)(r.text()))

    def waiting(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        (on_wait or log.warning)(f"no free replication slot on the source ({error}); waiting")

    # Only a source without a free slot (or connection) is worth waiting for; any other error,
    # SnapshotWaitLimitError included, is raised at once.
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, ReplicationError) and _slot_is_unavailable(e)),
        stop=tenacity.stop_after_delay(wait_seconds),
        wait=tenacity.wait_fixed(SLOT_RETRY_SECONDS),
        before_sleep=waiting,
        reraise=True,
    )
    try:
        replication, slot = retrying(_create_snapshot_slot, dsn, name, table, wait_limit_seconds, report,
                                     check_seconds)
    except ReplicationError as error:
        if _slot_is_unavailable(error):
            raise NoFreeSlotError(f"no free replication slot on the source after {wait_seconds:.0f}s: {error}; "
                                  f"raise max_replication_slots or lower the snapshot pool limit") from None
        raise
    try:
        yield slot
    finally:
        replication.close()  # a temporary slot disappears with its connection


def _create_snapshot_slot(dsn: str, name: str, table: str, wait_limit_seconds: float,
                          report: Callable[[WaitReport], None],
                          check_seconds: float) -> tuple[ReplicationConnection, SlotInfo]:
    """One attempt: a replication connection and its temporary slot, or the connection closed."""
    replication = ReplicationConnection(dsn, application_name="siphon snapshot")
    try:
        with watch_slot_wait(dsn, table, replication.backend_pid, name, wait_limit_seconds, report, check_seconds):
            return replication, replication.create_slot(name, temporary=True, export_snapshot=True)
    except BaseException:
        replication.close()
        raise


def copy_query(table: TableSchema, block_range: BlockRange) -> sql.Composed:
    first, last = block_range.ctid_bounds
    return sql.SQL("COPY (SELECT {columns} FROM {table} WHERE ctid >= {first}::tid AND ctid <= {last}::tid) "
                   "TO STDOUT").format(
        columns=sql.SQL(", ").join(sql.Identifier(name) for name in table.column_names),
        table=sql.Identifier(table.schema, table.table),
        first=sql.Literal(first),
        last=sql.Literal(last),
    )


@contextmanager
def snapshot_transaction(dsn: str, snapshot_name: str, schema: str, table: str) -> Iterator[psycopg.Connection[Any]]:
    """A REPEATABLE READ transaction on the exported snapshot, holding the table's ACCESS SHARE lock.

    The lock (the one COPY takes anyway) is taken first: from then on no ALTER TABLE can commit until
    the range is read, so a column list read now from the current catalog is the one the COPY parses
    against. Rows as of the snapshot that predate a column added since come out with the value
    PostgreSQL gives them (the catalog's missing value, or NULL).
    """
    with connect(dsn, application_name="siphon snapshot") as connection:
        connection.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        connection.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
        connection.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(sql.Identifier(schema, table)))
        table_layout(connection, schema, table)
        yield connection
        if not connection.closed:
            connection.rollback()


class TableRewrittenError(RuntimeError):
    """The table's storage was rewritten between the snapshot and its lock: read now, under the
    snapshot, it would look empty (a rewriting ALTER TABLE, TRUNCATE) or hold its rows at other
    block positions (VACUUM FULL, CLUSTER). Another snapshot, taken after the rewrite, reads it right."""


def table_layout(connection: psycopg.Connection[Any], schema: str, table: str) -> tuple[tuple[int, int], ...]:
    """The storage the table (and each partition of it) has as of the transaction's snapshot:
    (relation, file node) pairs. Called with the table locked; raises TableRewrittenError when the
    storage is no longer that (`pg_relation_filenode` reads the current catalog, not the snapshot)."""
    qualified = sql.Literal(sql.Identifier(schema, table).as_string(connection))
    rows = connection.execute(sql.SQL(
        "SELECT c.oid::bigint, c.relfilenode::bigint, pg_relation_filenode(c.oid)::bigint FROM pg_class c "
        "WHERE c.oid IN (SELECT {table}::regclass UNION SELECT relid FROM pg_partition_tree({table}::regclass)) "
        "AND c.relfilenode <> 0 ORDER BY c.oid").format(table=qualified)).fetchall()
    moved = [oid for oid, as_of_snapshot, now in rows if now is not None and now != as_of_snapshot]
    if moved:
        raise TableRewrittenError(
            f"{schema}.{table} was rewritten (ALTER TABLE, TRUNCATE, VACUUM FULL or CLUSTER) after this range's "
            "snapshot was taken; nothing of the range was read, and it is read again under a new snapshot")
    return tuple((oid, as_of_snapshot) for oid, as_of_snapshot, _ in rows)


def read_range(dsn: str, snapshot_name: str, table: TableSchema, block_range: BlockRange,
               progress: SnapshotProgress, chunk_bytes: int = CHUNK_BYTES,
               on_progress: Callable[[SnapshotProgress], None] | None = None) -> Iterator[bytes]:
    """`read_locked_range` in a transaction of its own."""
    with snapshot_transaction(dsn, snapshot_name, table.schema, table.table) as connection:
        yield from read_locked_range(connection, table, block_range, progress, chunk_bytes, on_progress)


def read_locked_range(connection: psycopg.Connection[Any], table: TableSchema, block_range: BlockRange,
                      progress: SnapshotProgress, chunk_bytes: int = CHUNK_BYTES,
                      on_progress: Callable[[SnapshotProgress], None] | None = None) -> Iterator[bytes]:
    """COPY text of the range as chunks of whole lines, at most about `chunk_bytes` each, read in a
    `snapshot_transaction`.

    Memory stays at one chunk whatever the range's size: rows are read as the consumer takes chunks.
    """
    last_report = time.monotonic()
    statement = copy_query(table, block_range).as_bytes(connection)
    with closing(copy_out(connection, statement, chunk_bytes)) as chunks:
        for chunk, rows in chunks:
            progress.rows += rows
            progress.bytes += len(chunk)
            yield chunk
            if on_progress is not None and time.monotonic() - last_report > 5.0:
                on_progress(progress)
                last_report = time.monotonic()


def copy_out(connection: psycopg.Connection[Any], statement: bytes,
             chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
    """The output of a `COPY ... TO STDOUT` straight from libpq, as chunks of whole rows of about
    `chunk_bytes` each, with the number of rows in each.

    COPY text sends one message per row, newline included. psycopg's `Copy.read()` makes a
    generator round trip per message, which costs several times what libpq itself does, so the
    messages are gathered here in one loop with nothing else in it. If the consumer stops early,
    the connection is closed, which ends the COPY at the server.
    """
    pgconn = connection.pgconn
    readable = select.poll()
    readable.register(pgconn.socket, select.POLLIN)
    finished = False
    try:
        pgconn.send_query(statement)
        if pgconn.flush():
            writable = select.poll()
            writable.register(pgconn.socket, select.POLLOUT)
            while pgconn.flush():
                writable.poll()
        result = _next_result(pgconn, readable)
        if result is None or result.status != pq.ExecStatus.COPY_OUT:
            raise _error(connection, result, "COPY did not start")
        get_copy_data = pgconn.get_copy_data
        pending, rows = bytearray(), 0
        while True:
            size, data = get_copy_data(1)  # nonblocking: 0 means no whole message yet
            if size > 0:
                pending += data
                rows += 1
                if len(pending) >= chunk_bytes:
                    yield bytes(pending), rows
                    pending.clear()
                    rows = 0
            elif size == 0:
                readable.poll()
                pgconn.consume_input()
            else:
                break  # -1: the COPY is done (libpq's errors raise in get_copy_data)
        if pending:
            yield bytes(pending), rows
        while (result := _next_result(pgconn, readable)) is not None:
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise _error(connection, result, "COPY failed")
        finished = True
    finally:
        if not finished:
            connection.close()


def _next_result(pgconn: pq.abc.PGconn, readable: select.poll) -> pq.abc.PGresult | None:
    pgconn.consume_input()
    while pgconn.is_busy():
        readable.poll()
        pgconn.consume_input()
    return pgconn.get_result()


def _error(connection: psycopg.Connection[Any], result: pq.abc.PGresult | None, what: str) -> psycopg.Error:
    if result is not None and result.status == pq.ExecStatus.FATAL_ERROR:
        return psycopg.errors.error_from_result(result, encoding=connection.info.encoding)
    status = "no result" if result is None else pq.ExecStatus(result.status).name
    return psycopg.OperationalError(f"{what}: unexpected {status}")
