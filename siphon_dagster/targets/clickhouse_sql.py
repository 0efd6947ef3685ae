"""ClickHouse's dialect: its spellings of the shared statements (`sql_dialect`) and the statements
only it runs (the snapshot's stage, attaching parts, the version rule's INSERT).

Identifiers always go through `quote`. Values are server-side parameters (`{name:Type}`), never
text spliced into SQL, except a DEFAULT in DDL, which takes no parameters (`backfill_default`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clickhouse_connect.driver.binding import escape_str, format_query_value

from siphon_dagster.targets.base import (
    DELETED_COLUMN,
    SYNCED_AT_COLUMN,
    VERSION_COLUMN,
    SourceColumn,
    TableSchema,
)
from siphon_dagster.targets.clickhouse_digest import ClickHouseCheckStatements
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.sql_dialect import Bindings, Statement
from siphon_dagster.targets.type_mapping import TargetType, clickhouse_type, mapping_for

NOW = "now64(6, 'UTC')"


def quote(identifier: str) -> str:
    """A backquoted identifier for any name.

    clickhouse-connect's `quote_identifier` returns a name unchanged when it already looks quoted
    (e.g. a column literally named `"x"`), which would silently rename it; this always quotes.
    """
    return f"`{escape_str(identifier)}`"


class NamedBindings(Bindings):
    """Server-side parameters `{p<n>:Type}`, sent beside the statement."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}

    def bind(self, value: Any, kind: str) -> str:
        name = f"p{len(self.params)}"
        self.params[name] = value
        return f"{{{name}:{kind}}}"

    def version(self, value: int) -> str:
        return self.bind(value, "UInt128")

    def texts(self, values: Sequence[str]) -> str:
        return self.bind(list(values), "Array(String)")


class ClickHouseDialect(ClickHouseCheckStatements):
    name = "clickhouse"
    keys_per_lookup = 5000
    meta_types = {VERSION_COLUMN: "UInt128", DELETED_COLUMN: "UInt8", SYNCED_AT_COLUMN: "DateTime64(6, 'UTC')"}
    false = "0"
    # Text as PostgreSQL sends it; the version as text too (ClickHouse parses it as UInt128).
    stage_types = ("Nullable(String)", "String", "UInt8")
    # A micro-batch (bounded by batch_max_bytes) is read once, right away: held in memory, it is
    # never compressed into a part on disk only to be read back.
    stage_options = " ENGINE = Memory"

    def __init__(self, table_settings: Mapping[str, int | str] | None = None) -> None:
        # MergeTree settings of the tables created (`targets.clickhouse.table_settings`).
        self.table_settings = dict(table_settings or {})

    def quote(self, identifier: str) -> str:
        return quote(identifier)

    def target_type(self, column: SourceColumn) -> TargetType:
        return mapping_for(column).clickhouse

    def column_type(self, column: SourceColumn) -> str:
        return clickhouse_type(column)

    def type_matches(self, column: SourceColumn, stored: str) -> bool:
        # A column added later, or one that became NOT NULL, stays Nullable (see ClickHouseTarget).
        expected = clickhouse_type(column)
        return stored in (expected, f"Nullable({expected})")

    def bindings(self) -> NamedBindings:
        return NamedBindings()

    def as_text(self, expression: str) -> str:
        return f"toString({expression})"

    def concat(self, parts: Sequence[str]) -> str:
        return parts[0] if len(parts) == 1 else f"concat({', '.join(parts)})"

    def md5_hex(self, expression: str) -> str:
        return f"lower(hex(MD5({expression})))"

    def table_options(self, table: TableSchema) -> str:
        """Every version of every row; merges keep the greatest version per key, tombstones included.

        `_siphon_deleted` as ReplacingMergeTree's is_deleted column makes `FINAL` drop keys whose
        latest version is a tombstone. Tombstones are never cleaned up (that needs an explicit
        `OPTIMIZE ... FINAL CLEANUP`, which Siphon never runs): a removed tombstone would let an
        older change applied later come back.
        """
        settings = ", ".join(f"{name} = {format_query_value(value)}" for name, value in self.table_settings.items())
        return (f" ENGINE = ReplacingMergeTree({quote(VERSION_COLUMN)}, {quote(DELETED_COLUMN)}) "
                f"ORDER BY ({self.key_order(table)})" + (f" SETTINGS {settings}" if settings else ""))

    def log_table_options(self) -> str:
        return " ENGINE = MergeTree ORDER BY tuple()"

    def newest_rows(self, names: TableNames) -> str:
        # FINAL resolves versions at read time, so the view is right before any merge has happened,
        # and drops keys whose latest version is a tombstone. The view's filters must stay in WHERE,
        # which ClickHouse applies after FINAL: a PREWHERE would let an older version show through.
        return f"{names.live} FINAL"

    def stage_reference(self, names: TableNames, name: str) -> str:
        return names.qualified(name)

    def key_filter(self, table: TableSchema, keys: Sequence[tuple[str, ...]], bind: Bindings) -> str:
        """The keys travel as one Array(Array(String)) parameter, converted by ClickHouse."""
        assert isinstance(bind, NamedBindings)
        key_columns = table.key_columns
        converted = ", ".join(mapping_for(c).clickhouse.convert(f"k[{i + 1}]") for i, c in enumerate(key_columns))
        columns = self.key_order(table)
        if len(key_columns) > 1:
            columns = f"({columns})"
        array = bind.bind([list(key) for key in keys], "Array(Array(String))")
        return f"{columns} IN (SELECT {converted} FROM (SELECT arrayJoin({array}) AS k))"

    def tombstone_all(self, target: str, table: TableSchema, version: int) -> Statement:
        """An INSERT of a tombstone for every key whose latest version is older: ClickHouse never
        updates in place, the table's version column decides."""
        bind = self.bindings()
        bound = bind.version(version)
        keys = self.key_order(table)
        meta = ", ".join(quote(name) for name in self.meta_types)
        return bind.statement(
            f"INSERT INTO {target} ({keys}, {meta}) SELECT {keys}, {bound}, 1, {NOW} FROM {target} "
            f"GROUP BY {keys} HAVING max({quote(VERSION_COLUMN)}) < {bound}"
        )

    def swap(self, names: TableNames) -> str:
        # Atomic databases exchange both names in one step: readers see the old or the new table.
        return f"EXCHANGE TABLES {names.live} AND {names.shadow}"

    def swap_by_renames(self, names: TableNames, retired: str) -> list[str]:
        # Ordinary databases cannot exchange; one RENAME statement moves both names.
        return [f"RENAME TABLE {names.live} TO {retired}, {names.shadow} TO {names.live}, {retired} TO {names.shadow}"]


