"""The statements every SQL target runs, written once over a dialect: the spellings that differ
between targets (quoting, types, how values are bound, how a table is made current, swapped,
merged into) are the dialect's hooks; `clickhouse_sql` and `snowflake_sql` implement them.

Identifiers always go through the dialect's `quote`; values go through `Bindings`, never spliced
into SQL (an int checked with `int()` aside).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

from siphon_dagster.targets.base import (
    DELETED_COLUMN,
    META_COLUMNS,
    SYNCED_AT_COLUMN,
    VERSION_COLUMN,
    SourceColumn,
    TableSchema,
    TargetError,
    VersionCounts,
)
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.type_mapping import TargetType

# Staging columns: positional names, so awkward source names never reach a staging table.
# Aliases of the checks' statements that no source column can have: an alias is visible in the
# whole query in ClickHouse and wins over a column of the same name, so an alias `v` would read a
# source column `v` as the row's version.
DIGEST_BUCKET, DIGEST_HASH, DIGEST_VERSION, DIGEST_DELETED = (
    f"_siphon_digest_{name}" for name in ("bucket", "hash", "version", "deleted"))
LATEST_VERSION, LATEST_DELETED, LATEST_TRUNCATION = (
    f"_siphon_latest_{name}" for name in ("version", "deleted", "truncation"))
STAGE_VERSION = "_v"
STAGE_DELETED = "_d"


def stage_column(index: int) -> str:
    return f"c{index}"


def staging_names(table: TableSchema) -> list[str]:
    return [stage_column(i) for i in range(len(table.columns))] + [STAGE_VERSION, STAGE_DELETED]


def check_columns(table: TableSchema) -> None:
    """Refuses a table the version rule cannot keep: one without a key, or one using Siphon's names."""
    if not table.key_columns:
        raise TargetError(
            f"{table.schema}.{table.table} has no primary key; the version rule needs one "
            "(add a primary key at the source)"
        )
    clashes = [c.name for c in table.columns if c.name in META_COLUMNS]
    if clashes:
        raise TargetError(f"{table.schema}.{table.table}: column names {clashes} are reserved for Siphon's own columns")


def view_columns(table: TableSchema) -> list[str]:
    return [*table.column_names, VERSION_COLUMN, SYNCED_AT_COLUMN]


class Statement(NamedTuple):
    """SQL and the values bound to it, in the form the target's driver takes them."""

    sql: str
    params: Any = None


class Bindings(ABC):
    """The values of one statement as its driver binds them; each method returns the SQL that
    stands for the value where it is used."""

    params: Any

    @abstractmethod
    def version(self, value: int) -> str:
        """A version (up to 96 bits), compared with `_siphon_version`."""

    @abstractmethod
    def texts(self, values: Sequence[str]) -> str:
        """A list of strings, the right side of an IN."""

    def statement(self, sql: str) -> Statement:
        return Statement(sql, self.params)


