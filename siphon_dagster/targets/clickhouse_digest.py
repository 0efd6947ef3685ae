"""ClickHouse statements of the checks: counts around a version, bucket digests, rows by bucket or key.

Values are rendered back to PostgreSQL's text by the type mapping (`clickhouse_sql.rendered_columns`),
so the row hashes are those PostgreSQL computes (siphon_dagster.checks.digest).
"""

from __future__ import annotations

from siphon_dagster.checks.digest import SEPARATOR_CODE
from siphon_dagster.targets import clickhouse_sql as sql
from siphon_dagster.targets.base import DELETED_COLUMN, VERSION_COLUMN, TableSchema, TargetRow

_SEPARATOR = f"char({SEPARATOR_CODE})"
_VERSION = sql.quote(VERSION_COLUMN)
_DELETED = sql.quote(DELETED_COLUMN)
# Aliases no source column can have: a ClickHouse alias is visible in the whole query and wins over a
# column of the same name, so an alias `v` would turn a source column `v` into the version in a row's text.
_B, _H, _V, _D = (sql.quote(f"_siphon_digest_{name}") for name in ("bucket", "hash", "version", "deleted"))


def _key_alias(index: int) -> str:
    return sql.quote(f"_siphon_digest_key_{index}")


def _joined(parts: list[str]) -> str:
    if len(parts) == 1:
        return parts[0]
    return "concat(" + f", {_SEPARATOR}, ".join(parts) + ")"


def key_renders(table: TableSchema) -> list[str]:
    return [f"ifNull({r}, '')" for r in sql.rendered_columns(table, [c.name for c in table.key_columns])]


def key_text(table: TableSchema) -> str:
    return _joined(key_renders(table))


def row_text(table: TableSchema) -> str:
    return _joined([f"ifNull(concat('1', {r}), '0')" for r in sql.rendered_columns(table, list(table.column_names))])


def bucket(table: TableSchema, digits_parameter: str) -> str:
    return f"substring(lower(hex(MD5({key_text(table)}))), 1, {{{digits_parameter}:UInt8}})"


def version_counts(names: sql.TableNames) -> tuple[str, str]:
    """Current rows at or below / above {v}; then keys whose latest version is a tombstone above {v}
    (only rows above {v} are grouped: a key's latest version above it is among them)."""
    current = (f"SELECT countIf({_VERSION} <= {{v:UInt128}}), countIf({_VERSION} > {{v:UInt128}}) "
               f"FROM {names.view}")
    keys = sql.key_order(names.table)
    deleted = (f"SELECT countIf({_D} = 1) FROM (SELECT argMax({_DELETED}, {_VERSION}) AS {_D} FROM {names.live} "
               f"WHERE {_VERSION} > {{v:UInt128}} GROUP BY {keys})")
    return current, deleted


def bucket_digests(names: sql.TableNames) -> str:
    # Raw 16-byte hashes are collected (half the memory of hex) and sorted: bytes sort as their hex does.
    return (f"SELECT {_B}, count(), lower(hex(MD5(arrayStringConcat(arrayMap(x -> lower(hex(x)), "
            f"arraySort(groupArray({_H}))))))) FROM (SELECT {bucket(names.table, 'digits')} AS {_B}, "
            f"MD5({row_text(names.table)}) AS {_H} FROM {names.view}) GROUP BY {_B}")


def latest_rows(names: sql.TableNames, where: str) -> str:
    """Each matching key's latest version, tombstones included, with the hash of its values."""
    table = names.table
    renders = key_renders(table)
    keys = ", ".join(f"{r} AS {_key_alias(i)}" for i, r in enumerate(renders))
    grouped = ", ".join(_key_alias(i) for i in range(len(renders)))
    return (f"SELECT {grouped}, argMax({_H}, {_V}), toString(max({_V})), argMax({_D}, {_V}), "
            f"(SELECT toString(max({_VERSION})) FROM {names.truncations}) FROM ("
            f"SELECT {keys}, lower(hex(MD5({row_text(table)}))) AS {_H}, {_VERSION} AS {_V}, {_DELETED} AS {_D} "
            f"FROM {names.live} WHERE {where}) GROUP BY {grouped}")


def changed_after(names: sql.TableNames) -> str:
    """Keys with a version above {v}, or every key when a TRUNCATE came after {v} (row count's exact step)."""
    return (f"{_VERSION} > {{v:UInt128}} OR (SELECT max({_VERSION}) FROM {names.truncations}) > {{v:UInt128}}")


def bucket_filter(table: TableSchema) -> str:
    return f"{bucket(table, 'digits')} IN {{buckets:Array(String)}}"


def target_rows(result_rows: list, width: int) -> dict[tuple[str, ...], TargetRow]:
    """(key..., hash, version, deleted, truncation version) -> TargetRow; a row older than the latest
    TRUNCATE reads as deleted by it."""
    found = {}
    for row in result_rows:
        key = tuple(row[:width])
        digest, version, deleted, truncated = row[width], int(row[width + 1]), bool(row[width + 2]), int(row[width + 3] or 0)
        if version <= truncated:
            found[key] = TargetRow(None, truncated, True)
        else:
            found[key] = TargetRow(None if deleted else digest, version, deleted)
    return found
