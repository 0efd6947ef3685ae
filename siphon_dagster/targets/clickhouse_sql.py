"""ClickHouse statements for one replicated table, built from its schema and the type mapping.

Identifiers always go through `quote`. Values are server-side parameters (`{name:Type}`), never
text spliced into SQL, except a DEFAULT in DDL, which takes no parameters (`backfill_default`).
"""

from __future__ import annotations

from dataclasses import dataclass

from clickhouse_connect.driver.binding import escape_str, format_query_value

from siphon_dagster.targets.base import (
    DELETED_COLUMN,
    META_COLUMNS,
    SYNCED_AT_COLUMN,
    VERSION_COLUMN,
    SourceColumn,
    TableSchema,
    TargetError,
)
from siphon_dagster.targets.names import TargetTableNames
from siphon_dagster.targets.type_mapping import clickhouse_type, mapping_for

META_TYPES = {VERSION_COLUMN: "UInt128", DELETED_COLUMN: "UInt8", SYNCED_AT_COLUMN: "DateTime64(6, 'UTC')"}
NOW = "now64(6, 'UTC')"

# Staging columns: positional names, so awkward source names never reach the staging table.
STAGE_VERSION = "_v"
STAGE_DELETED = "_d"
COUNTED_ROWS = "rows"


def quote(identifier: str) -> str:
    """A backquoted identifier for any name.

    clickhouse-connect's `quote_identifier` returns a name unchanged when it already looks quoted
    (e.g. a column literally named `"x"`), which would silently rename it; this always quotes.
    """
    return f"`{escape_str(identifier)}`"


def stage_column(index: int) -> str:
    return f"c{index}"


@dataclass(frozen=True, kw_only=True)
class TableNames(TargetTableNames):
    database: str

    def qualified(self, name: str) -> str:
        return f"{quote(self.database)}.{quote(name)}"

    @property
    def location(self) -> str:
        return f"clickhouse {self.database}"


def check_columns(table: TableSchema) -> None:
    if not table.key_columns:
        raise TargetError(
            f"{table.schema}.{table.table} has no primary key; the version rule needs one "
            "(add a primary key at the source)"
        )
    clashes = [c.name for c in table.columns if c.name in META_COLUMNS]
    if clashes:
        raise TargetError(f"{table.schema}.{table.table}: column names {clashes} are reserved for Siphon's own columns")


def column_definition(column: SourceColumn) -> str:
    return f"{quote(column.name)} {clickhouse_type(column)}"


def backfill_default(column: SourceColumn, text: str | None) -> str:
    """` DEFAULT <value>` for a column added to a table that holds rows, or nothing for NULL.

    ClickHouse computes a column's DEFAULT for the parts written before the column existed (merges
    then store it), so those rows read the value at once and the ALTER rewrites nothing. Every
    insert names every source column, so rows written later keep their own value, NULL included;
    only TRUNCATE's tombstones (keys only) take the default, and they are never read. DDL takes no
    query parameters: the text is a literal quoted by the driver, converted by the type mapping's
    expression as any staged value is.
    """
    if text is None:
        return ""
    return f" DEFAULT {mapping_for(column).clickhouse.convert(format_query_value(text))}"


def create_table(target: str, table: TableSchema) -> str:
    """Every version of every row; merges keep the greatest version per key, tombstones included.

    `_siphon_deleted` as ReplacingMergeTree's is_deleted column makes `FINAL` drop keys whose latest
    version is a tombstone. Tombstones are never cleaned up (that needs an explicit
    `OPTIMIZE ... FINAL CLEANUP`, which Siphon never runs): a removed tombstone would let an older
    change applied later come back.
    """
    columns = [column_definition(c) for c in table.columns]
    columns += [f"{quote(name)} {kind}" for name, kind in META_TYPES.items()]
    order_by = ", ".join(quote(c.name) for c in table.key_columns)
    return (
        f"CREATE TABLE IF NOT EXISTS {target} ({', '.join(columns)}) "
        f"ENGINE = ReplacingMergeTree({quote(VERSION_COLUMN)}, {quote(DELETED_COLUMN)}) ORDER BY ({order_by})"
    )


def view_columns(table: TableSchema) -> list[str]:
    return [*table.column_names, VERSION_COLUMN, SYNCED_AT_COLUMN]


def create_truncations(names: TableNames) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {names.truncations} ({quote(VERSION_COLUMN)} UInt128) "
        "ENGINE = MergeTree ORDER BY tuple()"
    )


def record_truncation(names: TableNames, version_parameter: str) -> str:
    return f"INSERT INTO {names.truncations} ({quote(VERSION_COLUMN)}) SELECT {{{version_parameter}:UInt128}}"


def create_view(names: TableNames) -> str:
    """Current rows: the latest version of each key, unless a tombstone or older than a TRUNCATE.

    FINAL resolves versions at read time, so the view is right before any merge has happened, and
    drops keys whose latest version is a tombstone. The filters must stay in WHERE, which ClickHouse
    applies after FINAL: a PREWHERE would run before it and let an older version show through.
    """
    selected = ", ".join(quote(name) for name in view_columns(names.table))
    version = quote(VERSION_COLUMN)
    return (
        f"CREATE OR REPLACE VIEW {names.view} AS SELECT {selected} FROM {names.live} FINAL "
        f"WHERE {quote(DELETED_COLUMN)} = 0 AND {version} > (SELECT max({version}) FROM {names.truncations})"
    )


# The external table a change batch is sent as, beside the statement that inserts it.
BATCH_TABLE = "_siphon_batch"


