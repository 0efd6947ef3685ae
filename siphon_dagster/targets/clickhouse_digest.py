"""ClickHouse's statements of the checks: counts around a version, a bucket's digest, a key's
latest row. The rest of the checks' SQL is shared (`sql_dialect.SqlDialect`); values are rendered
back to PostgreSQL's text by the type mapping, so the row hashes are those PostgreSQL computes
(siphon_dagster.checks.digest).
"""

from __future__ import annotations

from siphon_dagster.checks.digest import SEPARATOR_CODE
from siphon_dagster.targets.base import DELETED_COLUMN, VERSION_COLUMN
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.sql_dialect import (
    DIGEST_DELETED,
    DIGEST_HASH,
    DIGEST_VERSION,
    SqlDialect,
    Statement,
)


class ClickHouseCheckStatements(SqlDialect):
    """The check hooks of `clickhouse_sql.ClickHouseDialect`."""

    separator = f"char({SEPARATOR_CODE})"

    def version_counts(self, names: TableNames, version: int) -> list[Statement]:
        """Current rows at or below / above the version; then keys whose latest version is a
        tombstone above it (only rows above it are grouped: a key's latest version above it is
        among them)."""
        bind = self.bindings()
        bound = bind.version(version)
        v, d = self.quote(VERSION_COLUMN), self.quote(DELETED_COLUMN)
        current = bind.statement(f"SELECT countIf({v} <= {bound}), countIf({v} > {bound}) FROM {names.view}")
        alias = DIGEST_DELETED
        deleted = bind.statement(f"SELECT countIf({alias} = 1) FROM (SELECT argMax({d}, {v}) AS {alias} "
                                 f"FROM {names.live} WHERE {v} > {bound} GROUP BY {self.key_order(names.table)})")
        return [current, deleted]

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
