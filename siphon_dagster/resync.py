"""`resync_<table>`: rebuilds a table at its targets from a full snapshot, without downtime for readers.

At each target: a shadow table is created beside the live one, every block range of the table is
snapshotted into it while the stream goes on, and the shadow is swapped in at once. Readers of the
current-rows view see the old table until the swap and the rebuilt one after it; rows the target
kept wrongly (deleted at the source, changed by hand) do not survive.

Why no stream change is lost: every write of the stream (`apply_rows`, `tombstone_all`) and of a
live snapshot looks up whether the shadow exists when it is applied, and then writes to the shadow
and the live table; a stream write may use a look-up up to `streaming.shadow_lookup_seconds` old
(one per batch cost the target a statement). The shadow is created, and that long and 2 s more
have passed, before any range's slot is: a change with a version above a range's consistent point
committed after that slot was created, and the stream can only apply a change once it is
committed, so its look-up was made after the shadow existed: it finds the shadow and writes the
change there too. Changes at or below the consistent point are in the range's snapshot. Rows in
blocks past the size read after the shadow was created were written after it existed, so the
stream brings them. Around the swap, a write goes to the shadow first and the live table second:
if the swap comes between the two, the first reached the table that becomes live; if it comes
before both, the second does (a shadow gone by then is skipped, and one whose name the previous
table holds for a moment, in a swap by renames, is written harmlessly). If the target fails the write,
the stream applies it again (it acks only what a target committed).
"""


import time
from collections.abc import Callable
from dataclasses import dataclass

import dagster as dg

from siphon_core import naming
from siphon_dagster import source
from siphon_dagster.assets import wait_reporter
from siphon_dagster.partitions import ranges_for
from siphon_dagster.resources import PostgresResource
from siphon_dagster.run_liveness import SNAPSHOT_RUN_TAG, WORKER_TAG, worker_identity
from siphon_dagster.sensors import IN_PROGRESS
from siphon_dagster.snapshot.blockers import WaitReport
from siphon_dagster.snapshot.load import (
    LoadSummary,
    SnapshotSettings,
    current_columns,
    ensure_target_table,
    load_ranges,
)
from siphon_dagster.snapshot.reader import SnapshotProgress
from siphon_dagster.specs import TableSpec
from siphon_dagster.targets.base import TableSchema, Target

RESYNC_TAG = "siphon/resync"
REPLAY_WAIT_SECONDS = 600.0
SHADOW_SETTLE_MARGIN_SECONDS = 2.0


class ResyncRunConfig(dg.Config):
    """`ops: {rebuild_<table>: {config: {targets: [clickhouse]}}}` rebuilds at the named targets only."""

    targets: list[str] | None = None


def resync_op_name(spec: TableSpec) -> str:
    """`rebuild_notes`: the op of `resync_notes`, to address in run config."""
    return f"rebuild_{spec.job_suffix}"


# What a resync ends with: the rebuilt table's checks at the given targets, recorded on the assets;
# returns the lines of the ERROR checks that failed (none: the rebuild is proven).
ChecksAfter = Callable[[dg.OpExecutionContext, TableSpec, list[str]], list[str]]


@dataclass(frozen=True)
class ResyncResult:
    target: str
    rows: int  # current rows once swapped in
    snapshot: LoadSummary
    ranges: int


def rebuild_target(settings: SnapshotSettings, primary_dsn: str, spec: TableSpec, target: str, destination: Target,
                   *, on_info: Callable[[str], None], on_warning: Callable[[str], None],
                   on_progress: Callable[[SnapshotProgress], None] | None = None,
                   on_blocked: Callable[[WaitReport], None] | None = None) -> ResyncResult:
    """Shadow, every block range into it, swap: see the module's docstring for why nothing is lost."""
    ensure = ensure_target_table(destination, target, on_warning)
    with source.connect(primary_dsn, autocommit=True) as catalog:
        columns, existing = current_columns(catalog, spec.table)
        ensure(columns, existing)  # the live table exists and has the source's columns, so the shadow does too
        destination.create_shadow(columns)
        try:
            _wait_for_streaming_runs(spec, on_info)
            _wait_for_replay(primary_dsn, settings.dsn, on_info)
            # The size is read after the shadow exists: rows in later blocks were written after it.
            size = source.table_size(catalog, spec.table)
        except BaseException:
            _abandon(destination, spec, target, columns, on_warning)
            raise
    ranges = ranges_for(size.blocks, spec.table.blocks_per_partition)
    on_info(f"resync of {spec.qualified_name} at {target}: {len(ranges)} block ranges into "
            f"{naming.target_table_name(spec.schema, spec.name)}__resync")
    try:
        summary = load_ranges(settings, spec.table, ranges, destination, shadow=True, ensure=ensure,
                              on_progress=on_progress, on_info=on_info, on_warning=on_warning, on_blocked=on_blocked)
        final = summary.table or columns
        destination.swap_shadow(final)
    except BaseException:
        _abandon(destination, spec, target, columns, on_warning)
        raise
    return ResyncResult(target, destination.count_current(final), summary, len(ranges))


def _abandon(destination: Target, spec: TableSpec, target: str, columns: TableSchema,
             on_warning: Callable[[str], None]) -> None:
    try:  # else every stream batch would go on writing to an abandoned shadow
        destination.drop_shadow(columns)
    except Exception as error:
        on_warning(f"dropping the resync table of {spec.qualified_name} at {target} failed: {error}; "
                   "the next resync replaces it")


