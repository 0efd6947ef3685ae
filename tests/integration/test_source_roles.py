"""The least-privilege PostgreSQL roles of the README ("PostgreSQL roles") on a real server: the
producer's role sets up and streams, the Dagster side's role sizes, describes and snapshots, and
neither needs more than the statements there grant."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from producer_service import ownership
from producer_service.publication import (
    SourceSetupError,
    check_replica_identities,
    ensure_publication,
    ensure_slot,
)
from siphon_core.config import TableConfig
from siphon_core.replication import ReplicationConnection
from siphon_dagster.partitions import BlockRange
from siphon_dagster.snapshot.reader import SnapshotProgress, exported_snapshot, read_range
from siphon_dagster.source import current_lsn, existing_rows_values, table_schema, table_size
from tests.helpers.producer import execute


@pytest.fixture
def roles(postgres_dsn: str, unique_name: str) -> Iterator[dict[str, str]]:
    """The README's two roles on a schema of this test's own, with two replicated tables."""
    schema = sql.Identifier(unique_name)
    names = {"producer": f"{unique_name}_producer", "reader": f"{unique_name}_reader"}
    database = execute(postgres_dsn, "select current_database()")[0][0]
    execute(postgres_dsn, sql.SQL("create schema {}").format(schema))
    for table in ("notes", "issues"):
        execute(postgres_dsn, sql.SQL("create table {} (id bigint primary key, body text)").format(
            sql.Identifier(unique_name, table)))
        execute(postgres_dsn, sql.SQL("insert into {} select g, 'row ' || g from generate_series(1, 500) g").format(
            sql.Identifier(unique_name, table)))
    # A column added later with a default: its older rows' value lives in the catalog (attmissingval).
    execute(postgres_dsn, sql.SQL("alter table {} add column rank int default 7").format(
        sql.Identifier(unique_name, "notes")))
    tables = sql.SQL(", ").join(sql.Identifier(unique_name, t) for t in ("notes", "issues"))
    for role in names.values():
        ident = sql.Identifier(role)
        execute(postgres_dsn, sql.SQL("create role {} login replication").format(ident))
        execute(postgres_dsn, sql.SQL("grant connect on database {} to {}").format(sql.Identifier(database), ident))
        execute(postgres_dsn, sql.SQL("grant usage on schema {} to {}").format(schema, ident))
        execute(postgres_dsn, sql.SQL("grant select on {} to {}").format(tables, ident))
    try:
        yield {kind: make_conninfo(postgres_dsn, user=role) for kind, role in names.items()}
    finally:
        for slot, in execute(postgres_dsn, "select slot_name from pg_replication_slots where slot_name like %s",
                             (f"{unique_name}%",)):
            execute(postgres_dsn, "select pg_drop_replication_slot(%s)", (slot,))
        execute(postgres_dsn, sql.SQL("drop schema {} cascade").format(schema))
        for role in names.values():
            execute(postgres_dsn, sql.SQL("drop owned by {}").format(sql.Identifier(role)))
            execute(postgres_dsn, sql.SQL("drop role {}").format(sql.Identifier(role)))


def test_the_producer_role_needs_the_owner_for_its_publication_and_nothing_more(
        postgres_dsn: str, roles: dict[str, str], unique_name: str) -> None:
    tables = [TableConfig(name=f"{unique_name}.notes"), TableConfig(name=f"{unique_name}.issues")]
    publication, slot = f"{unique_name}_publication", f"{unique_name}_slot"
    # Not the tables' owner: it may not create the publication, and says what the owner must run.
    with psycopg.connect(roles["producer"], autocommit=True) as control, \
            pytest.raises(SourceSetupError, match="as the tables' owner run: CREATE PUBLICATION"):
        ensure_publication(control, publication, tables)
    execute(postgres_dsn, sql.SQL("create publication {} for table {}, {} with (publish_via_partition_root = true)")
            .format(sql.Identifier(publication), sql.Identifier(unique_name, "notes"),
                    sql.Identifier(unique_name, "issues")))
    with psycopg.connect(roles["producer"], autocommit=True) as control:
        assert ownership.try_acquire(control, unique_name) is None
        check_replica_identities(control, tables)
        change = ensure_publication(control, publication, tables)
        assert not change.created and not change.added and not change.dropped
        assert ensure_slot(control, slot) is True
        control.execute("select pg_logical_emit_message(false, %s, now()::text)", ("siphon-heartbeat",))
    replication = ReplicationConnection(roles["producer"], application_name="role test")
    try:
        replication.start(slot, [publication], start_lsn=0, messages=True)
    finally:
        replication.close()


def test_the_dagster_role_sizes_describes_and_snapshots_a_table(roles: dict[str, str], unique_name: str) -> None:
    table = TableConfig(name=f"{unique_name}.notes")
    with psycopg.connect(roles["reader"], autocommit=True) as connection:
        size = table_size(connection, table)
        assert size.blocks >= 1 and size.row_estimate >= 0
        schema = table_schema(connection, table)
        assert [c.name for c in schema.columns] == ["id", "body", "rank"]
        added = [c for c in schema.columns if c.name == "rank"]
        assert {name: value.text for name, value in
                existing_rows_values(connection, unique_name, "notes", added).items()} == {"rank": "7"}
        assert current_lsn(connection) > 0
    with exported_snapshot(roles["reader"], wait_seconds=5) as slot:
        assert slot.name.startswith("siphon_snap_")
        text = b"".join(read_range(roles["reader"], slot.snapshot_name, schema,
                                   BlockRange(0, size.blocks - 1), SnapshotProgress()))
    assert text.count(b"\n") == 500