class SqlDialect(ABC):
    """A SQL target's spellings (the hooks) and the statements built from them."""

    name: str  # "clickhouse", "snowflake": the target's name
    keys_per_lookup: int  # keys (or buckets) one lookup statement binds
    meta_types: dict[str, str]  # Siphon's columns and their types
    meta_constraint = ""  # appended to each of Siphon's columns
    false = "FALSE"  # the delete flag of a row that is not a tombstone
    separator: str  # the separator of digest texts (siphon_dagster.checks.digest)
    # A staging table: how it is created, its column types (text, version as text, delete flag).
    stage_kind = "TABLE"
    stage_types: tuple[str, str, str]
    stage_options = ""

    # -- hooks: spelling ----------------------------------------------------------------------------

    @abstractmethod
    def quote(self, identifier: str) -> str:
        """An identifier quoted so that any name, in any case, stays exactly itself."""

    @abstractmethod
    def target_type(self, column: SourceColumn) -> TargetType:
        """The type mapping's entry of this target (`type_mapping.TypeMapping`)."""

    def column_type(self, column: SourceColumn) -> str:
        """The column's type as this target declares it."""
        return self.target_type(column).type

    def column_definition(self, column: SourceColumn) -> str:
        return f"{self.quote(column.name)} {self.column_type(column)}"

    def described_type(self, column: SourceColumn) -> str:
        """The column's type as this target's catalog reports it."""
        return self.column_type(column)

    def type_matches(self, column: SourceColumn, stored: str) -> bool:
        return stored == self.described_type(column)

    @abstractmethod
    def bindings(self) -> Bindings:
        """An empty set of values for one statement."""

    @abstractmethod
    def as_text(self, expression: str) -> str:
        """A version (a wide integer) as text: it must not pass through a float on the way."""

    @abstractmethod
    def concat(self, parts: Sequence[str]) -> str:
        """Strings joined into one (NULL when one is NULL)."""

    @abstractmethod
    def md5_hex(self, expression: str) -> str:
        """md5 of a string as 32 lower-case hex digits."""

    # -- hooks: statements --------------------------------------------------------------------------

    def table_options(self, table: TableSchema) -> str:
        """What follows the column list of a replicated table (an engine, its order)."""
        return ""

    def log_table_options(self) -> str:
        """What follows the column list of the truncations table."""
        return ""

    @abstractmethod
    def newest_rows(self, names: TableNames) -> str:
        """What the current-rows view reads: each key's newest stored row."""

    @abstractmethod
    def stage_reference(self, names: TableNames, name: str) -> str:
        """Where a staging table called `name` lives (the session's schema, or the table's database)."""

    @abstractmethod
    def key_filter(self, table: TableSchema, keys: Sequence[tuple[str, ...]], bind: Bindings) -> str:
        """A condition true for the rows with those primary keys, given as PostgreSQL text."""

    @abstractmethod
    def tombstone_all(self, target: str, table: TableSchema, version: int) -> Statement:
        """TRUNCATE: every key older than `version` gets a tombstone with it (deleted keys too, so a
        replayed change older than the truncate cannot revive them)."""

    @abstractmethod
    def swap(self, names: TableNames) -> str:
        """Exchanges the live and shadow tables in one atomic step, where the engine can."""

    @abstractmethod
    def swap_by_renames(self, names: TableNames, retired: str) -> list[str]:
        """The same exchange where `swap` is refused, with `retired` as the spare name."""

    # -- hooks: check statements (siphon_dagster.checks) --------------------------------------------

    @abstractmethod
    def changes_around(self, names: TableNames, version: int, limit: int) -> Statement:
        """One statement, so one consistent read of the table, of the counts around `version`
        (`base.VersionCounts`) and the keys changed after it (every key when a TRUNCATE came
        after it), at most `limit` + 1 of them; `read_changes_around` takes its rows apart."""

    @abstractmethod
    def read_changes_around(self, rows: Sequence[Sequence[Any]]) -> tuple[VersionCounts, list[tuple[str, ...]]]:
        """The counts and the changed keys (as PostgreSQL text) in the rows of `changes_around`."""

    @abstractmethod
    def digest_of_hashes(self, hashes: str) -> str:
        """The aggregate of a bucket: md5 of its rows' `MD5(...)` values sorted, as hex."""

    @abstractmethod
    def latest_rows(self, names: TableNames, where: str) -> str:
        """(key text..., row hash, version, deleted, latest truncation) of each key matching
        `where` at its latest version, tombstones included; versions as text."""

    # -- statements ---------------------------------------------------------------------------------

    def create_table(self, target: str, table: TableSchema, if_not_exists: bool = True) -> str:
        columns = [self.column_definition(c) for c in table.columns]
        columns += [f"{self.quote(name)} {kind}{self.meta_constraint}" for name, kind in self.meta_types.items()]
        return (f"CREATE TABLE {'IF NOT EXISTS ' if if_not_exists else ''}{target} ({', '.join(columns)})"
                f"{self.table_options(table)}")

    def create_truncations(self, names: TableNames) -> str:
        column = f"{self.quote(VERSION_COLUMN)} {self.meta_types[VERSION_COLUMN]}{self.meta_constraint}"
        return f"CREATE TABLE IF NOT EXISTS {names.truncations} ({column}){self.log_table_options()}"

    def create_view(self, names: TableNames) -> str:
        """Current rows: each key's newest row, unless it is a tombstone or older than the latest
        TRUNCATE (`newest_rows` says how the target finds the newest row)."""
        selected = ", ".join(self.quote(name) for name in view_columns(names.table))
        return (
            f"CREATE OR REPLACE VIEW {names.view} AS SELECT {selected} FROM {self.newest_rows(names)} "
            f"WHERE {self.quote(DELETED_COLUMN)} = {self.false} "
            f"AND {self.quote(VERSION_COLUMN)} > {self.latest_truncation(names)}"
        )

    def latest_truncation(self, names: TableNames) -> str:
        return f"(SELECT COALESCE(MAX({self.quote(VERSION_COLUMN)}), 0) FROM {names.truncations})"

    def stage_structure(self, table: TableSchema) -> str:
        """The staged columns of a change batch: the values as text, the version, the delete flag."""
        text, version, flag = self.stage_types
        columns = [f"{self.quote(stage_column(i))} {text}" for i in range(len(table.columns))]
        columns += [f"{self.quote(STAGE_VERSION)} {version}", f"{self.quote(STAGE_DELETED)} {flag}"]
        return ", ".join(columns)

    def create_stage(self, stage: str, table: TableSchema) -> str:
        return f"CREATE {self.stage_kind} {stage} ({self.stage_structure(table)}){self.stage_options}"

    # -- the version rule's TRUNCATE -----------------------------------------------------------------

    def count_older(self, names: TableNames, version: int) -> Statement:
        """Current rows a TRUNCATE at `version` deletes."""
        bind = self.bindings()
        return bind.statement(f"SELECT COUNT(*) FROM {names.view} WHERE {self.quote(VERSION_COLUMN)} < {bind.version(version)}")

    def record_truncation(self, names: TableNames, version: int) -> Statement:
        bind = self.bindings()
        version_column = self.quote(VERSION_COLUMN)
        return bind.statement(f"INSERT INTO {names.truncations} ({version_column}) SELECT {bind.version(version)}")

    # -- reads ----------------------------------------------------------------------------------------

    def max_version(self, names: TableNames) -> str:
        return f"SELECT {self.as_text(f'MAX({self.quote(VERSION_COLUMN)})')} FROM {names.live}"

    def rendered_columns(self, table: TableSchema, names: Sequence[str]) -> list[str]:
        """Columns rendered back to PostgreSQL's text output by the type mapping."""
        return [self.target_type(table.column(name)).render(self.quote(name)) for name in names]

    def key_order(self, table: TableSchema) -> str:
        return ", ".join(self.quote(c.name) for c in table.key_columns)

    def current_rows(self, names: TableNames) -> str:
        selected = self.rendered_columns(names.table, names.table.column_names)
        return f"SELECT {', '.join(selected)} FROM {names.view} ORDER BY {self.key_order(names.table)}"

    def current_values(self, names: TableNames, keys: Sequence[tuple[str, ...]], columns: Sequence[str]) -> Statement:
        """The keys' current values of `columns`, each row led by its key, all as PostgreSQL text."""
        table = names.table
        bind = self.bindings()
        selected = self.rendered_columns(table, [c.name for c in table.key_columns] + list(columns))
        return bind.statement(f"SELECT {', '.join(selected)} FROM {names.view} "
                              f"WHERE {self.key_filter(table, keys, bind)}")

    # -- check statements: digests as siphon_dagster.checks.digest defines them ---------------------

    def _separated(self, parts: list[str]) -> str:
        return self.concat([x for part in parts for x in (self.separator, part)][1:])

    def key_text(self, table: TableSchema) -> str:
        renders = self.rendered_columns(table, [c.name for c in table.key_columns])
        return self._separated([f"COALESCE({r}, '')" for r in renders])

    def row_text(self, table: TableSchema) -> str:
        # A NULL and an empty string differ: each value is marked present ('1') or NULL ('0').
        marked = [self.concat(["'1'", r]) for r in self.rendered_columns(table, table.column_names)]
        return self._separated([f"COALESCE({m}, '0')" for m in marked])

    def bucket(self, table: TableSchema, digits: int) -> str:
        return f"SUBSTRING({self.md5_hex(self.key_text(table))}, 1, {int(digits)})"

    def bucket_digests(self, names: TableNames, digits: int) -> str:
        b, h = DIGEST_BUCKET, DIGEST_HASH
        return (f"SELECT {b}, COUNT(*), {self.digest_of_hashes(h)} FROM (SELECT {self.bucket(names.table, digits)} "
                f"AS {b}, MD5({self.row_text(names.table)}) AS {h} FROM {names.view}) GROUP BY {b}")

    def bucket_rows(self, names: TableNames, digits: int, buckets: Sequence[str]) -> Statement:
        bind = self.bindings()
        where = f"{self.bucket(names.table, digits)} IN {bind.texts(buckets)}"
        return bind.statement(self.latest_rows(names, where))

    def key_rows(self, names: TableNames, keys: Sequence[tuple[str, ...]]) -> Statement:
        bind = self.bindings()
        return bind.statement(self.latest_rows(names, self.key_filter(names.table, keys, bind)))
