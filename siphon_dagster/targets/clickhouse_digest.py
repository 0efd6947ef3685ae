"""ClickHouse's statements of the checks: counts around a version, a bucket's digest, a key's
latest row. The rest of the checks' SQL is shared (`sql_dialect.SqlDialect`); values are rendered
back to PostgreSQL's text by the type mapping, so the row hashes are those PostgreSQL computes
(siphon_dagster.checks.digest).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from siphon_dagster.checks.digest import SEPARATOR_CODE
from siphon_dagster.targets.base import DELETED_COLUMN, VERSION_COLUMN, VersionCounts
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.sql_dialect import (
    DIGEST_DELETED,
    DIGEST_HASH,
    DIGEST_VERSION,
    LATEST_DELETED,
    LATEST_TRUNCATION,
    LATEST_VERSION,
    SqlDialect,
    Statement,
)

# Memory `changes_around`'s grouping may hold before it spills: about 1.5 M keys of a bigint key.
CHANGES_GROUP_BY_BYTES = 100_000_000


class ClickHouseCheckStatements(SqlDialect):
    """The check hooks of `clickhouse_sql.ClickHouseDialect`."""

    separator = f"char({SEPARATOR_CODE})"

    def quick_counts(self, names: TableNames, version: int) -> list[Statement]:
        """`changes_around`'s counts in two cheaper statements: current rows at or below / above
        the version through the view (FINAL), then keys whose latest version is a tombstone above
        it (only rows above it are grouped: a key's latest version above it is among them)."""
        bind = self.bindings()
        bound = bind.version(version)
        v, d = self.quote(VERSION_COLUMN), self.quote(DELETED_COLUMN)
        current = bind.statement(f"SELECT countIf({v} <= {bound}), countIf({v} > {bound}) FROM {names.view}")
        alias = DIGEST_DELETED
        deleted = bind.statement(f"SELECT countIf({alias} = 1) FROM (SELECT argMax({d}, {v}) AS {alias} "
                                 f"FROM {names.live} WHERE {v} > {bound} GROUP BY {self.key_order(names.table)})")
        return [current, deleted]

    def changed_keys(self, names: TableNames, version: int, limit: int) -> Statement:
        """`changes_around`'s keys alone: those with a version above `version` (every key when a
        TRUNCATE came after it), at most `limit` + 1."""
        bind = self.bindings()
        bound = bind.version(version)
        table = names.table
        rendered = ", ".join(f"COALESCE({r}, '')" for r in self.rendered_columns(table, [c.name for c in table.key_columns]))
        return bind.statement(
            f"SELECT DISTINCT {rendered} FROM {names.live} WHERE {self.quote(VERSION_COLUMN)} > {bound} "
            f"OR {self.latest_truncation(names)} > {bound} LIMIT {int(limit) + 1}")

    def changes_around(self, names: TableNames, version: int, limit: int) -> Statement:
        """One scan of the table grouped by key, so of one set of its parts: each key's latest
        version and whether it is a tombstone, counted and collected at once. The grouping spills
        to disk past `CHANGES_GROUP_BY_BYTES` (a table of many keys keeps memory bounded)."""
        bind = self.bindings()
        bound = bind.version(version)
        v, d = self.quote(VERSION_COLUMN), self.quote(DELETED_COLUMN)
        latest, deleted, truncation = LATEST_VERSION, LATEST_DELETED, LATEST_TRUNCATION
        table = names.table
        keys = self.key_order(table)
        rendered = ", ".join(f"COALESCE({r}, '')" for r in self.rendered_columns(table, [c.name for c in table.key_columns]))
        live = f"{deleted} = 0 AND {latest} > {truncation}"
        return bind.statement(
            f"WITH {self.latest_truncation(names)} AS {truncation} "
            f"SELECT countIf({live} AND {latest} <= {bound}), countIf({live} AND {latest} > {bound}), "
            f"countIf({deleted} = 1 AND {latest} > {bound}), "
            f"groupArrayIf({int(limit) + 1})([{rendered}], {latest} > {bound} OR {truncation} > {bound}) "
            f"FROM (SELECT {keys}, max({v}) AS {latest}, argMax({d}, {v}) AS {deleted} FROM {names.live} "
            f"GROUP BY {keys}) SETTINGS max_bytes_before_external_group_by = {CHANGES_GROUP_BY_BYTES}")

    def read_changes_around(self, rows: Sequence[Sequence[Any]]) -> tuple[VersionCounts, list[tuple[str, ...]]]:
        ((below, above, tombstones, keys),) = rows
        return VersionCounts(int(below), int(above), int(tombstones)), [tuple(key) for key in keys]

    def digest_of_hashes(self, hashes: str) -> str:
        # Raw 16-byte hashes are collected (half the memory of hex) and sorted: bytes sort as their hex does.
        return f"lower(hex(MD5(arrayStringConcat(arrayMap(x -> lower(hex(x)), arraySort(groupArray({hashes})))))))"

    def latest_rows(self, names: TableNames, where: str) -> str:
        # Every stored version of the matching keys is read and the latest picked per key: FINAL
        # would drop the keys whose latest version is a tombstone.
        table = names.table
        v, d = self.quote(VERSION_COLUMN), self.quote(DELETED_COLUMN)
        renders = self.rendered_columns(table, [c.name for c in table.key_columns])
        aliases = [self.quote(f"_siphon_digest_key_{i}") for i in range(len(renders))]
        keys = ", ".join(f"COALESCE({r}, '') AS {a}" for r, a in zip(renders, aliases, strict=True))
        grouped = ", ".join(aliases)
        h, ver, dl = DIGEST_HASH, DIGEST_VERSION, DIGEST_DELETED
        return (f"SELECT {grouped}, argMax({h}, {ver}), toString(max({ver})), argMax({dl}, {ver}), "
                f"(SELECT toString(max({v})) FROM {names.truncations}) FROM ("
                f"SELECT {keys}, {self.md5_hex(self.row_text(table))} AS {h}, {v} AS {ver}, {d} AS {dl} "
                f"FROM {names.live} WHERE {where}) GROUP BY {grouped}")
