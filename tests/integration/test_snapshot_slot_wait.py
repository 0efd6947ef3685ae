"""A snapshot on a source whose replication slots are all taken waits for one to free, saying so,
and gives up with a message naming the remedy when none frees in time."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from siphon_dagster.snapshot.reader import SLOT_RETRY_SECONDS, NoFreeSlotError, exported_snapshot


@pytest.fixture
def every_slot_taken(postgres_dsn: str, unique_name: str) -> Iterator[list[str]]:
    """Physical slots (cheap: no decoding, no wait) until the source has no free one; dropped after."""
    taken: list[str] = []
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        limit = int(connection.execute("show max_replication_slots").fetchone()[0])
        used = connection.execute("select count(*) from pg_replication_slots").fetchone()[0]
        for index in range(limit - used):
            name = f"{unique_name}_filler_{index}"
            connection.execute("select pg_create_physical_replication_slot(%s)", (name,))
            taken.append(name)
        try:
            yield taken
        finally:
            for name in taken:
                connection.execute("select pg_drop_replication_slot(slot_name) from pg_replication_slots "
                                   "where slot_name = %s", (name,))


def _drop_slot(dsn: str, name: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("select pg_drop_replication_slot({})").format(sql.Literal(name)))


def test_a_snapshot_without_a_free_slot_gives_up_naming_the_remedy(postgres_dsn, every_slot_taken):
    heard: list[str] = []

    remedy = r"no free replication slot on the source after 1s: .*raise max_replication_slots or lower the snapshot"
    with pytest.raises(NoFreeSlotError, match=remedy), exported_snapshot(postgres_dsn, wait_seconds=1,
                                                                          on_wait=heard.append):
        pass
    assert heard and all("no free replication slot on the source" in line and line.endswith("waiting")
                         for line in heard)


def test_a_snapshot_takes_the_slot_freed_while_it_waits(postgres_dsn, every_slot_taken):
    heard: list[str] = []
    freeing = threading.Timer(1.0, _drop_slot, (postgres_dsn, every_slot_taken.pop()))
    freeing.start()
    try:
        with exported_snapshot(postgres_dsn, wait_seconds=3 * SLOT_RETRY_SECONDS, on_wait=heard.append) as slot, \
                psycopg.connect(postgres_dsn) as connection:
            connection.execute(sql.SQL("set transaction isolation level repeatable read"))
            connection.execute(sql.SQL("set transaction snapshot {}").format(sql.Literal(slot.snapshot_name)))
    finally:
        freeing.join()
    assert len(heard) >= 1  # it waited at least once before the slot was freed
