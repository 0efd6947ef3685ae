"""Snowflake's dialect: its spellings of the shared statements (`sql_dialect`) and the statements
only it runs (the version-guarded MERGE, multi-row INSERT into a staging table).

Every identifier goes through `quote`: source names keep their exact spelling (Snowflake folds only
unquoted names to upper case). Values are always bind parameters (qmark style).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from siphon_dagster.targets.base import (
    DELETED_COLUMN,
    SYNCED_AT_COLUMN,
    VERSION_COLUMN,
    SourceColumn,
    TableSchema,
)
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.snowflake_digest import SnowflakeCheckStatements
from siphon_dagster.targets.sql_dialect import (
    STAGE_DELETED,
    STAGE_VERSION,
    Bindings,
    Statement,
    stage_column,
    staging_names,
)
from siphon_dagster.targets.type_mapping import TargetType, mapping_for, snowflake_type

# A version is (commit LSN << 32 | position): at most 96 bits, i.e. 29 decimal digits. NUMBER(29,0)
# holds every one exactly (fakesnow also turns NUMBER(38,0) into a 64-bit BIGINT, which would not).
VERSION_TYPE = "NUMBER(29,0)"
# SYSDATE() is the current time in UTC as TIMESTAMP_NTZ, whatever the session's time zone.
NOW = "SYSDATE()"

_UNQUOTED_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")


def quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def configured_identifier(name: str) -> str:
    """A database or schema name from siphon.yaml as Snowflake stores it.

    Written like an unquoted identifier (SIPHON, public) it is folded to upper case, as Snowflake
    folds unquoted names; anything else is taken literally.
    """
    return name.upper() if _UNQUOTED_IDENTIFIER.match(name) else name


class PositionalBindings(Bindings):
    """qmark parameters, in the order the statement's text names them. A version travels as text
    and is cast: a 96-bit integer is not a bind type every client agrees on."""

    def __init__(self) -> None:
        self.params: list[object] = []

    def bind(self, value: object) -> str:
        self.params.append(value)
        return "?"

    def version(self, value: int) -> str:
        return f"CAST({self.bind(str(value))} AS {VERSION_TYPE})"

    def texts(self, values: Sequence[str]) -> str:
        return "(" + ", ".join(self.bind(value) for value in values) + ")"


class SnowflakeDialect(SnowflakeCheckStatements):
    name = "snowflake"
    keys_per_lookup = 500
    meta_types = {VERSION_COLUMN: VERSION_TYPE, DELETED_COLUMN: "BOOLEAN", SYNCED_AT_COLUMN: "TIMESTAMP_NTZ(6)"}
    meta_constraint = " NOT NULL"
    stage_kind = "TEMPORARY TABLE"  # ends with the session: a crashed process leaves none behind
    stage_types = ("VARCHAR", "VARCHAR", "BOOLEAN")

    def quote(self, identifier: str) -> str:
        return quote(identifier)

    def target_type(self, column: SourceColumn) -> TargetType:
        return mapping_for(column).snowflake

    def column_definition(self, column: SourceColumn) -> str:
        # Only key columns are NOT NULL: a tombstone carries its key and NULL elsewhere.
        return super().column_definition(column) + (" NOT NULL" if column.primary_key else "")

    def described_type(self, column: SourceColumn) -> str:
        return declared_type(snowflake_type(column))

    def bindings(self) -> PositionalBindings:
        return PositionalBindings()

    def as_text(self, expression: str) -> str:
        return f"CAST({expression} AS VARCHAR)"

    def concat(self, parts: Sequence[str]) -> str:
        return " || ".join(parts)

    def md5_hex(self, expression: str) -> str:
        return f"MD5({expression})"

    def newest_rows(self, names: TableNames) -> str:
        """Each key's newest stored row, tombstones included.

        A key is normally stored once (every write is a MERGE), but two MERGEs that insert the same
        new key at once, a stream batch and a snapshot partition say, may both insert it where the
        engine does not serialize them (fakesnow does not); later MERGEs then update every copy.
        Picking the newest copy before filtering tombstones keeps a deleted row deleted either way.
        """
        return (f"(SELECT * FROM {names.live} QUALIFY ROW_NUMBER() OVER (PARTITION BY {self.key_order(names.table)} "
                f"ORDER BY {quote(VERSION_COLUMN)} DESC) = 1)")

    def stage_reference(self, names: TableNames, name: str) -> str:
        # Temporary tables live in the connection's current schema (the target's, see SnowflakeTarget).
        return quote(name)

    def key_filter(self, table: TableSchema, keys: Sequence[tuple[str, ...]], bind: Bindings) -> str:
        """Each key as a tuple of bound texts, converted like any incoming value."""
        assert isinstance(bind, PositionalBindings)
        key_columns = table.key_columns
        tuples = ", ".join(
            "(" + ", ".join(mapping_for(c).snowflake.convert(bind.bind(value)) for c, value in zip(key_columns, key,
                                                                                                   strict=True)) + ")"
            for key in keys
        )
        columns = self.key_order(table)
        if len(key_columns) > 1:
            columns = f"({columns})"
        return f"{columns} IN ({tuples})"

    def tombstone_all(self, target: str, table: TableSchema, version: int) -> Statement:
        """An UPDATE: every row older than the truncate becomes a tombstone carrying its version."""
        bind = self.bindings()
        return bind.statement(
            f"UPDATE {target} SET {quote(DELETED_COLUMN)} = TRUE, "
            f"{quote(VERSION_COLUMN)} = {bind.version(version)}, {quote(SYNCED_AT_COLUMN)} = {NOW} "
            f"WHERE {quote(VERSION_COLUMN)} < {bind.version(version)}"
        )

    def swap(self, names: TableNames) -> str:
        # One atomic step on Snowflake: readers of the view see the old or the new table.
        return f"ALTER TABLE {names.live} SWAP WITH {names.shadow}"

    def swap_by_renames(self, names: TableNames, retired: str) -> list[str]:
        # Snowflake-compatible engines without SWAP WITH (fakesnow): three renames.
        return [f"ALTER TABLE {names.live} RENAME TO {retired}", f"ALTER TABLE {names.shadow} RENAME TO {names.live}",
                f"ALTER TABLE {retired} RENAME TO {names.shadow}"]


dialect = SnowflakeDialect()


def backfill_column_name(column: str) -> str:
    """Where a column added to a table that holds rows is filled before it takes its name."""
    return f"_siphon_backfill_{column}"


def _staged_values(table: TableSchema, rows: int) -> tuple[str, str]:
    """The staging columns' names, and `rows` rows of bind parameters for them."""
    names = ", ".join(quote(name) for name in staging_names(table))
    row = "(" + ", ".join(["?"] * (len(table.columns) + 2)) + ")"
    return names, ", ".join([row] * rows)


