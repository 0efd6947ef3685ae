"""A snapshot range holds its slot and the table's lock only while PostgreSQL sends it.

The loader here takes one chunk and then stops taking, as a slow warehouse would; the COPY must
still end, and the slot and the lock go with it, long before the load does.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from siphon_core.config import TableConfig
from siphon_dagster import source
from siphon_dagster.partitions import BlockRange
from siphon_dagster.snapshot.reader import CHUNK_BYTES, SnapshotProgress
from siphon_dagster.snapshot.spool import SnapshotReadError, spooled_range
from siphon_dagster.targets.base import TableSchema
from tests.helpers.application import Application
from tests.helpers.producer import execute, wait_until

EVERY_BLOCK = BlockRange(0, 1 << 20)
ROWS = 60_000  # about 12 MB of COPY text: many chunks, more than the sockets between hold


@pytest.fixture
def app(app: Application) -> Application:
    app.sql("create table {schema}.t (id bigint primary key, body text not null)")
    app.sql(f"insert into {{schema}}.t select g, repeat(md5(g::text), 6) from generate_series(1, {ROWS}) g")
    return app


def whole_table_text(app: Application) -> bytes:
    with psycopg.connect(app.dsn) as connection, connection.cursor() as cursor:
        query = sql.SQL("COPY (SELECT id, body FROM {} ORDER BY ctid) TO STDOUT").format(app.table("t"))
        with cursor.copy(query) as copy:
            return b"".join(bytes(block) for block in copy)


def snapshot_backends(app: Application) -> list[tuple[str, str]]:
    return execute(app.dsn, "select backend_type, state from pg_stat_activity "
                            "where application_name = 'siphon snapshot' and pid <> pg_backend_pid()")


def snapshot_slots(app: Application) -> list[tuple[str]]:
    return execute(app.dsn, "select slot_name from pg_replication_slots where slot_name like 'siphon_snap_%'")


def columns_of(app: Application) -> Callable[[], TableSchema]:
    def read() -> TableSchema:
        with source.connect(app.dsn, autocommit=True) as catalog:
            return source.table_schema(catalog, TableConfig(name=app.qualified("t")))
    return read


def test_the_source_is_released_when_the_copy_ends_not_when_the_load_does(app: Application) -> None:
    expected = whole_table_text(app)
    progress = SnapshotProgress()
    with spooled_range(app.dsn, app.schema, "t", EVERY_BLOCK, columns_of(app), progress) as reading:
        chunks = reading.chunks()
        received = [next(chunks)]
        assert snapshot_slots(app), "the range is read under its own temporary slot"
        # The loader takes nothing more, yet the COPY ends and gives the source back.
        wait_until(lambda: reading.source_released, 30, "the read's slot and transaction released")
        assert snapshot_slots(app) == []
        assert snapshot_backends(app) == []
        assert progress.rows == ROWS
        # No lock is left for DDL to wait on, while the load has most of the range still ahead.
        execute(app.dsn, sql.SQL("set lock_timeout = '5s'; alter table {} add column later int").format(app.table("t")))
        received += list(chunks)
    assert len(received) > 10
    assert all(len(chunk) <= CHUNK_BYTES + 1024 and chunk.endswith(b"\n") for chunk in received)
    assert b"".join(received) == expected, "the rows as of the slot's snapshot, without the column added later"


def test_a_loader_that_stops_early_ends_the_read_and_frees_the_source(app: Application) -> None:
    with spooled_range(app.dsn, app.schema, "t", EVERY_BLOCK, columns_of(app), SnapshotProgress(),
                       max_ahead_bytes=CHUNK_BYTES) as reading:
        chunks = reading.chunks()
        next(chunks)
        assert not reading.source_released, "the reader waits for the loader once it is a chunk ahead"
    wait_until(lambda: not snapshot_backends(app) and not snapshot_slots(app), 30, "the snapshot's backends gone")
    execute(app.dsn, sql.SQL("set lock_timeout = '5s'; alter table {} add column later int").format(app.table("t")))


def test_a_read_that_fails_fails_the_load_after_what_was_read(app: Application) -> None:
    with spooled_range(app.dsn, app.schema, "t", EVERY_BLOCK, columns_of(app), SnapshotProgress(),
                       max_ahead_bytes=CHUNK_BYTES) as reading:
        chunks = reading.chunks()
        received = [next(chunks)]
        terminated = execute(app.dsn, "select pg_terminate_backend(pid) from pg_stat_activity "
                                      "where application_name = 'siphon snapshot' and backend_type = 'client backend'")
        assert terminated == [(True,)]
        with pytest.raises(SnapshotReadError, match="reading the range failed"):
            for chunk in chunks:
                received.append(chunk)
    assert 0 < len(b"".join(received)) < len(whole_table_text(app))
    wait_until(lambda: not snapshot_slots(app), 30, "the snapshot's slot gone")
