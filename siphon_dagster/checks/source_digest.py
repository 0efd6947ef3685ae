"""The source side of the row digests (see checks.digest), computed by PostgreSQL itself.

Values are their types' text output on a connection with the pinned session settings (source.connect), the text
the stream and the snapshots carry. Reads share one REPEATABLE READ transaction per check, so the
counts, the bucket digests and the rows of mismatched buckets all describe one snapshot, bounded by
a WAL position read before it was taken and one read after (`SnapshotRead`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from siphon_core import naming
from siphon_dagster import source
from siphon_dagster.checks.digest import SEPARATOR_CODE, BucketDigest, SourceRow
from siphon_dagster.targets.base import TableSchema

_JOIN = sql.SQL(f" || chr({SEPARATOR_CODE}) || ")


@contextmanager
def snapshot_read(dsn: str) -> Iterator[SnapshotRead]:
    """A read-only REPEATABLE READ transaction: every query in it sees one snapshot. Its
    `lsn_before` was read before the snapshot was taken, so every change the snapshot misses has a
    commit LSN above it; `snapshot_lsn` after the first query bounds what it sees from above."""
    with source.connect(dsn) as connection:
        before = naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])
        connection.commit()
        connection.execute("set transaction isolation level repeatable read, read only")
        try:
            yield SnapshotRead(connection, before)
        finally:
            connection.rollback()


@dataclass(frozen=True)
class SnapshotRead:
    """A source read under one snapshot, bounded by two WAL positions.

    A commit the snapshot does not see has an LSN above `lsn_before`, and one it sees an LSN below
    the `snapshot_lsn` read after its first query. Once the stream applied past the latter, a key
    whose newest target version is at or below `lsn_before`'s changed in nothing the snapshot
    missed or the stream has not applied: its row must equal the snapshot's. Keys with newer
    versions are in flight."""

    connection: psycopg.Connection[Any]
    lsn_before: int

    @property
    def version_before(self) -> int:
        return naming.row_version(self.lsn_before, 0)


def snapshot_lsn(connection: psycopg.Connection[Any]) -> int:
    """Call after the transaction's first query: its snapshot then exists, and sees no commit after this."""
    return naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])


def _relation(table: TableSchema) -> sql.Composable:
    return sql.Identifier(table.schema, table.table)


def value_text(column: str) -> sql.Composable:
    """The value as its type's output function prints it, as pgoutput and COPY send it: concat()
    calls that function, where a cast to text may print otherwise (boolean as `true`, inet with its
    netmask, bpchar without its padding)."""
    return sql.SQL("concat({})").format(sql.Identifier(column))


def key_text(table: TableSchema) -> sql.Composable:
    return _JOIN.join(value_text(c.name) for c in table.key_columns)


def row_hash(table: TableSchema) -> sql.Composable:
    parts = [sql.SQL("case when {} is null then '0' else '1' || {} end").format(sql.Identifier(c.name),
                                                                              value_text(c.name))
             for c in table.columns]
    return sql.SQL("md5({})").format(_JOIN.join(parts))


def count_rows(connection: psycopg.Connection[Any], table: TableSchema) -> int:
    return int(connection.execute(sql.SQL("select count(*) from {}").format(_relation(table))).fetchone()[0])


def bucket_digests(connection: psycopg.Connection[Any], table: TableSchema, digits: int) -> dict[str, BucketDigest]:
    # COLLATE "C": hex digits sort by byte, as ClickHouse's arraySort and Snowflake's LISTAGG sort them.
    query = sql.SQL(
        "select substr(md5(kt), 1, %s) as b, count(*), md5(string_agg(h, '' order by h collate \"C\")) "
        "from (select {kt} as kt, {h} as h from {t}) s group by 1"
    ).format(kt=key_text(table), h=row_hash(table), t=_relation(table))
    return {bucket: BucketDigest(int(rows), digest)
            for bucket, rows, digest in connection.execute(query, (digits,)).fetchall()}


def _row_query(table: TableSchema, where: sql.Composable) -> sql.Composable:
    keys = sql.SQL(", ").join(value_text(c.name) for c in table.key_columns)
    # A ctid's block names the snapshot partition (block range) that reads the row.
    return sql.SQL("select {keys}, {h}, (ctid::text::point)[0]::bigint from {t} as t where {where}").format(
        keys=keys, h=row_hash(table), t=_relation(table), where=where)


def _rows(connection: psycopg.Connection[Any], query: sql.Composable, params: Sequence[Any],
          width: int) -> dict[tuple[str, ...], SourceRow]:
    return {tuple(row[:width]): SourceRow(row[width], int(row[width + 1]))
            for row in connection.execute(query, params).fetchall()}


def bucket_rows(connection: psycopg.Connection[Any], table: TableSchema, digits: int,
                buckets: Sequence[str]) -> dict[tuple[str, ...], SourceRow]:
    where = sql.SQL("substr(md5({}), 1, %s) = any(%s)").format(key_text(table))
    return _rows(connection, _row_query(table, where), (digits, list(buckets)), len(table.key_columns))


def key_rows(connection: psycopg.Connection[Any], table: TableSchema,
             keys: Sequence[tuple[str, ...]]) -> dict[tuple[str, ...], SourceRow]:
    """The rows of keys given as text; the key's own types are compared, so its index serves."""
    columns = table.key_columns
    # format_type's output is the catalog's own spelling of the type, with any identifier in it quoted.
    matches = sql.SQL(" and ").join(
        sql.SQL("t.{} = cast(k.{} as {})").format(sql.Identifier(c.name), sql.Identifier(f"k{i}"), sql.SQL(c.type_name))
        for i, c in enumerate(columns))
    arrays = sql.SQL(", ").join(sql.SQL("%s::text[]") for _ in columns)
    names = sql.SQL(", ").join(sql.Identifier(f"k{i}") for i in range(len(columns)))
    where = sql.SQL("exists (select from unnest({arrays}) as k({names}) where {matches})").format(
        arrays=arrays, names=names, matches=matches)
    params = [[key[i] for key in keys] for i in range(len(columns))]
    return _rows(connection, _row_query(table, where), params, len(columns))