def insert_stage(stage: str, table: TableSchema, rows: int) -> str:
    names, values = _staged_values(table, rows)
    return f"INSERT INTO {stage} ({names}) VALUES {values}"


def values_source(table: TableSchema, rows: int, alias: str = "v") -> str:
    """`rows` rows of bind parameters named as a staging table's columns, to MERGE from directly."""
    names, values = _staged_values(table, rows)
    return f"(VALUES {values}) AS {quote(alias)} ({names})"


def merge(target: str, stage: str, table: TableSchema) -> str:
    """Version-guarded upsert of a staged batch: a row replaces the stored one only if newer.

    `stage` is a staging table, or `values_source`'s rows. Within the batch only the newest version
    of each key takes part (Snowflake refuses a MERGE in which two source rows update one target
    row). A tombstone is an ordinary newer version with `_siphon_deleted` true, so an older change
    applied later never revives a deleted row.
    """
    converted = [
        f"{mapping_for(c).snowflake.convert(quote(stage_column(i)))} AS {quote(f's{i}')}" for i, c in enumerate(table.columns)
    ]
    version = f"CAST({quote(STAGE_VERSION)} AS {VERSION_TYPE})"
    keys = [(i, c) for i, c in enumerate(table.columns) if c.primary_key]
    partition = ", ".join(mapping_for(c).snowflake.convert(quote(stage_column(i))) for i, c in keys)
    source = (
        f"SELECT {', '.join(converted)}, {version} AS {quote('sv')}, {quote(STAGE_DELETED)} AS {quote('sd')} "
        f"FROM {stage} QUALIFY ROW_NUMBER() OVER (PARTITION BY {partition} ORDER BY {version} DESC) = 1"
    )
    on = " AND ".join(f"t.{quote(c.name)} = s.{quote(f's{i}')}" for i, c in keys)
    updates = [f"{quote(c.name)} = s.{quote(f's{i}')}" for i, c in enumerate(table.columns) if not c.primary_key]
    updates += [
        f"{quote(VERSION_COLUMN)} = s.{quote('sv')}",
        f"{quote(DELETED_COLUMN)} = s.{quote('sd')}",
        f"{quote(SYNCED_AT_COLUMN)} = {NOW}",
    ]
    insert_columns = [quote(c.name) for c in table.columns] + [quote(name) for name in dialect.meta_types]
    insert_values = [f"s.{quote(f's{i}')}" for i in range(len(table.columns))]
    insert_values += [f"s.{quote('sv')}", f"s.{quote('sd')}", NOW]
    return (
        f"MERGE INTO {target} AS t USING ({source}) AS s ON {on} "
        f"WHEN MATCHED AND s.{quote('sv')} > t.{quote(VERSION_COLUMN)} THEN UPDATE SET {', '.join(updates)} "
        f"WHEN NOT MATCHED THEN INSERT ({', '.join(insert_columns)}) VALUES ({', '.join(insert_values)})"
    )


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
