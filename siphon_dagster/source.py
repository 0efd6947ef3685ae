"""What the Dagster side reads from the source PostgreSQL: table shape, size and position."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from siphon_core import naming
from siphon_core.config import TableConfig
from siphon_core.session import connection_options
from siphon_dagster.targets.base import SourceColumn, TableSchema

_Found = TypeVar("_Found")

# Value text must not depend on database-level settings: the same pins as the producer's stream.
SESSION_OPTIONS = connection_options()

# Every named table's columns in one query (and their sizes in one, `_SIZE_QUERY`): the partitions
# sensor reads hundreds of tables each minute, and two queries a table cost the source 95 ms of CPU
# and the tick 200 ms at 200 tables, against 26 ms and 50 ms at once.
_COLUMNS_QUERY = """
with wanted(schema_name, table_name) as (select * from unnest(%s::text[], %s::text[]))
select w.schema_name, w.table_name,
       a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod), a.atttypmod, not a.attnotnull,
       coalesce(a.attnum = any(pk.indkey), false), t.typcategory::text,
       coalesce(nullif(t.typelem, 0), 0)::int, a.attgenerated <> ''
from wanted w
join pg_namespace n on n.nspname = w.schema_name
join pg_class c on c.relnamespace = n.oid and c.relname = w.table_name
join pg_attribute a on a.attrelid = c.oid
join pg_type t on t.oid = a.atttypid
left join pg_index pk on pk.indrelid = c.oid and pk.indisprimary
where a.attnum > 0 and not a.attisdropped
order by w.schema_name, w.table_name, a.attnum
"""


# What PostgreSQL gave the rows that existed when a column was added. A non-volatile DEFAULT is
# kept once in the catalog (attmissingval, a one-element array of the column's type) instead of
# being written into every row, so no change reaches the stream; a volatile DEFAULT, an identity
# or a generated column rewrites the table, also without any change in the stream.
# A partitioned table stores no rows: its leaves keep the missing value, the same in each that
# existed when the column was added.
# Reads the catalog only, taking no lock on the table: a snapshot runs it while its own transaction
# holds the table's ACCESS SHARE lock, and an ALTER TABLE queued behind that lock would make any
# request for the table's lock wait for ever (pg_get_expr given the table's oid opens the table, as
# pg_partition_tree does; a default refers to no column, so 0 deparses it, and pg_inherits lists
# a partitioned table's partitions).
_ADDED_COLUMNS_QUERY = """
select a.attname, a.atttypid::int, coalesce(leaf.atthasmissing, a.atthasmissing),
       coalesce(leaf.attmissingval::text, a.attmissingval::text), a.attgenerated::text,
       a.attidentity::text, case when a.attgenerated = '' then pg_get_expr(d.adbin, 0) end,
       case when t.typtype = 'd' then t.typdefault end
from pg_attribute a
join pg_class c on c.oid = a.attrelid
join pg_namespace n on n.oid = c.relnamespace
join pg_type t on t.oid = a.atttypid
left join pg_attrdef d on d.adrelid = a.attrelid and d.adnum = a.attnum
left join lateral (
    with recursive tree(relid) as (
        select c.oid where c.relkind = 'p'
        union all
        select i.inhrelid from pg_inherits i join tree on i.inhparent = tree.relid
    )
    select la.atthasmissing, la.attmissingval
    from tree
    join pg_class lc on lc.oid = tree.relid and lc.relkind = 'r'
    join pg_attribute la on la.attrelid = tree.relid and la.attname = a.attname and not la.attisdropped
    where la.atthasmissing
    limit 1
) leaf on true
where n.nspname = %s and c.relname = %s and a.attnum > 0 and not a.attisdropped and a.attname = any(%s)
"""


class SourceError(RuntimeError):
    """The source does not have what the configuration names; the message says which table."""


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, options=SESSION_OPTIONS, **kwargs)


def table_schema(connection: psycopg.Connection[Any], table: TableConfig) -> TableSchema:
    return _raised(table_schemas(connection, [table])[table.name])


def table_schemas(connection: psycopg.Connection[Any],
                  tables: Sequence[TableConfig]) -> dict[str, TableSchema | SourceError]:
    """Each table's columns (by its configured name) in one query, or the error that says why the
    table cannot be replicated; one table's error holds back no other."""
    rows = connection.execute(_COLUMNS_QUERY, ([t.schema_name for t in tables], [t.table_name for t in tables]))
    by_table: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
    for row in rows.fetchall():
        by_table.setdefault((row[0], row[1]), []).append(row[2:])
    result: dict[str, TableSchema | SourceError] = {}
    for table in tables:
        try:
            result[table.name] = _schema_of(table, by_table.get((table.schema_name, table.table_name), []))
        except SourceError as error:
            result[table.name] = error
    return result


