"""The publication and the logical replication slot of an application, kept matching the configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from siphon_core.config import TableConfig
from siphon_core.naming import parse_lsn


class SourceSetupError(RuntimeError):
    """The source database is not ready for replication; the message says what to run."""


@dataclass
class PublicationChange:
    added: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    created: bool = False


_IDENTITY_QUERY = """
select c.relreplident,
       exists (select 1 from pg_index i where i.indrelid = c.oid and i.indisprimary),
       exists (select 1 from pg_index i where i.indrelid = c.oid and i.indisreplident)
from pg_class c join pg_namespace n on n.oid = c.relnamespace
where n.nspname = %s and c.relname = %s and c.relkind in ('r', 'p')
"""


def check_replica_identities(connection: psycopg.Connection[Any], tables: list[TableConfig]) -> None:
    """Every table must exist, have a primary key and identify its rows in UPDATE and DELETE changes."""
    problems = replica_identity_problems(connection, tables)
    if problems:
        raise SourceSetupError("\n".join(problems.values()))


def replica_identity_problems(connection: psycopg.Connection[Any], tables: list[TableConfig]) -> dict[str, str]:
    """Table name -> why it cannot be replicated (`check_replica_identities`), for the tables that cannot."""
    problems: dict[str, str] = {}
    for table in tables:
        row = connection.execute(_IDENTITY_QUERY, (table.schema_name, table.table_name)).fetchone()
        name = sql.Identifier(table.schema_name, table.table_name).as_string(connection)
        if row is None:
            problems[table.name] = f"table {table.name}: does not exist (or is not a table) in the source database"
            continue
        identity, has_primary_key, has_identity_index = row
        if not has_primary_key:
            # REPLICA IDENTITY FULL would let PostgreSQL send such a table's changes, but a target keeps
            # one row per key: identical rows would collapse and a NULL cannot be part of a key.
            problems[table.name] = (
                f"table {table.name}: has no primary key; Siphon keeps one row per primary key at its targets, "
                f"so a table without one cannot be replicated: add one (ALTER TABLE {name} ADD PRIMARY KEY (...))"
            )
        elif identity == "n" or (identity == "i" and not has_identity_index):
            problems[table.name] = (
                f"table {table.name}: has no usable replica identity, so its updates and deletes cannot be "
                f"replicated; run `ALTER TABLE {name} REPLICA IDENTITY DEFAULT` (the primary key)"
            )
    return problems


def published_tables(connection: psycopg.Connection[Any], publication: str) -> set[str] | None:
    exists = connection.execute("select 1 from pg_publication where pubname = %s", (publication,)).fetchone()
    if not exists:
        return None
    # With publish_via_partition_root a partitioned table is listed as itself, not as its leaves.
    rows = connection.execute(
        "select schemaname, tablename from pg_publication_tables where pubname = %s", (publication,)
    ).fetchall()
    return {f"{schema}.{table}" for schema, table in rows}


def ensure_publication(connection: psycopg.Connection[Any], publication: str,
                       tables: list[TableConfig]) -> PublicationChange:
    """Creates the publication or adds and drops tables so it publishes exactly `tables`.

    A partitioned table's changes are published as the table's own (publish_via_partition_root),
    whichever partition they were made in: one subject and one target table for the whole table,
    and rows moving between partitions stay one row.
    """
    wanted = {t.name: t for t in tables}
    current = published_tables(connection, publication)
    change = PublicationChange()
    table_ids = {name: sql.Identifier(t.schema_name, t.table_name) for name, t in wanted.items()}
    try:
        if current is None:
            connection.execute(sql.SQL("create publication {} for table {} with (publish_via_partition_root = true)")
                               .format(sql.Identifier(publication), sql.SQL(", ").join(table_ids.values())))
            change.created = True
            change.added = sorted(wanted)
            return change
        if _partitioned(connection, tables) and not connection.execute(
                "select pubviaroot from pg_publication where pubname = %s", (publication,)).fetchone()[0]:
            connection.execute(sql.SQL("alter publication {} set (publish_via_partition_root = true)").format(
                sql.Identifier(publication)))
            current = published_tables(connection, publication) or set()
        for name in sorted(set(wanted) - current):
            connection.execute(sql.SQL("alter publication {} add table {}").format(
                sql.Identifier(publication), table_ids[name]))
            change.added.append(name)
        for name in sorted(current - set(wanted)):
            schema, _, table = name.partition(".")
            connection.execute(sql.SQL("alter publication {} drop table {}").format(
                sql.Identifier(publication), sql.Identifier(schema, table)))
            change.dropped.append(name)
    except psycopg.errors.InsufficientPrivilege as error:
        listed = ", ".join(t.as_string(connection) for t in table_ids.values())
        raise SourceSetupError(
            f"publication {publication!r} does not match the configured tables and this role may not change it "
            f"({error.diag.message_primary}); as the tables' owner run: "
            f"CREATE PUBLICATION {sql.Identifier(publication).as_string(connection)} FOR TABLE {listed} "
            "WITH (publish_via_partition_root = true) (or ALTER PUBLICATION ... SET TABLE ...)"
        ) from None
    return change


def _partitioned(connection: psycopg.Connection[Any], tables: list[TableConfig]) -> bool:
    """Whether any of the tables is partitioned (the only case publish_via_partition_root changes)."""
    return connection.execute(
        "select exists (select 1 from pg_class c join pg_namespace n on n.oid = c.relnamespace "
        "where c.relkind = 'p' and (n.nspname, c.relname) in (select * from unnest(%s::text[], %s::text[])))",
        ([t.schema_name for t in tables], [t.table_name for t in tables])).fetchone()[0]


def ensure_slot(connection: psycopg.Connection[Any], slot: str) -> bool:
    """Creates the pgoutput slot if missing; returns True when it was created."""
    row = connection.execute(
        "select plugin, database from pg_replication_slots where slot_name = %s", (slot,)).fetchone()
    if row is not None:
        check_slot_kind(connection, slot, *row)
        return False
    create_slot(connection, slot)
    return True


def check_slot_kind(connection: psycopg.Connection[Any], slot: str, plugin: str | None, database: str | None) -> None:
    """A slot of that name that is not the producer's kind is someone else's: never touch it."""
    current_db = connection.execute("select current_database()").fetchone()[0]
    if plugin != "pgoutput" or database != current_db:
        raise SourceSetupError(f"replication slot {slot!r} exists but uses plugin {plugin!r} on database "
                               f"{database!r}; drop it or configure producer.slot_name")


def create_slot(connection: psycopg.Connection[Any], slot: str) -> int:
    """Creates the pgoutput slot; returns its consistent point (every later commit is streamed)."""
    try:
        lsn = connection.execute("select lsn::text from pg_create_logical_replication_slot(%s, 'pgoutput')",
                                 (slot,)).fetchone()[0]
    except psycopg.errors.ObjectNotInPrerequisiteState as error:
        raise SourceSetupError(f"cannot create replication slot {slot!r}: {error.diag.message_primary}; "
                               "the server needs wal_level = logical") from None
    except psycopg.errors.ConfigurationLimitExceeded as error:
        raise SourceSetupError(f"cannot create replication slot {slot!r}: {error.diag.message_primary}; "
                               "raise max_replication_slots or drop unused slots") from None
    except psycopg.errors.InsufficientPrivilege as error:
        role = connection.execute("select current_user").fetchone()[0]
        raise SourceSetupError(
            f"cannot create replication slot {slot!r}: {error.diag.message_primary}; the producer's role needs "
            f"the REPLICATION attribute: ALTER ROLE {sql.Identifier(role).as_string(connection)} REPLICATION"
        ) from None
    return parse_lsn(lsn)
