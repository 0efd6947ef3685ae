"""Snowflake's statements of the checks: counts around a version, a bucket's digest, a key's
latest row. The rest of the checks' SQL is shared (`sql_dialect.SqlDialect`); values are rendered
back to PostgreSQL's text by the type mapping, so the row hashes are those PostgreSQL computes
(siphon_dagster.checks.digest). Versions are bound as text and cast, as everywhere in this target.
"""

from __future__ import annotations

from siphon_dagster.checks.digest import SEPARATOR_CODE
from siphon_dagster.targets.base import DELETED_COLUMN, VERSION_COLUMN
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.sql_dialect import SqlDialect, Statement


class SnowflakeCheckStatements(SqlDialect):
    """The check hooks of `snowflake_sql.SnowflakeDialect`."""

    separator = f"CHR({SEPARATOR_CODE})"

    def version_counts(self, names: TableNames, version: int) -> list[Statement]:
        """One statement over each key's newest row (as the current-rows view picks it)."""
        bind = self.bindings()
        v, d = self.quote(VERSION_COLUMN), self.quote(DELETED_COLUMN)
        live = f"NOT {d} AND {v} > {self.latest_truncation(names)}"
        conditions = (f"{live} AND {v} <= {bind.version(version)}", f"{live} AND {v} > {bind.version(version)}",
                      f"{d} AND {v} > {bind.version(version)}")
        sums = ", ".join(f"COALESCE(SUM(CASE WHEN {c} THEN 1 ELSE 0 END), 0)" for c in conditions)
        return [bind.statement(f"SELECT {sums} FROM {self.newest_rows(names)}")]

    def digest_of_hashes(self, hashes: str) -> str:
        return f"MD5(LISTAGG({hashes}, '') WITHIN GROUP (ORDER BY {hashes}))"

    def latest_rows(self, names: TableNames, where: str) -> str:
        table = names.table
        keys = ", ".join(self.rendered_columns(table, [c.name for c in table.key_columns]))
        return (f"SELECT {keys}, {self.md5_hex(self.row_text(table))}, {self.as_text(self.quote(VERSION_COLUMN))}, "
                f"{self.quote(DELETED_COLUMN)}, {self.as_text(self.latest_truncation(names))} "
                f"FROM {self.newest_rows(names)} WHERE {where}")