def _schema_of(table: TableConfig, rows: Sequence[tuple[Any, ...]]) -> TableSchema:
    if not rows:
        raise SourceError(f"table {table.name}: not found in the source database (tables[].name in siphon.yaml)")
    unknown = set(table.exclude_columns) - {row[0] for row in rows}
    if unknown:
        raise SourceError(f"table {table.name}: exclude_columns names columns that do not exist: {sorted(unknown)}")
    generated_keys = [row[0] for row in rows if row[8] and row[5]]
    if generated_keys:
        raise SourceError(f"table {table.name}: primary key column(s) {generated_keys} are generated columns, which "
                          "PostgreSQL does not publish in its change stream")
    # Generated columns are left out everywhere: PostgreSQL's change stream never carries them (its
    # publications leave them out), so a snapshot that copied them would leave streamed rows without
    # a value, and every batch would see a column vanish. A target can compute them again from the
    # columns they are generated from.
    columns = tuple(
        SourceColumn(name=name, type_oid=oid, type_name=type_name, type_modifier=typmod, nullable=nullable,
                     primary_key=primary_key, category=category, element_type_oid=element)
        for name, oid, type_name, typmod, nullable, primary_key, category, element, generated in rows
        if name not in table.exclude_columns and not generated
    )
    if not any(c.primary_key for c in columns):
        raise SourceError(f"table {table.name}: has no primary key; Siphon keeps one row per primary key at its "
                          "targets, so a table without one cannot be replicated: add one")
    return TableSchema(table.schema_name, table.table_name, columns)


@dataclass(frozen=True)
class ExistingRowsValue:
    """The value a column holds in the rows that existed when it was added, as far as the catalog tells."""

    column: str
    known: bool
    text: str | None = None  # PostgreSQL's text output of the value (None: NULL), when known
    reason: str = ""  # when not known: what PostgreSQL did that the stream does not show

    @staticmethod
    def null(column: str) -> ExistingRowsValue:
        return ExistingRowsValue(column, known=True)

    def unfilled_warning(self, schema: str, table: str, target: str) -> str:
        """What an operator reads when the column was added at `target` without these rows' values."""
        return (f"table {schema}.{table}: column {self.column!r} was added at the source, and what the rows that "
                f"existed before it hold in it is not in the stream: {self.reason}. At target {target} those rows "
                f"read NULL in {self.column!r} until they are read again: "
                f"{naming.resnapshot_advice(target, schema, table)}.")


def backfill(values: Mapping[str, ExistingRowsValue]) -> dict[str, str]:
    """The known values that are not NULL, as `Target.ensure_table` takes them."""
    return {name: value.text for name, value in values.items() if value.known and value.text is not None}


def existing_rows_values(connection: psycopg.Connection[Any], schema: str, table: str,
                         columns: Sequence[SourceColumn]) -> dict[str, ExistingRowsValue]:
    """For columns added to a table, the value its older rows hold, which no change event carried.

    Known when the catalog keeps it (`attmissingval`, rendered by the type's output function under
    the connection's pinned settings, as the stream and COPY render values) or when the column has no
    default at all (NULL). Unknown when PostgreSQL rewrote the table to fill it (volatile DEFAULT,
    identity, generated column), or when a rewrite since (VACUUM FULL, CLUSTER, a type change)
    dropped the catalog's copy: then only a resync brings those rows' values.
    """
    wanted = {c.name: c for c in columns}
    rows = connection.execute(_ADDED_COLUMNS_QUERY, (schema, table, list(wanted))).fetchall()
    found = {row[0]: row for row in rows}
    values = {}
    for name, column in wanted.items():
        row = found.get(name)
        if row is None:
            values[name] = ExistingRowsValue(name, False, reason="it is no longer in the source table")
            continue
        _, type_oid, has_missing, missing, generated, identity, default, domain_default = row
        if type_oid != column.type_oid:
            values[name] = ExistingRowsValue(name, False, reason=f"its type changed since to oid {type_oid}")
        elif has_missing:
            values[name] = ExistingRowsValue(name, True, single_element_text(missing))
        elif generated:
            values[name] = ExistingRowsValue(name, False, reason="it is generated (GENERATED ALWAYS AS ... STORED): "
                                                                 "PostgreSQL computed it for every row")
        elif identity:
            values[name] = ExistingRowsValue(name, False, reason="it is an identity column: PostgreSQL numbered "
                                                                 "every row")
        elif default is not None or domain_default is not None:
            values[name] = ExistingRowsValue(name, False, reason=(
                f"it has DEFAULT {default if default is not None else domain_default} and the catalog keeps no "
                "value for older rows: a volatile default was written into every row (or a table rewrite "
                "since dropped the catalog's copy)"))
        else:
            values[name] = ExistingRowsValue.null(name)
    return values


