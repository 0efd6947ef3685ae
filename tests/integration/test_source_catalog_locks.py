"""A snapshot reads the table's columns from the catalog while its own transaction holds the table's
ACCESS SHARE lock. An ALTER TABLE that arrives in between queues behind that lock, and any later
request for the table's lock queues behind the ALTER: a catalog read that asked for it would wait
for the snapshot, which waits for the read. The reads take no lock on the table.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from psycopg import sql

from siphon_dagster import source
from siphon_dagster.targets.base import SourceColumn


@pytest.mark.parametrize("partitioned", [False, True], ids=["table", "partitioned table"])
def test_the_columns_are_read_while_an_alter_table_waits_behind_the_snapshots_lock(
        postgres_dsn: str, unique_name: str, partitioned: bool) -> None:
    table = sql.Identifier(unique_name, "t")
    with psycopg.connect(postgres_dsn, autocommit=True) as setup:
        setup.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        if partitioned:
            setup.execute(sql.SQL("create table {} (id int primary key, note text default 'n') partition by range (id)")
                          .format(table))
            setup.execute(sql.SQL("create table {} partition of {} for values from (0) to (1000)")
                          .format(sql.Identifier(unique_name, "t_low"), table))
        else:
            setup.execute(sql.SQL("create table {} (id int primary key, note text default 'n')").format(table))
        setup.execute(sql.SQL("insert into {} values (1)").format(table))
        setup.execute(sql.SQL("alter table {} add column flag int default 7").format(table))

    snapshot = psycopg.connect(postgres_dsn)
    snapshot.execute(sql.SQL("lock table {} in access share mode").format(table))
    alter = psycopg.connect(postgres_dsn, autocommit=True)
    altering = threading.Thread(target=lambda: alter.execute(sql.SQL("alter table {} add column later int")
                                                             .format(table)), daemon=True)
    altering.start()
    try:
        with psycopg.connect(postgres_dsn, autocommit=True) as watch:
            deadline = time.monotonic() + 10
            while not watch.execute("select exists (select from pg_locks where mode = 'AccessExclusiveLock' "
                                    "and not granted)").fetchone()[0]:
                assert time.monotonic() < deadline, "the ALTER TABLE never queued"
                time.sleep(0.05)

        with source.connect(postgres_dsn, autocommit=True) as catalog:
            catalog.execute("set statement_timeout = '5s'")  # a wait for the table's lock fails here
            columns = [SourceColumn("note", 25, "text"), SourceColumn("flag", 23, "integer")]
            values = source.existing_rows_values(catalog, unique_name, "t", columns)
        assert (values["flag"].known, values["flag"].text) == (True, "7")
        assert not values["note"].known and "DEFAULT 'n'::text" in values["note"].reason
    finally:
        snapshot.close()  # the lock goes; the ALTER TABLE goes through
        altering.join(10)
        alter.close()