def _wait_for_streaming_runs(spec: TableSpec, on_info: Callable[[str], None]) -> None:
    """A streaming run trusts its look-up of the shadow for `streaming.shadow_lookup_seconds`:
    once that has passed since the shadow was created, every write of a change committed from
    now on finds it."""
    seconds = spec.streaming.shadow_lookup_seconds
    if seconds > 0:
        on_info(f"waiting {seconds + SHADOW_SETTLE_MARGIN_SECONDS:.0f}s for streaming runs to see the resync table "
                f"of {spec.qualified_name} (streaming.shadow_lookup_seconds)")
        time.sleep(seconds + SHADOW_SETTLE_MARGIN_SECONDS)


def _wait_for_replay(primary_dsn: str, snapshot_dsn: str, on_info: Callable[[str], None]) -> None:
    """With snapshots read from a standby, a slot's consistent point is a position the standby has
    replayed: it must be past every change committed before the shadow existed (else a change
    applied to the live table only could be missing from the snapshot too)."""
    if snapshot_dsn == primary_dsn:
        return
    with source.connect(primary_dsn, autocommit=True) as primary:
        target_lsn = source.current_lsn(primary)
    deadline = time.monotonic() + REPLAY_WAIT_SECONDS
    with source.connect(snapshot_dsn, autocommit=True) as standby:
        while True:
            row = standby.execute("select pg_last_wal_replay_lsn()::text").fetchone()
            if row is None or row[0] is None or naming.parse_lsn(row[0]) >= target_lsn:
                return  # not a standby, or caught up
            if time.monotonic() > deadline:
                raise RuntimeError(f"the snapshot source has not replayed {naming.format_lsn(target_lsn)} after "
                                   f"{REPLAY_WAIT_SECONDS:.0f}s (at {row[0]}); is source.snapshot_dsn a standby "
                                   "that keeps up?")
            on_info(f"waiting for the snapshot source to replay {naming.format_lsn(target_lsn)} (at {row[0]})")
            time.sleep(1.0)


def refuse_concurrent_resync(instance: dg.DagsterInstance, job_name: str, run_id: str) -> None:
    """Fails when another run of this resync job started before this one and has not ended."""
    this = instance.get_run_record_by_id(run_id)
    created = this.create_timestamp if this is not None else None
    others = [r for r in instance.get_run_records(dg.RunsFilter(job_name=job_name, statuses=IN_PROGRESS), limit=20)
              if r.dagster_run.run_id != run_id and (created is None or r.create_timestamp <= created)]
    if others:
        ids = ", ".join(r.dagster_run.run_id for r in others)
        raise dg.Failure(description=f"{job_name}: another resync of this table is running (run {ids}); "
                                     "wait for it to end, or terminate it, before starting another")


def build_resync_job(spec: TableSpec, checks_after: ChecksAfter | None = None) -> dg.JobDefinition:
    resource_keys = {f"{target}_target" for target in spec.targets}

    @dg.op(name=resync_op_name(spec), required_resource_keys={"source", *resource_keys},
           description=f"Rebuilds {spec.qualified_name} at its targets from a full snapshot into a shadow table, "
                       "swapped in at once; the stream goes on meanwhile.")
    def _resync(context: dg.OpExecutionContext, config: ResyncRunConfig) -> None:
        # Tagged as snapshot runs are: the partitions sensor fails this run if its process dies, so
        # that a resync killed outright does not make every later one refuse to start.
        context.instance.add_run_tags(context.run_id, {WORKER_TAG: worker_identity(), SNAPSHOT_RUN_TAG: "true"})
        refuse_concurrent_resync(context.instance, spec.resync_job_name, context.run_id)
        targets = list(config.targets or spec.targets)
        unknown = [t for t in targets if t not in spec.targets]
        if unknown:
            raise dg.Failure(description=f"{spec.resync_job_name}: {spec.qualified_name} does not go to target(s) "
                                         f"{unknown}; its targets are {list(spec.targets)}")
        source_resource: PostgresResource = context.resources.source
        for target in targets:
            destination: Target = getattr(context.resources, f"{target}_target").open_target()
            try:
                result = rebuild_target(
                    source_resource.snapshot_settings(), source_resource.dsn, spec, target, destination,
                    on_info=context.log.info, on_warning=context.log.warning,
                    on_progress=lambda p: context.log.info(f"{spec.qualified_name}: {p.rows:,} rows, "
                                                           f"{p.rows / p.seconds:,.0f} rows/s"),
                    on_blocked=wait_reporter(context, spec.target_key(target)))
            finally:
                destination.close()
            progress = result.snapshot.progress
            context.log.info(f"resync of {spec.qualified_name} at {target}: {progress.rows:,} rows snapshotted, "
                             f"{result.rows:,} current rows after the swap")
            context.log_event(dg.AssetMaterialization(
                asset_key=spec.target_key(target),
                description="resync: rebuilt from a full snapshot and swapped in",
                metadata={
                    "resync": True,
                    "dagster/row_count": result.rows,
                    "rows_snapshotted": progress.rows,
                    "ranges": result.ranges,
                    "consistent_point": result.snapshot.consistent_point_text,
                    "retried_ranges": result.snapshot.retries,
                    "seconds": round(progress.seconds, 3),
                }))
        if checks_after is not None:
            failed = checks_after(context, spec, targets)
            if failed:
                raise dg.Failure(description=f"{spec.resync_job_name}: the rebuilt table's checks failed:\n"
                                             + "\n".join(failed))

    @dg.job(name=spec.resync_job_name, tags={RESYNC_TAG: spec.qualified_name, **spec.tags},
            description=f"Rebuilds {spec.qualified_name} at every target it goes to (run config "
                        f"`ops: {{{resync_op_name(spec)}: {{config: {{targets: [clickhouse]}}}}}}` narrows it), "
                        "without downtime for readers.")
    def _job() -> None:
        _resync()

    return _job
