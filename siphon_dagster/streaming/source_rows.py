"""Reads from the source PostgreSQL what a package does not carry.

- Current values by primary key, for unchanged TOASTed values the target cannot supply: whatever
  the source holds now is at least as new as the change being applied, and any later change of
  the column arrives with a greater version (DESIGN.md, section 3).
- Type categories of column types, so a table schema built from a package matches the one the
  snapshot path reads from the catalog.
- For a column added at the source, the value its older rows hold: PostgreSQL sends no change for
  them (siphon_dagster.source.existing_rows_values).

Values are read as the raw text the server sends, rendered by each type's output function under
the producer's session settings (siphon_dagster.source.SESSION_OPTIONS). A `::text` cast would
differ for some types (boolean prints `true`, not `t`; char(n) loses its padding).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from siphon_dagster import source
from siphon_dagster.source import ExistingRowsValue
from siphon_dagster.targets.base import SourceColumn, TableSchema

_KEYS_PER_QUERY = 500
TextRow = dict[str, str | None]


class SourceRowReader:
    """One lazily opened autocommit connection to the source; not thread-safe."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._connection: psycopg.Connection[Any] | None = None
        self._types: dict[int, tuple[str, int]] = {}

    def read_rows(self, table: TableSchema, keys: Sequence[tuple[str, ...]],
                  columns: Sequence[str]) -> dict[tuple[str, ...], TextRow]:
        """Current values of `columns` for the rows with these primary keys (text); absent rows are left out."""
        key_names = [c.name for c in table.key_columns]
        found: dict[tuple[str, ...], TextRow] = {}
        unique = list(dict.fromkeys(keys))
        for start in range(0, len(unique), _KEYS_PER_QUERY):
            chunk = unique[start : start + _KEYS_PER_QUERY]
            query = _rows_query(table, key_names, list(columns), len(chunk))
            params = [value for key in chunk for value in key]  # str binds as 'unknown': typed by the column
            with self._connect().cursor() as cursor:
                cursor.execute(query, params)
                result = cursor.pgresult
                assert result is not None
                for row in range(result.ntuples):
                    texts = [_text(result.get_value(row, col)) for col in range(result.nfields)]
                    key = tuple(texts[: len(key_names)])
                    found[key] = dict(zip(columns, texts[len(key_names) :], strict=True))  # type: ignore[arg-type]
        return found

    def type_categories(self, type_oids: Sequence[int]) -> dict[int, tuple[str, int]]:
        """pg_type.typcategory and typelem per type oid (cached: type oids never change meaning)."""
        wanted = [oid for oid in set(type_oids) if oid not in self._types]
        if wanted:
            rows = self._connect().execute(
                "select oid::int, typcategory::text, typelem::int from pg_type where oid = any(%s)", (wanted,))
            for oid, category, element in rows:
                self._types[oid] = (category, element)
        return {oid: self._types[oid] for oid in type_oids if oid in self._types}

    def existing_rows_values(self, table: TableSchema,
                             columns: Sequence[SourceColumn]) -> dict[str, ExistingRowsValue]:
        """Per column, the value rows that existed when it was added hold in it (not for key columns)."""
        return source.existing_rows_values(self._connect(), table.schema, table.table, columns)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _connect(self) -> psycopg.Connection[Any]:
        if self._connection is None or self._connection.closed:
            self._connection = source.connect(self._dsn, autocommit=True)
        return self._connection


class SharedSourceRowReader(SourceRowReader):
    """One reader for every table of a group run: one source connection (hundreds of tables must
    not hold hundreds), used by one table's thread at a time."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self._lock = threading.Lock()

    def read_rows(self, table: TableSchema, keys: Sequence[tuple[str, ...]],
                  columns: Sequence[str]) -> dict[tuple[str, ...], TextRow]:
        with self._lock:
            return super().read_rows(table, keys, columns)

    def type_categories(self, type_oids: Sequence[int]) -> dict[int, tuple[str, int]]:
        with self._lock:
            return super().type_categories(type_oids)

    def existing_rows_values(self, table: TableSchema,
                             columns: Sequence[SourceColumn]) -> dict[str, ExistingRowsValue]:
        with self._lock:
            return super().existing_rows_values(table, columns)

    def close(self) -> None:
        with self._lock:
            super().close()


def _rows_query(table: TableSchema, key_names: list[str], columns: list[str], key_count: int) -> sql.Composed:
    one_key = sql.SQL("({})").format(sql.SQL(", ").join([sql.Placeholder()] * len(key_names)))
    return sql.SQL("select {keys}, {columns} from {table} where ({keys}) in ({values})").format(
        keys=sql.SQL(", ").join(map(sql.Identifier, key_names)),
        columns=sql.SQL(", ").join(map(sql.Identifier, columns)),
        table=sql.Identifier(table.schema, table.table),
        values=sql.SQL(", ").join([one_key] * key_count),
    )


def _text(value: bytes | None) -> str | None:
    return None if value is None else bytes(value).decode()
