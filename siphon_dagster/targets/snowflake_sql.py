"""Snowflake statements for one replicated table, built from its schema and the type mapping.

Every identifier goes through `quote`: source names keep their exact spelling (Snowflake folds only
unquoted names to upper case). Values are always bind parameters (qmark style).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
from siphon_dagster.targets.type_mapping import mapping_for, snowflake_type

# A version is (commit LSN << 32 | position): at most 96 bits, i.e. 29 decimal digits. NUMBER(29,0)
# holds every one exactly (fakesnow also turns NUMBER(38,0) into a 64-bit BIGINT, which would not).
VERSION_TYPE = "NUMBER(29,0)"
META_TYPES = {VERSION_COLUMN: VERSION_TYPE, DELETED_COLUMN: "BOOLEAN", SYNCED_AT_COLUMN: "TIMESTAMP_NTZ(6)"}
# SYSDATE() is the current time in UTC as TIMESTAMP_NTZ, whatever the session's time zone.
NOW = "SYSDATE()"

# Staging columns: positional names, so awkward source names never reach the staging table.
STAGE_VERSION = "_v"
STAGE_DELETED = "_d"

_UNQUOTED_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")


def quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def configured_identifier(name: str) -> str:
    """A database or schema name from siphon.yaml as Snowflake stores it.

    Written like an unquoted identifier (SIPHON, public) it is folded to upper case, as Snowflake
    folds unquoted names; anything else is taken literally.
    """
    return name.upper() if _UNQUOTED_IDENTIFIER.match(name) else name


def stage_column(index: int) -> str:
    return f"c{index}"


@dataclass(frozen=True, kw_only=True)
class TableNames(TargetTableNames):
    database: str
    schema: str

    def qualified(self, name: str) -> str:
        return f"{quote(self.database)}.{quote(self.schema)}.{quote(name)}"

    @property
    def location(self) -> str:
        return f"snowflake {self.database}.{self.schema}"


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
    # Only key columns are NOT NULL: a tombstone carries its key and NULL elsewhere.
    not_null = " NOT NULL" if column.primary_key else ""
    return f"{quote(column.name)} {snowflake_type(column)}{not_null}"


def backfill_column_name(column: str) -> str:
    """Where a column added to a table that holds rows is filled before it takes its name."""
    return f"_siphon_backfill_{column}"


def create_table(target: str, table: TableSchema) -> str:
    columns = [column_definition(c) for c in table.columns]
    columns += [f"{quote(name)} {kind} NOT NULL" for name, kind in META_TYPES.items()]
    return f"CREATE TABLE IF NOT EXISTS {target} ({', '.join(columns)})"


def view_columns(table: TableSchema) -> list[str]:
    return [*table.column_names, VERSION_COLUMN, SYNCED_AT_COLUMN]


def create_truncations(names: TableNames) -> str:
    return f"CREATE TABLE IF NOT EXISTS {names.truncations} ({quote(VERSION_COLUMN)} {VERSION_TYPE} NOT NULL)"


def record_truncation(names: TableNames) -> str:
    return f"INSERT INTO {names.truncations} ({quote(VERSION_COLUMN)}) SELECT CAST(? AS {VERSION_TYPE})"


def create_view(names: TableNames) -> str:
    """Current rows: each key's newest row, when it is not a tombstone and is newer than the latest
    TRUNCATE.

    A key is normally stored once (every write is a MERGE), but two MERGEs that insert the same new
    key at once, a stream batch and a snapshot partition say, may both insert it where the engine
    does not serialize them (fakesnow does not); later MERGEs then update every copy. Picking the
    newest copy before filtering tombstones keeps a deleted row deleted either way.
    """
    selected = ", ".join(quote(name) for name in view_columns(names.table))
    version = quote(VERSION_COLUMN)
    newest = (f"SELECT * FROM {names.live} QUALIFY ROW_NUMBER() OVER (PARTITION BY {key_order(names.table)} "
              f"ORDER BY {version} DESC) = 1")
    return (
        f"CREATE OR REPLACE VIEW {names.view} AS SELECT {selected} FROM ({newest}) "
        f"WHERE NOT {quote(DELETED_COLUMN)} AND {version} > (SELECT COALESCE(MAX({version}), 0) FROM {names.truncations})"
    )


def create_stage(stage: str, table: TableSchema) -> str:
    columns = [f"{quote(stage_column(i))} VARCHAR" for i in range(len(table.columns))]
    columns += [f"{quote(STAGE_VERSION)} VARCHAR", f"{quote(STAGE_DELETED)} BOOLEAN"]
    return f"CREATE TEMPORARY TABLE {quote(stage)} ({', '.join(columns)})"


def insert_stage(stage: str, table: TableSchema, rows: int) -> str:
    width = len(table.columns) + 2
    names = [quote(stage_column(i)) for i in range(len(table.columns))] + [quote(STAGE_VERSION), quote(STAGE_DELETED)]
    row = "(" + ", ".join(["?"] * width) + ")"
    return f"INSERT INTO {quote(stage)} ({', '.join(names)}) VALUES " + ", ".join([row] * rows)


def merge(target: str, stage: str, table: TableSchema) -> str:
    """Version-guarded upsert of a staged batch: a row replaces the stored one only if newer.

    Within the batch only the newest version of each key takes part (Snowflake refuses a MERGE in
    which two source rows update one target row). A tombstone is an ordinary newer version with
    `_siphon_deleted` true, so an older change applied later never revives a deleted row.
    """
    converted = [
        f"{mapping_for(c).snowflake.convert(quote(stage_column(i)))} AS {quote(f's{i}')}" for i, c in enumerate(table.columns)
    ]
    version = f"CAST({quote(STAGE_VERSION)} AS {VERSION_TYPE})"
    keys = [(i, c) for i, c in enumerate(table.columns) if c.primary_key]
    partition = ", ".join(mapping_for(c).snowflake.convert(quote(stage_column(i))) for i, c in keys)
    source = (
        f"SELECT {', '.join(converted)}, {version} AS {quote('sv')}, {quote(STAGE_DELETED)} AS {quote('sd')} "
        f"FROM {quote(stage)} QUALIFY ROW_NUMBER() OVER (PARTITION BY {partition} ORDER BY {version} DESC) = 1"
    )
    on = " AND ".join(f"t.{quote(c.name)} = s.{quote(f's{i}')}" for i, c in keys)
    updates = [f"{quote(c.name)} = s.{quote(f's{i}')}" for i, c in enumerate(table.columns) if not c.primary_key]
    updates += [
        f"{quote(VERSION_COLUMN)} = s.{quote('sv')}",
        f"{quote(DELETED_COLUMN)} = s.{quote('sd')}",
        f"{quote(SYNCED_AT_COLUMN)} = {NOW}",
    ]
    insert_columns = [quote(c.name) for c in table.columns] + [quote(name) for name in META_TYPES]
    insert_values = [f"s.{quote(f's{i}')}" for i in range(len(table.columns))]
    insert_values += [f"s.{quote('sv')}", f"s.{quote('sd')}", NOW]
    return (
        f"MERGE INTO {target} AS t USING ({source}) AS s ON {on} "
        f"WHEN MATCHED AND s.{quote('sv')} > t.{quote(VERSION_COLUMN)} THEN UPDATE SET {', '.join(updates)} "
        f"WHEN NOT MATCHED THEN INSERT ({', '.join(insert_columns)}) VALUES ({', '.join(insert_values)})"
    )


def tombstone_all(target: str) -> str:
    """TRUNCATE: every row older than the truncate becomes a tombstone carrying its version.

    Rows already deleted take the newer version too, so a replayed change older than the truncate
    cannot revive them.
    """
    return (
        f"UPDATE {target} SET {quote(DELETED_COLUMN)} = TRUE, "
        f"{quote(VERSION_COLUMN)} = CAST(? AS {VERSION_TYPE}), {quote(SYNCED_AT_COLUMN)} = {NOW} "
        f"WHERE {quote(VERSION_COLUMN)} < CAST(? AS {VERSION_TYPE})"
    )


def rendered_columns(table: TableSchema, names: list[str]) -> list[str]:
    return [mapping_for(table.column(name)).snowflake.render(quote(name)) for name in names]


def key_order(table: TableSchema) -> str:
    return ", ".join(quote(c.name) for c in table.key_columns)


def key_filter(table: TableSchema, count: int) -> str:
    """`WHERE` on the key for `count` keys given as text (converted like any incoming value)."""
    keys = table.key_columns
    converted = "(" + ", ".join(mapping_for(c).snowflake.convert("?") for c in keys) + ")"
    if len(keys) == 1:
        return f"{quote(keys[0].name)} IN ({', '.join([converted] * count)})"
    columns = "(" + ", ".join(quote(c.name) for c in keys) + ")"
    return f"{columns} IN ({', '.join([converted] * count)})"


def normalized_type(data_type: str, precision: int | None, scale: int | None) -> str:
    """information_schema's spelling of a column type, in the spelling this module declares."""
    kind = data_type.upper()
    if kind == "NUMBER" and precision is not None:
        return f"NUMBER({precision},{scale or 0})"
    if kind in ("TEXT", "VARCHAR", "STRING"):
        return "VARCHAR"
    return kind


def declared_type(spelling: str) -> str:
    """A declared type as information_schema will report it, e.g. TIMESTAMP_NTZ(6) -> TIMESTAMP_NTZ."""
    kind = spelling.upper().replace(" ", "")
    return kind if kind.startswith("NUMBER(") else kind.split("(")[0]
