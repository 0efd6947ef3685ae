"""Snowflake statements of the checks: counts around a version, bucket digests, rows by bucket or key.

Values are rendered back to PostgreSQL's text by the type mapping (`snowflake_sql.rendered_columns`),
so the row hashes are those PostgreSQL computes (siphon_dagster.checks.digest). Versions are bound
as text and cast, as everywhere in this target.
"""

from __future__ import annotations

from siphon_dagster.checks.digest import SEPARATOR_CODE
from siphon_dagster.targets import snowflake_sql as sql
from siphon_dagster.targets.base import DELETED_COLUMN, VERSION_COLUMN, TableSchema, TargetRow

_SEPARATOR = f"CHR({SEPARATOR_CODE})"
_VERSION = sql.quote(VERSION_COLUMN)
_DELETED = sql.quote(DELETED_COLUMN)
_BOUND_VERSION = f"CAST(? AS {sql.VERSION_TYPE})"


def key_renders(table: TableSchema) -> list[str]:
    return sql.rendered_columns(table, [c.name for c in table.key_columns])


def key_text(table: TableSchema) -> str:
    return f" || {_SEPARATOR} || ".join(key_renders(table))


def row_text(table: TableSchema) -> str:
    parts = [f"COALESCE('1' || {r}, '0')" for r in sql.rendered_columns(table, list(table.column_names))]
    return f" || {_SEPARATOR} || ".join(parts)


def newest(names: sql.TableNames) -> str:
    """Each key's newest stored row, tombstones included (as the current-rows view picks it)."""
    return (f"SELECT * FROM {names.live} QUALIFY ROW_NUMBER() OVER (PARTITION BY {sql.key_order(names.table)} "
            f"ORDER BY {_VERSION} DESC) = 1")


def truncated(names: sql.TableNames) -> str:
    return f"(SELECT COALESCE(MAX({_VERSION}), 0) FROM {names.truncations})"


def version_counts(names: sql.TableNames) -> str:
    """Binds the version three times."""
    live = f"NOT {_DELETED} AND {_VERSION} > {truncated(names)}"
    return (f"SELECT COALESCE(SUM(CASE WHEN {live} AND {_VERSION} <= {_BOUND_VERSION} THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN {live} AND {_VERSION} > {_BOUND_VERSION} THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN {_DELETED} AND {_VERSION} > {_BOUND_VERSION} THEN 1 ELSE 0 END), 0) "
            f"FROM ({newest(names)})")


def bucket_digests(names: sql.TableNames, digits: int) -> str:
    """Binds nothing: `digits` is an int the caller checked."""
    # Aliases no source column can have (a column named `h` must stay that column in the row's text).
    return (f"SELECT _siphon_digest_bucket, COUNT(*), MD5(LISTAGG(_siphon_digest_hash, '') WITHIN GROUP "
            f"(ORDER BY _siphon_digest_hash)) FROM (SELECT SUBSTR(MD5({key_text(names.table)}), 1, {int(digits)}) "
            f"AS _siphon_digest_bucket, MD5({row_text(names.table)}) AS _siphon_digest_hash "
            f"FROM {names.view}) GROUP BY _siphon_digest_bucket")


def latest_rows(names: sql.TableNames, where: str) -> str:
    keys = ", ".join(key_renders(names.table))
    return (f"SELECT {keys}, MD5({row_text(names.table)}), CAST({_VERSION} AS VARCHAR), {_DELETED}, "
            f"CAST({truncated(names)} AS VARCHAR) FROM ({newest(names)}) WHERE {where}")


def changed_after(names: sql.TableNames) -> str:
    """Binds the version twice: keys with a newer version, or every key when a TRUNCATE came after it."""
    return f"({_VERSION} > {_BOUND_VERSION} OR {truncated(names)} > {_BOUND_VERSION})"


def bucket_filter(table: TableSchema, digits: int, count: int) -> str:
    return f"SUBSTR(MD5({key_text(table)}), 1, {int(digits)}) IN ({', '.join(['?'] * count)})"


def target_rows(result_rows: list, width: int) -> dict[tuple[str, ...], TargetRow]:
    found = {}
    for row in result_rows:
        key = tuple(row[:width])
        digest, version, deleted, truncation = row[width], int(row[width + 1]), bool(row[width + 2]), int(row[width + 3] or 0)
        if version <= truncation:
            found[key] = TargetRow(None, truncation, True)
        else:
            found[key] = TargetRow(None if deleted else digest, version, deleted)
    return found
