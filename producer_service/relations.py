"""Column metadata per relation id, built from pgoutput Relation messages and the catalog.

A Relation message names columns, type oids and the replica-identity key; the catalog adds what
consumers also need: the readable type name, nullability and the table's real primary key (under
REPLICA IDENTITY FULL every column is flagged as key). Excluded columns are dropped here once,
so nothing downstream ever sees them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import psycopg

from siphon_core.wire import siphon_pb2 as pb

_CATALOG_QUERY = """
select a.attname, format_type(a.atttypid, a.atttypmod), not a.attnotnull,
       coalesce(a.attnum = any(i.indkey), false)
from pg_attribute a
left join pg_index i on i.indrelid = a.attrelid and i.indisprimary
where a.attrelid = %s and a.attnum > 0 and not a.attisdropped
"""


@dataclass(frozen=True)
class RelationInfo:
    relation_id: int
    schema: str
    table: str
    columns: tuple[pb.Column, ...]
    # Indexes into the pgoutput tuple to keep, or None when every column is kept.
    keep_indexes: tuple[int, ...] | None
    replica_identity: str

    @cached_property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    @cached_property
    def columns_wire(self) -> bytes:
        """The column list as `Package.columns` entries, serialized once per column list."""
        return pb.Package(columns=self.columns).SerializeToString()


class RelationCatalog:
    def __init__(self, connection: psycopg.Connection[Any], excluded: dict[tuple[str, str], set[str]]) -> None:
        self._connection = connection
        self._excluded = excluded
        self._relations: dict[int, RelationInfo] = {}

    def update(self, message: Any) -> RelationInfo:
        """Records a Relation message (sent before first use and after every schema change)."""
        catalog = {row[0]: row[1:] for row in self._connection.execute(_CATALOG_QUERY, (message.relation_id,))}
        excluded = self._excluded.get((message.namespace, message.name), set())
        any_primary_key = any(info[2] for info in catalog.values())
        columns: list[pb.Column] = []
        keep: list[int] = []
        for index, column in enumerate(message.columns):
            if column.name in excluded:
                continue
            keep.append(index)
            type_name, nullable, in_primary_key = catalog.get(column.name, (f"oid:{column.type_oid}", True, False))
            is_key = bool(in_primary_key) if any_primary_key else bool(column.flags & 1)
            columns.append(pb.Column(
                name=column.name, type_oid=column.type_oid, type_name=type_name,
                primary_key=is_key, type_modifier=column.type_modifier, nullable=bool(nullable),
            ))
        info = RelationInfo(
            relation_id=message.relation_id,
            schema=message.namespace,
            table=message.name,
            columns=tuple(columns),
            keep_indexes=None if len(keep) == len(message.columns) else tuple(keep),
            replica_identity=message.replica_identity,
        )
        self._relations[message.relation_id] = info
        return info

    def get(self, relation_id: int) -> RelationInfo:
        try:
            return self._relations[relation_id]
        except KeyError:
            raise RuntimeError(f"change for relation {relation_id} arrived before its Relation message") from None
