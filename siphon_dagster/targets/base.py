"""The one interface every analytical target implements; nothing above it branches on a target's name.

Values cross this seam in PostgreSQL's text output form (what pgoutput and COPY produce), so the
snapshot and the stream share one conversion, done by the target database itself in SQL, and a
value is never reinterpreted by Python on the way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import pyarrow as pa

from siphon_core.naming import SHADOW_SUFFIX, TRUNCATIONS_SUFFIX, target_table_name

# Columns every target table carries beside the source's columns.
VERSION_COLUMN = "_siphon_version"
DELETED_COLUMN = "_siphon_deleted"
SYNCED_AT_COLUMN = "_siphon_synced_at"
META_COLUMNS = (VERSION_COLUMN, DELETED_COLUMN, SYNCED_AT_COLUMN)

# Arrow layout of a change batch handed to `apply_rows`: one nullable string column per source
# column (PostgreSQL text output), then the version and the delete flag.
VERSION_ARROW_TYPE = pa.decimal128(38, 0)


@dataclass(frozen=True)
class SourceColumn:
    name: str
    type_oid: int
    type_name: str  # format_type(atttypid, atttypmod), e.g. "numeric(12,2)", "character varying(40)[]"
    type_modifier: int = -1
    nullable: bool = True
    primary_key: bool = False
    # For arrays, enums, domains and ranges: what the type is built on (from pg_type).
    category: str = ""  # pg_type.typcategory, e.g. 'A' array, 'E' enum, 'R' range, 'U' user
    element_type_oid: int = 0


@dataclass(frozen=True)
class TableSchema:
    """A source table as replicated: its columns minus excluded ones, in source order."""

    schema: str
    table: str
    columns: tuple[SourceColumn, ...]

    @property
    def key_columns(self) -> tuple[SourceColumn, ...]:
        return tuple(c for c in self.columns if c.primary_key)

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> SourceColumn:
        for column in self.columns:
            if column.name == name:
                return column
        raise KeyError(f"{self.schema}.{self.table} has no column {name!r}")


@dataclass(frozen=True)
class TargetColumn:
    name: str
    type: str  # the target's own spelling of the type


@dataclass
class SchemaChange:
    created: bool = False
    added_columns: list[str] = field(default_factory=list)
    # Columns whose source type changed in a way the target cannot follow.
    incompatible: list[str] = field(default_factory=list)


class TargetError(RuntimeError):
    """A target refused an operation; the message names the table and what to do."""




def shadow_table_name(schema: str, table: str) -> str:
    """The table a resync fills before it replaces `<schema>__<table>`."""
    return f"{target_table_name(schema, table)}{SHADOW_SUFFIX}"


def truncations_table_name(schema: str, table: str) -> str:
    """Versions of the source's TRUNCATEs: rows older than the latest one are gone from the source.

    Tombstones cover the rows a target holds when a TRUNCATE is applied; this also hides rows that
    arrive later with an older version (a snapshot read before the TRUNCATE and landing after it).
    """
    return f"{target_table_name(schema, table)}{TRUNCATIONS_SUFFIX}"


# -- what the checks read (siphon_dagster.checks) ------------------------------------------------


@dataclass(frozen=True)
class VersionCounts:
    """A target's rows around a version V (a source read's LSN, position 0)."""

    at_or_below: int  # current rows with version <= V
    above: int  # current rows with version > V
    tombstones_above: int  # keys whose latest version is a tombstone (or a TRUNCATE) > V


@dataclass(frozen=True)
class ChangesAround:
    """A target's rows around a version V and its keys changed after V, read at one moment."""

    counts: VersionCounts
    changed_keys: list[tuple[str, ...]] | None  # as PostgreSQL text; None: more than the limit asked


@dataclass(frozen=True)
class BucketDigest:
    """Rows of one bucket of keys and the digest of their row hashes (siphon_dagster.checks.digest)."""

    rows: int
    digest: str


@dataclass(frozen=True)
class TargetRow:
    """A key's latest version at a target, tombstones included (hash None when deleted)."""

    hash: str | None
    version: int
    deleted: bool


def change_batch_schema(table: TableSchema) -> pa.Schema:
    return _change_batch_schema(table.column_names)


@functools.lru_cache(maxsize=4096)
def _change_batch_schema(names: tuple[str, ...]) -> pa.Schema:
    # Asked twice for every batch of every table: building it each time cost a run of hundreds of
    # tables 2% of its Python time.
    fields = [pa.field(name, pa.string()) for name in names]
    fields.append(pa.field(VERSION_COLUMN, VERSION_ARROW_TYPE, nullable=False))
    fields.append(pa.field(DELETED_COLUMN, pa.bool_(), nullable=False))
    return pa.schema(fields)


