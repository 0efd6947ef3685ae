"""What the Dagster side reads from the source PostgreSQL: table shape, size and position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from siphon_core.config import TableConfig
from siphon_core.session import connection_options
from siphon_dagster.targets.base import SourceColumn, TableSchema

# Value text must not depend on database-level settings: the same pins as the producer's stream.
SESSION_OPTIONS = connection_options()

_COLUMNS_QUERY = """
select a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod), a.atttypmod, not a.attnotnull,
       coalesce(a.attnum = any(pk.indkey), false), t.typcategory::text,
       coalesce(nullif(t.typelem, 0), 0)::int
from pg_attribute a
join pg_class c on c.oid = a.attrelid
join pg_namespace n on n.oid = c.relnamespace
join pg_type t on t.oid = a.atttypid
left join pg_index pk on pk.indrelid = c.oid and pk.indisprimary
where n.nspname = %s and c.relname = %s and a.attnum > 0 and not a.attisdropped
order by a.attnum
"""


class SourceError(RuntimeError):
    """The source does not have what the configuration names; the message says which table."""


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, options=SESSION_OPTIONS, **kwargs)


def table_schema(connection: psycopg.Connection[Any], table: TableConfig) -> TableSchema:
    rows = connection.execute(_COLUMNS_QUERY, (table.schema_name, table.table_name)).fetchall()
    if not rows:
        raise SourceError(f"table {table.name}: not found in the source database (tables[].name in siphon.yaml)")
    unknown = set(table.exclude_columns) - {row[0] for row in rows}
    if unknown:
        raise SourceError(f"table {table.name}: exclude_columns names columns that do not exist: {sorted(unknown)}")
    columns = tuple(
        SourceColumn(name=name, type_oid=oid, type_name=type_name, type_modifier=typmod, nullable=nullable,
                     primary_key=primary_key, category=category, element_type_oid=element)
        for name, oid, type_name, typmod, nullable, primary_key, category, element in rows
        if name not in table.exclude_columns
    )
    if not any(c.primary_key for c in columns):
        # Without a primary key the replica identity (FULL: the whole row) identifies rows.
        columns = tuple(SourceColumn(**{**c.__dict__, "primary_key": True}) for c in columns)
    return TableSchema(table.schema_name, table.table_name, columns)


@dataclass(frozen=True)
class TableSize:
    blocks: int
    block_size: int
    bytes: int
    row_estimate: int


def table_size(connection: psycopg.Connection[Any], table: TableConfig) -> TableSize:
    row = connection.execute(
        """select pg_relation_size(c.oid), current_setting('block_size')::int, greatest(c.reltuples, 0)::bigint
           from pg_class c join pg_namespace n on n.oid = c.relnamespace
           where n.nspname = %s and c.relname = %s""",
        (table.schema_name, table.table_name),
    ).fetchone()
    if row is None:
        raise SourceError(f"table {table.name}: not found in the source database")
    size, block_size, estimate = row
    return TableSize(blocks=(size + block_size - 1) // block_size, block_size=block_size, bytes=size,
                     row_estimate=int(estimate))


def current_lsn(connection: psycopg.Connection[Any]) -> int:
    from siphon_core.naming import parse_lsn

    text = connection.execute(
        "select case when pg_is_in_recovery() then pg_last_wal_replay_lsn() else pg_current_wal_lsn() end::text"
    ).fetchone()[0]
    return parse_lsn(text)
