"""A targeted repair: rows a target holds wrongly, named by primary key, brought back to the source's.

Keys the source still has are re-snapshotted with the block ranges (partitions) holding them, as
any snapshot is. Keys the source no longer has get a tombstone whose version is exact: their
absence is read under the snapshot a temporary slot exports, so the tombstone carries that slot's
(consistent point, 0), like a snapshot's rows, and a later re-insert (a greater version) wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import dagster as dg
import pyarrow as pa
from psycopg import sql

from siphon_core import naming
from siphon_core.config import SiphonConfig
from siphon_dagster import runs, source
from siphon_dagster.partitions import BlockRange
from siphon_dagster.snapshot.load import current_columns, ensure_target_table
from siphon_dagster.snapshot.reader import exported_snapshot, snapshot_transaction
from siphon_dagster.specs import TableSpec
from siphon_dagster.targets import build_target
from siphon_dagster.targets.base import TableSchema, change_batch_schema

Key = tuple[str | None, ...]


class RepairError(ValueError):
    """Keys that cannot be repaired as given (wrong width, NULL in the key); the message names them."""


@dataclass
class RepairSummary:
    table: str
    target: str
    keys: int
    found: int = 0
    tombstoned: int = 0
    partitions: list[str] = field(default_factory=list)
    consistent_point: str = ""
    runs: list[runs.RunOutcome] = field(default_factory=list)

    @property
    def success(self) -> bool:
        return all(run.success for run in self.runs)

    def text(self) -> str:
        failed = [f"{r.run_id} ({r.error})" if r.error else r.run_id for r in self.runs if not r.success]
        return (f"{self.table} at {self.target}: {self.keys} keys, {self.found} at the source re-snapshotted with "
                f"{len(self.partitions)} partitions ({', '.join(self.partitions) or 'none'}) in {len(self.runs)} "
                f"runs, {self.tombstoned} tombstoned as of {self.consistent_point or '-'}"
                + (f"; failed runs: {', '.join(failed)}" if failed else ""))


def _check_keys(spec: TableSpec, table: TableSchema, keys: Sequence[Key]) -> None:
    width = len(table.key_columns)
    if not width:
        raise RepairError(f"{spec.qualified_name} has no primary key at the source; nothing can be repaired by key")
    names = [c.name for c in table.key_columns]
    for key in keys:
        if len(key) != width:
            raise RepairError(f"{spec.qualified_name}: key {key!r} has {len(key)} values; the primary key is {names}")
        if any(value is None for value in key):
            raise RepairError(f"{spec.qualified_name}: key {key!r} holds a NULL; primary key columns {names} cannot")


def _locate(connection: object, table: TableSchema, keys: Sequence[Key]) -> tuple[dict[Key, int], list[Key]]:
    """Each key's block at the source, or its absence. Values are sent untyped, so PostgreSQL reads
    them as the key column's own type (its index serves the lookup)."""
    key_columns = [c.name for c in table.key_columns]
    statement = sql.SQL("select ctid::text from {} where {}").format(
        sql.Identifier(table.schema, table.table),
        sql.SQL(" and ").join(sql.SQL("{} = %s").format(sql.Identifier(name)) for name in key_columns))
    found: dict[Key, int] = {}
    absent: list[Key] = []
    for key in keys:
        row = connection.execute(statement, key).fetchone()  # type: ignore[attr-defined]
        if row is None:
            absent.append(key)
        else:
            found[key] = int(row[0].strip("()").split(",")[0])
    return found, absent


def _tombstones(table: TableSchema, keys: Sequence[Key], version: int) -> pa.Table:
    schema = change_batch_schema(table)
    key_index = {c.name: i for i, c in enumerate(table.key_columns)}
    columns = [pa.array([key[key_index[c.name]] if c.name in key_index else None for key in keys], pa.string())
               for c in table.columns]
    columns.append(pa.array([version] * len(keys), schema.field(len(table.columns)).type))
    columns.append(pa.array([True] * len(keys), pa.bool_()))
    return pa.Table.from_arrays(columns, schema=schema)


def repair_keys(config: SiphonConfig, spec: TableSpec, target: str, keys: list[Key],
                instance: dg.DagsterInstance) -> RepairSummary:
    """Brings `keys` (primary keys as PostgreSQL text, in key column order) of `spec`'s table at
    `target` back to the source's rows: re-snapshots the partitions holding those the source has,
    tombstones the others. Snapshot runs go through Dagster and are recorded by `instance`."""
    runs.choose_targets(spec, target)
    unique = list(dict.fromkeys(tuple(key) for key in keys))
    summary = RepairSummary(spec.qualified_name, target, len(unique))
    dsn = config.source.conninfo(snapshot=True)
    with source.connect(dsn, autocommit=True) as catalog:
        # With what rows older than each column hold: a column the target lacks yet is added filled.
        table, existing = current_columns(catalog, spec.table)
    _check_keys(spec, table, unique)
    if not unique:
        return summary
    with exported_snapshot(dsn, table=spec.qualified_name,
                           wait_limit_seconds=config.source.snapshot_wait_limit_seconds) as slot, \
            snapshot_transaction(dsn, slot.snapshot_name, spec.schema, spec.name) as connection:
        found, absent = _locate(connection, table, unique)
        consistent_point = slot.consistent_point
    summary.found, summary.consistent_point = len(found), naming.format_lsn(consistent_point)
    if absent:
        destination = build_target(target, config)
        try:
            ensure_target_table(destination, target)(table, existing)
            summary.tombstoned = destination.apply_rows(
                table, _tombstones(table, absent, naming.row_version(consistent_point, 0)))
        finally:
            destination.close()
    if found:
        size = spec.table.blocks_per_partition
        wanted = sorted({BlockRange(b // size * size, b // size * size + size - 1).key for b in found.values()})
        runs.refresh_partitions(instance, config, [spec])
        summary.partitions = wanted
        summary.runs = runs.snapshot(config, spec, target, runs.contiguous_spans(instance, spec, wanted), instance)
    return summary