@runtime_checkable
class Target(Protocol):
    """An analytical database kept converged with the source by the version rule.

    Version rule: a row version replaces the stored row only if it is greater; a delete leaves a
    tombstone carrying its version; readers see the latest version that is not deleted.
    """

    name: str  # "clickhouse" or "snowflake": used for asset keys and job names only
    # How long a stream write may trust its look-up of the resync shadow (0: every write looks).
    shadow_lookup_seconds: float
    # Whether a change batch may also hold rows that a greater version of the same key in it
    # supersedes: the target keeps each key's greatest version however its rows arrive, so the run
    # need not take them out first. A MERGE needs one source row per key: not Snowflake.
    superseded_rows_allowed: bool

    def sibling(self) -> Target:
        """A target of the same configuration for another table of a streaming run (sharing
        connections where the target can serve many tables through them)."""

    def ensure_table(self, table: TableSchema, backfill: Mapping[str, str] | None = None) -> SchemaChange:
        """Creates the versioned table and its current-rows view, or adds new source columns.

        `backfill` gives, as PostgreSQL text, the value that rows already in the table take in a
        column this call adds (a source DEFAULT that PostgreSQL applied without sending changes);
        added columns it does not name are NULL in those rows. Rows written later always carry
        their own value, NULL included. The column appears with its values in one step, so a
        crash never leaves it added but unfilled.
        """

    def apply_rows(self, table: TableSchema, rows: pa.Table) -> int:
        """Applies a change batch laid out as `change_batch_schema(table)`; returns rows written."""

    def apply_copy_text(
        self, table: TableSchema, chunks: Iterable[bytes], version: int, *, shadow: bool = False
    ) -> int:
        """Applies rows in PostgreSQL's COPY text format (a snapshot), all with one version.

        `shadow=True` writes into the table being rebuilt by `create_shadow` instead of the live one.
        """

    def tombstone_all(self, table: TableSchema, version: int) -> int:
        """TRUNCATE: every current row gets a tombstone with `version` (older rows only), and rows
        older than `version` applied later stay invisible."""

    def read_current_values(
        self, table: TableSchema, keys: Sequence[tuple[str, ...]], columns: Sequence[str]
    ) -> dict[tuple[str, ...], dict[str, str | None]]:
        """Current (not deleted) values of `columns` for primary keys given as text, as PostgreSQL text."""

    def current_rows_as_text(self, table: TableSchema) -> list[tuple[str | None, ...]]:
        """Every current row, each value rendered back to PostgreSQL's text output, ordered by key."""

    def count_current(self, table: TableSchema) -> int:
        """Number of current (latest, not deleted) rows."""

    def max_version(self, table: TableSchema) -> int:
        """Greatest version stored (0 for an empty table)."""

    def describe_columns(self, table: TableSchema) -> list[TargetColumn]:
        """The target table's columns as the target reports them (meta columns included)."""

    def table_exists(self, table: TableSchema) -> bool:
        """Whether the target table exists (cheaper than `describe_columns` where the target can)."""

    # What the checks read; digests as defined in siphon_dagster.checks.digest.

    @property
    def location(self) -> str:
        """Where the target is, for messages: its address without credentials."""

    def expected_column_type(self, column: SourceColumn) -> str:
        """The type the mapping gives a source column, as `describe_columns` spells it."""

    def column_type_matches(self, column: SourceColumn, stored: str) -> bool:
        """Whether a stored column type is the one the source column maps to."""

    def changes_around(self, table: TableSchema, version: int, limit: int) -> ChangesAround:
        """At one consistent read of the table: current rows at or below `version`, above it, keys
        deleted after it, and the keys changed after it (every key when a TRUNCATE came after it)."""

    def bucket_digests(self, table: TableSchema, digits: int) -> dict[str, BucketDigest]:
        """Per bucket of current rows (the first `digits` hex digits of md5(key text)): rows and digest."""

    def bucket_rows(self, table: TableSchema, digits: int,
                    buckets: Sequence[str]) -> dict[tuple[str, ...], TargetRow]:
        """The latest version of every key of those buckets, tombstones included, keyed by key text."""

    def key_rows(self, table: TableSchema, keys: Sequence[tuple[str, ...]]) -> dict[tuple[str, ...], TargetRow]:
        """The latest version of keys given as text, tombstones included."""

    def drop_table(self, table: TableSchema) -> None:
        """Drops the table and its view (resync rebuilds it)."""

    # Resync without downtime for readers: build a shadow table beside the live one, fill it with
    # snapshots (`apply_copy_text(..., shadow=True)`) while every other write (`apply_rows`,
    # `tombstone_all`, snapshots of the live table) goes to both, then swap it in atomically. The
    # view keeps its name and reads whichever table holds the live name.

    def create_shadow(self, table: TableSchema) -> None:
        """Creates an empty `<schema>__<table>__resync` with the live table's layout (replacing any)."""

    def swap_shadow(self, table: TableSchema) -> None:
        """Makes the shadow the live table in one step and drops the previous live table."""

    def drop_shadow(self, table: TableSchema) -> None:
        """Abandons a resync: drops the shadow table if there is one."""

    def ping(self) -> None:
        """Raises when the target does not answer a trivial statement (down, unreachable, refusing
        the login): a batch that fails then is no bad batch."""

    def close(self) -> None: ...
