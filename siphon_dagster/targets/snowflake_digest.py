"""Snowflake's statements of the checks: counts around a version, a bucket's digest, a key's
latest row. The rest of the checks' SQL is shared (`sql_dialect.SqlDialect`); values are rendered
back to PostgreSQL's text by the type mapping, so the row hashes are those PostgreSQL computes
(siphon_dagster.checks.digest). Versions are bound as text and cast, as everywhere in this target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from siphon_dagster.checks.digest import SEPARATOR_CODE
from siphon_dagster.targets.base import DELETED_COLUMN, VERSION_COLUMN, VersionCounts
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.sql_dialect import SqlDialect, Statement

NEWEST_ROWS = "_siphon_newest_rows"  # the statement's name for each key's newest row


class SnowflakeCheckStatements(SqlDialect):
    """The check hooks of `snowflake_sql.SnowflakeDialect`."""

    separator = f"CHR({SEPARATOR_CODE})"

    def changes_around(self, names: TableNames, version: int, limit: int) -> Statement:
        """The counts over each key's newest row (as the current-rows view picks it), then the
        changed keys, one per row: a statement reads one snapshot of the table."""
        bind = self.bindings()  # positional: bound in the order the text names them
        v, d = self.quote(VERSION_COLUMN), self.quote(DELETED_COLUMN)
        newest, truncation = self.quote(NEWEST_ROWS), self.latest_truncation(names)
        live = f"NOT {d} AND {v} > {truncation}"
        conditions = (f"{live} AND {v} <= {bind.version(version)}", f"{live} AND {v} > {bind.version(version)}",
                      f"{d} AND {v} > {bind.version(version)}")
        sums = ", ".join(f"COALESCE(SUM(CASE WHEN {c} THEN 1 ELSE 0 END), 0)" for c in conditions)
        table = names.table
        keys = self.rendered_columns(table, [c.name for c in table.key_columns])
        no_keys = ", ".join("NULL" for _ in keys)
        changed = f"{v} > {bind.version(version)} OR {truncation} > {bind.version(version)}"
        return bind.statement(
            f"WITH {newest} AS {self.newest_rows(names)} "
            f"SELECT 0, {sums}, {no_keys} FROM {newest} "
            f"UNION ALL SELECT * FROM (SELECT 1, NULL, NULL, NULL, {', '.join(keys)} FROM {newest} "
            f"WHERE {changed} LIMIT {int(limit) + 1})")

    def read_changes_around(self, rows: Sequence[Sequence[Any]]) -> tuple[VersionCounts, list[tuple[str, ...]]]:
        (counts,) = [row for row in rows if int(row[0]) == 0]
        keys = [tuple(str(value) for value in row[4:]) for row in rows if int(row[0]) == 1]
        return VersionCounts(int(counts[1]), int(counts[2]), int(counts[3])), keys

    def digest_of_hashes(self, hashes: str) -> str:
        return f"MD5(LISTAGG({hashes}, '') WITHIN GROUP (ORDER BY {hashes}))"

    def latest_rows(self, names: TableNames, where: str) -> str:
        table = names.table
        keys = ", ".join(self.rendered_columns(table, [c.name for c in table.key_columns]))
        return (f"SELECT {keys}, {self.md5_hex(self.row_text(table))}, {self.as_text(self.quote(VERSION_COLUMN))}, "
                f"{self.quote(DELETED_COLUMN)}, {self.as_text(self.latest_truncation(names))} "
                f"FROM {self.newest_rows(names)} WHERE {where}")