dialect = ClickHouseDialect()


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


def create_snapshot_stage(stage: str, target: str) -> str:
    """A table with exactly the target's structure and engine, so that its parts can be attached
    to the target as they are: the snapshot's rows are converted and written once."""
    return f"CREATE TABLE {stage} AS {target}"


@dataclass(frozen=True)
class SnapshotInput:
    """How a snapshot stage takes a range's COPY text as it is sent."""

    columns: list[str]  # what each field of a line is inserted as, in the source's column order
    alteration: str  # the ALTER TABLE that makes a stage made by `create_snapshot_stage` take them


def snapshot_input(stage: str, table: TableSchema, version: int) -> SnapshotInput:
    """A field whose text ClickHouse's TabSeparated reads as its column's type (integers, text)
    is inserted into that column. Any other is inserted into an EPHEMERAL text column, from which
    the stored column's DEFAULT converts it with the type mapping's `from_text`; Siphon's own
    columns default to the snapshot's version and now (the delete flag, whose
    DEFAULT ReplacingMergeTree does not let change, is 0 as a UInt8 without one).

    EPHEMERAL columns are never stored, so the stage keeps the target's structure and its parts
    can still be attached. The text is parsed once, straight into a MergeTree: no staging table
    and view around it. DDL takes no parameters: the version is spliced in as digits."""
    taken = set(table.column_names)
    columns: list[str] = []
    clauses: list[str] = []
    for i, column in enumerate(table.columns):
        if mapping_for(column).clickhouse.reads_copy_text:
            columns.append(column.name)
            continue
        text = _unused_name(f"_siphon_text_{i}", taken)
        columns.append(text)
        clauses.append(f"ADD COLUMN {quote(text)} Nullable(String) EPHEMERAL")
        clauses.append(f"MODIFY COLUMN {quote(column.name)} DEFAULT {_converted(column, quote(text))}")
    clauses += [f"MODIFY COLUMN {quote(VERSION_COLUMN)} DEFAULT toUInt128('{int(version)}')",
                f"MODIFY COLUMN {quote(SYNCED_AT_COLUMN)} DEFAULT {NOW}"]
    return SnapshotInput(columns, f"ALTER TABLE {stage} {', '.join(clauses)}")


def copy_stage(into: str, stage: str, table: TableSchema) -> str:
    """A second target's stage filled from the first's, by column name: each stage has its own
    target's structure, which for a resync's table and the live one may differ."""
    columns = ", ".join(quote(name) for name in [*table.column_names, *dialect.meta_types])
    return f"INSERT INTO {into} ({columns}) SELECT {columns} FROM {stage}"


def _unused_name(name: str, taken: set[str]) -> str:
    while name in taken:
        name = f"_{name}"
    taken.add(name)
    return name


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


# `<schema>__<table>__landing_<fingerprint>`: where earlier versions inserted stream batches of
# the live table (a Null table and its materialized view); dropped with the table.
LANDING_INFIX = "__landing_"
