"""The column list a micro-batch is applied under, and keeping the target's table in step with it.

The column list travels in every package. A batch is applied under the newest list it carries
(by commit LSN, so a late redelivery cannot roll the schema back); rows of older packages are
aligned to it by name, their missing columns filled like unchanged TOASTed values. A new list is
ensured at the target once: an added column is added there and filled from then on; a dropped
column stops being filled and stays at the target; a type the target cannot follow, or a new
primary key, stops the table's stream.

Rows that predate an added column get no change event for it, yet PostgreSQL may have given them a
value (ADD COLUMN ... DEFAULT). The source catalog tells which (SourceRowReader.existing_rows_values);
the target adds the column holding that value. When the catalog cannot tell (a volatile default,
an identity or generated column: PostgreSQL rewrote the table), the column is added as NULL and a
warning names the table, the column and how to repair it (`take_warnings`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from siphon_core import naming
from siphon_core.logs import get_logger
from siphon_core.wire import siphon_pb2 as pb
from siphon_dagster.source import ExistingRowsValue, backfill
from siphon_dagster.streaming.batch import Fingerprint, ReceivedPackage, column_fingerprint
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.targets.base import SourceColumn, TableSchema, Target

_log = get_logger("streaming.schema")


class SchemaChangeError(RuntimeError):
    """The source table changed in a way this table's stream cannot follow; the message says how."""


class IncompatibleSchemaError(SchemaChangeError):
    """A column's type changed in a way the target cannot follow: the table's stream stops."""


def table_schema(schema: str, table: str, columns: Sequence[pb.Column],
                 type_categories: dict[int, tuple[str, int]] | None = None) -> TableSchema:
    """The table as a package describes it; `type_categories` (oid -> typcategory, typelem) from the
    source catalog makes it identical to what the snapshot path reads."""
    categories = type_categories or {}
    return TableSchema(schema, table, tuple(
        SourceColumn(name=c.name, type_oid=c.type_oid, type_name=c.type_name, type_modifier=c.type_modifier,
                     nullable=c.nullable, primary_key=c.primary_key,
                     category=categories.get(c.type_oid, ("", 0))[0],
                     element_type_oid=categories.get(c.type_oid, ("", 0))[1])
        for c in columns
    ))


def primary_key(columns: Sequence[pb.Column]) -> tuple[str, ...]:
    return tuple(c.name for c in columns if c.primary_key)


@dataclass(frozen=True)
class _Applied:
    lsn: int
    columns: tuple[pb.Column, ...]
    fingerprint: Fingerprint


class SchemaTracker:
    """Remembers the column list last ensured at the target for one table."""

    def __init__(self, target: Target, schema: str, table: str, source: SourceRowReader | None = None) -> None:
        self.target = target
        self.schema = schema
        self.table = table
        self.source = source
        self._applied: _Applied | None = None
        self._warnings: list[str] = []
        self._created = False  # the target had no table and a batch made it

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    def resolve(self, packages: Sequence[ReceivedPackage]) -> TableSchema:
        """The column list to apply `packages` under, ensured at the target when it is new."""
        newest = max(packages, key=lambda p: p.last_commit_lsn)
        self._check_keys(packages, newest)
        applied = self._applied
        if applied is not None and applied.lsn > newest.last_commit_lsn:
            return self._schema(applied.columns)  # a replay of older packages: keep the newer list
        columns = newest.columns
        table = self._schema(columns)
        fingerprint = newest.fingerprint or column_fingerprint(columns)
        if applied is None or fingerprint != applied.fingerprint:
            self._ensure(table, applied, newest)
        self._applied = _Applied(newest.last_commit_lsn, columns, fingerprint)
        return table

    def is_current(self, packages: Sequence[ReceivedPackage]) -> bool:
        """`resolve(packages)` would change nothing at the target: their column lists are the one
        ensured last."""
        applied = self._applied
        if applied is None or not packages:
            return False
        return all((p.fingerprint or column_fingerprint(p.columns)) == applied.fingerprint for p in packages)

    def take_created(self) -> bool:
        """Whether a batch since the last call made the table at the target (then forgotten): the
        rows it held before, if any, are not there, and only a snapshot brings them back."""
        created, self._created = self._created, False
        return created

    def take_warnings(self) -> list[str]:
        """What the batches resolved since the last call need an operator for (then forgotten)."""
        warnings, self._warnings = self._warnings, []
        return warnings

    def _ensure(self, table: TableSchema, applied: _Applied | None, newest: ReceivedPackage) -> None:
        # Columns the target may lack: new since the list applied before, or any on a run's first batch.
        known = {c.name for c in applied.columns} if applied is not None else set()
        candidates = [c for c in table.columns if not c.primary_key and c.name not in known]
        existing = self.source.existing_rows_values(table, candidates) if self.source and candidates else {}
        change = self.target.ensure_table(table, backfill(existing))
        self._created = self._created or change.created
        if change.incompatible:
            raise IncompatibleSchemaError(
                f"table {self.qualified_name}: target {self.target.name} cannot follow the source's schema as "
                f"of stream sequence {newest.sequence}: {'; '.join(map(str, change.incompatible))}. The "
                f"table's stream stops here; "
                f"{naming.rebuild_advice(self.target.name, self.schema, self.table)}")
        unread = "this run has no source connection to read the catalog from" if self.source is None else \
            "the source catalog was not read for it"
        for name in change.added_columns:
            value = existing.get(name) or ExistingRowsValue(name, known=False, reason=unread)
            if not value.known:
                self._warnings.append(value.unfilled_warning(self.schema, self.table, self.target.name))
                _log.warning("rows that predate an added column hold values the stream never carried; snapshot "
                             "the table again", table=self.qualified_name, target=self.target.name, column=name,
                             reason=value.reason)

    def _schema(self, columns: Sequence[pb.Column]) -> TableSchema:
        categories = self.source.type_categories([c.type_oid for c in columns]) if self.source else None
        return table_schema(self.schema, self.table, columns, categories)

    def _check_keys(self, packages: Sequence[ReceivedPackage], newest: ReceivedPackage) -> None:
        """Every package, and the list applied before, must name the same primary key."""
        key = primary_key(newest.columns)
        if not key:
            raise SchemaChangeError(f"table {self.qualified_name}: packages name no primary key columns; Siphon "
                                    "needs a primary key on the source table")
        earlier = [(primary_key(p.columns), p.sequence) for p in packages]
        if self._applied is not None:
            earlier.append((primary_key(self._applied.columns), 0))
        for other, sequence in earlier:
            if other != key:
                where = f"stream sequence {sequence}" if sequence else "the batches applied before"
                raise SchemaChangeError(
                    f"table {self.qualified_name}: the primary key changed from {list(other)} ({where}) to "
                    f"{list(key)} (stream sequence {newest.sequence}); "
                    f"{naming.rebuild_advice(self.target.name, self.schema, self.table)}")
