"""The asset factory: for one table spec, its observable source asset and one snapshot asset per target.

A target asset's partition is a block range; materializing it re-snapshots exactly that range
(see siphon_dagster.snapshot.reader for why any order of ranges converges with the stream).
"""


from collections.abc import Callable, Sequence
from typing import Any

import dagster as dg

from siphon_core import naming
from siphon_dagster import source
from siphon_dagster.partitions import parse_key
from siphon_dagster.resources import PostgresResource
from siphon_dagster.run_liveness import SNAPSHOT_RUN_TAG, WORKER_TAG, worker_identity
from siphon_dagster.snapshot.blockers import WaitReport
from siphon_dagster.snapshot.load import ensure_target_table, load_ranges
from siphon_dagster.snapshot.pool_slots import extra_slots
from siphon_dagster.snapshot.reader import SnapshotProgress
from siphon_dagster.specs import TableSpec
from siphon_dagster.targets.base import TableSchema

SNAPSHOT_POOL_PREFIX = "siphon_snapshot"
FIRST_LOADS_PREFIX = "siphon_loads"


def snapshot_pool(target: str) -> str:
    """The pool that caps one target's concurrent snapshot partitions (`siphon_snapshot_clickhouse`):
    one pool per target, so that loads into a slow target never hold the slots a fast one waits
    for; each reads the source only while its COPY runs (the spool takes the rest)."""
    return f"{SNAPSHOT_POOL_PREFIX}_{target}"


def column_schema_metadata(table: TableSchema) -> dg.TableSchema:
    return dg.TableSchema(columns=[
        dg.TableColumn(name=c.name, type=c.type_name, description="primary key" if c.primary_key else None,
                       constraints=dg.TableColumnConstraints(nullable=c.nullable, unique=False))
        for c in table.columns
    ])


def build_source_asset(spec: TableSpec) -> dg.AssetSpec:
    """The PostgreSQL table as an external asset; the partitions sensor records its observations."""
    return dg.AssetSpec(
        key=spec.source_key,
        group_name=spec.group,
        description=f"PostgreSQL table {spec.qualified_name}, replicated by application "
                    f"{spec.application_identifier}. Observed every 10 minutes, and when its column list "
                    "changes: blocks, bytes, row estimate, columns and the source's current LSN.",
        kinds={"postgres"},
        tags=spec.tags,
    )


def source_observation(spec: TableSpec, size: source.TableSize, lsn: int, table: TableSchema) -> dg.AssetObservation:
    """The source table as the partitions sensor read it: its size, the source's LSN then, its columns."""
    return dg.AssetObservation(
        asset_key=spec.source_key,
        metadata={
            "blocks": size.blocks,
            "bytes": dg.MetadataValue.int(size.bytes),
            "row_estimate": size.row_estimate,
            "current_lsn": naming.format_lsn(lsn),
            "dagster/column_schema": column_schema_metadata(table),
        },
    )


