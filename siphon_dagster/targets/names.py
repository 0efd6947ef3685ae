"""The names of a replicated table's objects in a target, quoted the way that target quotes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from siphon_core.naming import current_view_name, target_table_name
from siphon_dagster.targets.base import TableSchema, shadow_table_name, truncations_table_name

# The objects a replicated table has in a target, by role, and how each is named from (schema, table).
OBJECTS: dict[str, Callable[[str, str], str]] = {
    "live": target_table_name,
    "shadow": shadow_table_name,  # filled by a resync, then swapped in
    "truncations": truncations_table_name,
    "view": current_view_name,  # current rows
}


class _Reference:
    """`names.<role>`: the qualified, quoted reference of the object with that role."""

    def __set_name__(self, owner: type, role: str) -> None:
        self.role = role

    def __get__(self, names: TableNames, owner: type | None = None) -> str:
        return names.qualified(names.bare(self.role))


@dataclass(frozen=True)
class TableNames:
    """The table's objects (`OBJECTS`) inside `namespace`: the database, and the schema where the
    target has one."""

    table: TableSchema
    target: str  # "clickhouse", "snowflake": for messages
    namespace: tuple[str, ...]
    quote: Callable[[str], str]

    live = _Reference()
    shadow = _Reference()
    truncations = _Reference()
    view = _Reference()

    def bare(self, role: str) -> str:
        """The unquoted name of the object with that role (what a catalog is asked about)."""
        return OBJECTS[role](self.table.schema, self.table.table)

    def qualified(self, name: str) -> str:
        return ".".join(self.quote(part) for part in (*self.namespace, name))

    @property
    def table_name(self) -> str:
        return self.bare("live")

    @property
    def location(self) -> str:
        return f"{self.target} {'.'.join(self.namespace)}"

    def describe(self, what: str) -> str:
        return f"{self.location}.{self.table_name} ({self.table.schema}.{self.table.table}): {what}"