def single_element_text(array_text: str) -> str:
    """The element of a one-element array in PostgreSQL's text form, e.g. `{7}`, `{"a \\"b\\""}`.

    array_out quotes an element holding whitespace, quotes, backslashes, braces or the delimiter
    (and an empty or NULL-spelled one) and escapes `"` and `\\` inside; unquoted, it is verbatim.
    """
    text = array_text.split("=", 1)[1] if array_text.startswith("[") else array_text  # [lo:hi]= bounds
    inner = text[1:-1]
    if not inner.startswith('"'):
        return inner
    out, escaped = [], False
    for char in inner[1:-1]:
        if escaped or char != "\\":
            out.append(char)
            escaped = False
        else:
            escaped = True
    return "".join(out)


@dataclass(frozen=True)
class TableSize:
    blocks: int
    block_size: int
    bytes: int
    row_estimate: int


# A partitioned table has no storage of its own: its partitions (leaves) do, each with its own
# block numbers. A block range read from the partitioned table reads those blocks of every leaf
# (the ctid condition applies to each), so its blocks are those of its largest leaf.
_SIZE_QUERY = """
with wanted(schema_name, table_name) as (select * from unnest(%s::text[], %s::text[])),
named as (
    select w.schema_name, w.table_name, c.oid, c.relkind from wanted w
    join pg_namespace n on n.nspname = w.schema_name
    join pg_class c on c.relnamespace = n.oid and c.relname = w.table_name
), stored as (
    select schema_name, table_name, oid as relid from named where relkind <> 'p'
    union all
    select named.schema_name, named.table_name, tree.relid
    from named, pg_partition_tree(named.oid) tree where named.relkind = 'p' and tree.isleaf
)
select named.schema_name, named.table_name,
       coalesce(max(pg_relation_size(s.relid)), 0), coalesce(sum(pg_relation_size(s.relid)), 0)::bigint,
       current_setting('block_size')::int, coalesce(sum(greatest(l.reltuples, 0)), 0)::bigint
from named
left join stored s on s.schema_name = named.schema_name and s.table_name = named.table_name
left join pg_class l on l.oid = s.relid
group by named.schema_name, named.table_name
"""


def table_size(connection: psycopg.Connection[Any], table: TableConfig) -> TableSize:
    return _raised(table_sizes(connection, [table])[table.name])


def table_sizes(connection: psycopg.Connection[Any],
                tables: Sequence[TableConfig]) -> dict[str, TableSize | SourceError]:
    """Each table's size (by its configured name) in one query, or the error of a table not found."""
    rows = connection.execute(_SIZE_QUERY, ([t.schema_name for t in tables], [t.table_name for t in tables]))
    sizes = {(schema, name): rest for schema, name, *rest in rows.fetchall()}
    result: dict[str, TableSize | SourceError] = {}
    for table in tables:
        size = sizes.get((table.schema_name, table.table_name))
        if size is None:
            result[table.name] = SourceError(f"table {table.name}: not found in the source database")
            continue
        largest, total, block_size, estimate = size
        result[table.name] = TableSize(blocks=(largest + block_size - 1) // block_size, block_size=block_size,
                                       bytes=total, row_estimate=int(estimate))
    return result


def _raised(found: _Found | SourceError) -> _Found:
    """What one table's read found, or its error raised."""
    if isinstance(found, SourceError):
        raise found
    return found


def current_lsn(connection: psycopg.Connection[Any]) -> int:
    text = connection.execute(
        "select case when pg_is_in_recovery() then pg_last_wal_replay_lsn() else pg_current_wal_lsn() end::text"
    ).fetchone()[0]
    return naming.parse_lsn(text)
