"""The names of a replicated table's objects in a target; each target supplies its own quoting."""

from __future__ import annotations

from dataclasses import dataclass

from siphon_core.naming import current_view_name, target_table_name
from siphon_dagster.targets.base import TableSchema, shadow_table_name, truncations_table_name


@dataclass(frozen=True)
class TargetTableNames:
    """Bare names (`*_name`) and qualified, quoted references of the table, its shadow, its
    truncations table and its current-rows view. Subclasses define `qualified` and `location`."""

    table: TableSchema

    def qualified(self, name: str) -> str:
        raise NotImplementedError

    @property
    def location(self) -> str:
        raise NotImplementedError

    @property
    def table_name(self) -> str:
        return target_table_name(self.table.schema, self.table.table)

    @property
    def live(self) -> str:
        return self.qualified(self.table_name)

    @property
    def shadow_name(self) -> str:
        return shadow_table_name(self.table.schema, self.table.table)

    @property
    def shadow(self) -> str:
        return self.qualified(self.shadow_name)

    @property
    def truncations_name(self) -> str:
        return truncations_table_name(self.table.schema, self.table.table)

    @property
    def truncations(self) -> str:
        return self.qualified(self.truncations_name)

    @property
    def view_name(self) -> str:
        return current_view_name(self.table.schema, self.table.table)

    @property
    def view(self) -> str:
        return self.qualified(self.view_name)

    def describe(self, what: str) -> str:
        return f"{self.location}.{self.table_name} ({self.table.schema}.{self.table.table}): {what}"