def build_target_asset(spec: TableSpec, target: str) -> dg.AssetsDefinition:
    resource_key = f"{target}_target"

    # Op, input and output names must be Python identifiers; asset keys keep the source's spelling.
    @dg.multi_asset(
        name=f"snapshot_{spec.job_suffix}_{target}",
        ins={"source_table": dg.AssetIn(key=spec.source_key, dagster_type=dg.Nothing)},
        partitions_def=spec.partitions_def,
        # The CLI's --partition-range needs single-run backfills; the run walks the ranges itself.
        backfill_policy=dg.BackfillPolicy.single_run(),
        pool=snapshot_pool(target),
        outs={"snapshot": dg.AssetOut(
        key=spec.target_key(target),
        group_name=spec.group,
        kinds={target},
        tags=spec.tags,
        description=(f"{spec.qualified_name} in {target}: every version of every row "
                     f"({naming.target_table_name(spec.schema, spec.name)}) and the current rows "
                     f"({naming.current_view_name(spec.schema, spec.name)}). A partition is a block range of "
                     "the source table: materializing it re-snapshots exactly those blocks; the streaming job "
                     f"{spec.stream_job_name(target)} keeps the table fresh in between."),
        )},
        required_resource_keys={"source", resource_key},
    )
    def _snapshot(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        # One run may cover a range of partitions (CLI --partition-range, or a backfill): each block
        # range is read under its own temporary slot, as many at a time as the pool has slots for
        # (see snapshot.pool_slots), so memory and the time a snapshot is held stay those of a range.
        # A run killed outright stays STARTED and keeps its pool slot; the partitions sensor fails
        # it once this process is gone, and the daemon then frees the slot.
        context.instance.add_run_tags(context.run_id, {WORKER_TAG: worker_identity(), SNAPSHOT_RUN_TAG: "true"})
        return dg.MaterializeResult(metadata=load_partitions(context, spec, target, context.partition_keys))

    return _snapshot


def load_partitions(context: dg.OpExecutionContext, spec: TableSpec, target: str,
                    keys: Sequence[str]) -> dict[str, Any]:
    """Snapshots the partitions `keys` of `spec` into `target`, as many block ranges at a time as
    the target's pool gives slots for; the metadata of their materialization."""
    resource_key = f"{target}_target"
    ranges = [parse_key(key, spec.table.blocks_per_partition) for key in keys]
    source_resource: PostgresResource = context.resources.source
    destination = getattr(context.resources, resource_key).open_target()

    def report(p: SnapshotProgress) -> None:
        context.log.info(f"{spec.qualified_name}: {p.rows:,} rows, {p.bytes / 1e6:,.1f} MB, "
                         f"{p.rows / p.seconds:,.0f} rows/s")

    pool = snapshot_pool(target)
    step_key = context.get_step_execution_context().step.key
    try:
        with extra_slots(context.instance, pool, context.run_id, step_key, len(ranges) - 1) as parallel:
            if parallel > 1:
                context.log.info(f"reading {len(ranges)} partitions {parallel} at a time (pool {pool})")
            summary = load_ranges(source_resource.snapshot_settings(), spec.table, ranges, destination,
                                  ensure=ensure_target_table(destination, target, context.log.warning),
                                  on_progress=report, on_info=context.log.info, on_warning=context.log.warning,
                                  on_blocked=wait_reporter(context, spec.target_key(target)),
                                  parallel=parallel, open_destination=getattr(context.resources,
                                                                              resource_key).open_target)
    finally:
        destination.close()
    report(summary.progress)
    progress = summary.progress
    return {
        "dagster/row_count": progress.rows,
        "dagster/column_schema": column_schema_metadata(summary.table) if summary.table is not None else None,
        "first_block": ranges[0].first_block,
        "last_block": ranges[-1].last_block,
        "partitions": len(ranges),
        "consistent_point": summary.consistent_point_text,
        "bytes": dg.MetadataValue.int(progress.bytes),
        "rows_per_second": round(progress.rows / progress.seconds, 1),
        "seconds": round(progress.seconds, 3),
        "retried_ranges": summary.retries,
        **({"load_path": load_path} if (load_path := getattr(destination, "last_load_path", None)) else {}),
    }


def first_loads_key(target: str) -> dg.AssetKey:
    """The asset of `target`'s shared load runs (no table's key: those are `<target>/<schema>/<table>`
    and targets are named after their kind)."""
    return dg.AssetKey([FIRST_LOADS_PREFIX, target])


class FirstLoadsConfig(dg.Config):
    """The tables a shared load run snapshots (qualified names), each its one partition; none when
    the asset is materialized by hand without them (with the group's other assets)."""

    tables: list[str] = []
    partitions: list[str] = []


def build_first_loads_asset(specs: Sequence[TableSpec], target: str, group: str) -> dg.AssetsDefinition:
    """`<prefix>/<target>`: one run loads many small tables, each a single partition, one after another
    under one slot of the target's snapshot pool, and records each table's partition materialized
    on the table's own asset (the snapshot sensor asks for it, `snapshots.tables_per_load_run`). A
    table that fails is named and the others go on; the run then fails, and the sensor loads the
    table in a run of its own."""
    by_name = {spec.qualified_name: spec for spec in specs if target in spec.targets}

    @dg.asset(
        key=first_loads_key(target),
        group_name=group,
        kinds={target},
        pool=snapshot_pool(target),
        required_resource_keys={"source", f"{target}_target"},
        description=f"Loads of small tables into {target}, many to a run: each table's partition is "
                    "materialized on the table's own asset.",
    )
    def _first_loads(context: dg.AssetExecutionContext, config: FirstLoadsConfig) -> dg.MaterializeResult:
        context.instance.add_run_tags(context.run_id, {WORKER_TAG: worker_identity(), SNAPSHOT_RUN_TAG: "true"})
        if len(config.tables) != len(config.partitions):
            raise dg.Failure(f"{len(config.tables)} tables but {len(config.partitions)} partitions in the run's config")
        unknown = [name for name in config.tables if name not in by_name]
        if unknown:  # taken out of siphon.yaml since the run was asked for: nothing of theirs to load
            context.log.warning(f"not configured for {target} (any more), so not loaded: {', '.join(unknown)}")
        failed: list[str] = []
        for name, key in zip(config.tables, config.partitions, strict=True):
            spec = by_name.get(name)
            if spec is None:
                continue
            try:
                metadata = load_partitions(context, spec, target, [key])
            except Exception as error:  # the other tables still load; this one loads alone later
                context.log.error(f"{name}: partition {key} not loaded: {' '.join(str(error).split())}")
                failed.append(name)
                continue
            context.log_event(dg.AssetMaterialization(asset_key=spec.target_key(target), partition=key,
                                                      metadata=metadata))
        if failed:
            raise dg.Failure(f"{len(failed)} of {len(config.tables)} tables not loaded: {', '.join(failed)}",
                             metadata={"failed_tables": failed})
        return dg.MaterializeResult(metadata={"tables": len(config.tables)})

    return _first_loads


def wait_reporter(context: dg.OpExecutionContext, asset_key: dg.AssetKey) -> Callable[[WaitReport], None]:
    """Says in the run's log, and on the asset at once, which transactions a snapshot waits for.

    The report comes from a watching thread while the step is blocked: an event logged through the
    step would only be written when the step ends, so the observation goes to the instance directly.
    """

    def on_blocked(report: WaitReport) -> None:
        context.log.warning(report.text())
        context.instance.report_runless_asset_event(dg.AssetObservation(
            asset_key=asset_key,
            description=f"run {context.run_id}: snapshot waiting for older transactions to end",
            metadata={"snapshot_wait": dg.MetadataValue.json(report.metadata()),
                      "blocking_pids": dg.MetadataValue.text(", ".join(str(b.pid) for b in report.blockers)),
                      "run_id": context.run_id}))

    return on_blocked