def stage_structure(table: TableSchema) -> str:
    """The columns of a change batch as staged: the values as text, the version as text (ClickHouse
    parses it as UInt128), the delete flag."""
    columns = [f"{quote(stage_column(i))} Nullable(String)" for i in range(len(table.columns))]
    columns += [f"{quote(STAGE_VERSION)} String", f"{quote(STAGE_DELETED)} UInt8"]
    return ", ".join(columns)


def create_text_stage(stage: str, table: TableSchema) -> str:
    """Where a snapshot's COPY text is inserted: a Null table keeps nothing, its materialized views
    convert each block as it is parsed, so the text is read once and never stored."""
    columns = [f"{quote(stage_column(i))} Nullable(String)" for i in range(len(table.columns))]
    return f"CREATE TABLE {stage} ({', '.join(columns)}) ENGINE = Null"


def create_typed_stage(stage: str, target: str) -> str:
    """A table with exactly the target's structure and engine, so that its parts can be attached
    to the target as they are: the snapshot's rows are converted and written once."""
    return f"CREATE TABLE {stage} AS {target}"


def create_counted_rows(counts: str) -> str:
    return f"CREATE TABLE {counts} ({quote(COUNTED_ROWS)} UInt64) ENGINE = MergeTree ORDER BY tuple()"


def count_text_rows(view: str, text_stage: str, counts: str) -> str:
    """Counts the rows that reached the text stage, block by block (a typed stage's merges may
    collapse identical rows of a keyless table, so its own count would not tell)."""
    return f"CREATE MATERIALIZED VIEW {view} TO {counts} AS SELECT count() AS {quote(COUNTED_ROWS)} FROM {text_stage}"


def convert_text_stage(view: str, text_stage: str, text_alias: str, typed_stage: str, table: TableSchema,
                       version_parameter: str) -> str:
    """The snapshot conversion of `insert_from_stage`, as a materialized view from the text stage
    into a typed stage: every row gets the version bound when the view is created.

    The stage's columns are qualified by `text_alias` (a name no source column has) because the
    view's aliases are the source's column names, which may be positional names themselves.
    """
    values = [f"{_converted(c, f'{quote(text_alias)}.{quote(stage_column(i))}')} AS {quote(c.name)}"
              for i, c in enumerate(table.columns)]
    values += [f"{{{version_parameter}:UInt128}} AS {quote(VERSION_COLUMN)}", f"0 AS {quote(DELETED_COLUMN)}",
               f"{NOW} AS {quote(SYNCED_AT_COLUMN)}"]
    return (f"CREATE MATERIALIZED VIEW {view} TO {typed_stage} AS SELECT {', '.join(values)} "
            f"FROM {text_stage} AS {quote(text_alias)}")


def attach_stage(target: str, typed_stage: str) -> str:
    """Moves nothing and rewrites nothing: the stage's parts become the target's in one step
    (hard links), so a snapshot lands whole or not at all. Siphon's tables are unpartitioned."""
    return f"ALTER TABLE {target} ATTACH PARTITION tuple() FROM {typed_stage}"


def _converted(column: SourceColumn, operand: str) -> str:
    expression = mapping_for(column).clickhouse.convert(operand)
    kind = clickhouse_type(column)
    if kind.startswith("Nullable("):
        return expression
    # A tombstone carries only its key; NOT NULL columns then hold the type's default.
    return f"ifNull({expression}, defaultValueOfTypeName('{escape_str(kind)}'))"


def insert_from_stage(target: str, stage: str, table: TableSchema, version_parameter: str | None = None) -> str:
    """Converts staged text into the table's types inside ClickHouse.

    With `version_parameter` every row gets that version and is not deleted (a snapshot);
    otherwise each row carries its own version and delete flag.
    """
    columns = [quote(c.name) for c in table.columns] + [quote(name) for name in META_TYPES]
    values = [_converted(c, quote(stage_column(i))) for i, c in enumerate(table.columns)]
    if version_parameter is None:
        values += [f"toUInt128({quote(STAGE_VERSION)})", quote(STAGE_DELETED)]
    else:
        values += [f"{{{version_parameter}:UInt128}}", "0"]
    values.append(NOW)
    return f"INSERT INTO {target} ({', '.join(columns)}) SELECT {', '.join(values)} FROM {stage}"


def tombstone_keys(target: str, table: TableSchema, version_parameter: str) -> str:
    """TRUNCATE: a tombstone with the truncate's version for every key whose latest version is older.

    Keys already deleted are tombstoned again with the newer version, so a replayed change older
    than the truncate cannot revive them.
    """
    keys = [quote(c.name) for c in table.key_columns]
    meta = [quote(name) for name in META_TYPES]
    return (
        f"INSERT INTO {target} ({', '.join(keys + meta)}) "
        f"SELECT {', '.join(keys)}, {{{version_parameter}:UInt128}}, 1, {NOW} FROM {target} "
        f"GROUP BY {', '.join(keys)} HAVING max({quote(VERSION_COLUMN)}) < {{{version_parameter}:UInt128}}"
    )


def rendered_columns(table: TableSchema, names: list[str]) -> list[str]:
    return [mapping_for(table.column(name)).clickhouse.render(quote(name)) for name in names]


def key_order(table: TableSchema) -> str:
    return ", ".join(quote(c.name) for c in table.key_columns)


def key_filter(table: TableSchema, keys_parameter: str) -> str:
    """`WHERE` on the key for keys given as text in an Array(Array(String)) parameter."""
    keys = table.key_columns
    converted = ", ".join(mapping_for(c).clickhouse.convert(f"k[{i + 1}]") for i, c in enumerate(keys))
    columns = ", ".join(quote(c.name) for c in keys)
    if len(keys) > 1:
        columns = f"({columns})"
    return f"{columns} IN (SELECT {converted} FROM (SELECT arrayJoin({{{keys_parameter}:Array(Array(String))}}) AS k))"
