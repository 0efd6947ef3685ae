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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import dagster as dg
from pydantic import Field

from siphon_core import naming
from siphon_dagster import source
from siphon_dagster.assets import wait_reporter
from siphon_dagster.partitions import ranges_for
from siphon_dagster.resources import PostgresResource
from siphon_dagster.resync_requests import RESYNC_OP_NAME, RESYNC_TAG, tables_resync_job_name
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


def refuse_concurrent_resync(instance: dg.DagsterInstance, spec: TableSpec, run_id: str) -> None:
    """Fails when another resync run of this table (its `resync_<table>` job or `<group>_resync`
    naming it) started before this one and has not ended."""
    this = instance.get_run_record_by_id(run_id)
    created = this.create_timestamp if this is not None else None
    # By tag, and by the table's own job for a run made without its job's tags.
    filters = (dg.RunsFilter(tags={RESYNC_TAG: spec.qualified_name}, statuses=IN_PROGRESS),
               dg.RunsFilter(job_name=spec.resync_job_name, statuses=IN_PROGRESS))
    records = {r.dagster_run.run_id: r for runs in filters for r in instance.get_run_records(runs, limit=20)}
    others = [r for r in records.values()
              if r.dagster_run.run_id != run_id and (created is None or r.create_timestamp <= created)]
    if others:
        ids = ", ".join(r.dagster_run.run_id for r in others)
        raise dg.Failure(description=f"{spec.resync_job_name}: another resync of this table is running (run {ids}); "
                                     "wait for it to end, or terminate it, before starting another")


def resync_lock_key(spec: TableSpec) -> str:
    """What the table's resync lock is keyed by (hashed to PostgreSQL's 64-bit advisory key)."""
    return f"siphon resync {spec.application_identifier} {spec.qualified_name}"


@contextmanager
def resync_lock(dsn: str, spec: TableSpec) -> Iterator[None]:
    """Holds the table's resync lock, a PostgreSQL advisory lock of the source's, for the rebuild.
    The run records keep apart the resyncs whose table is known when the run is created; a
    `<group>_resync` run launched from the UI names its table only once it starts, and two such
    runs started at once could otherwise both find the other not yet tagged. The lock is the
    session's: a process that dies releases it with its connection."""
    with source.connect(dsn, autocommit=True) as connection:
        held = connection.execute("select pg_try_advisory_lock(hashtextextended(%s, 0))",
                                  (resync_lock_key(spec),)).fetchone()
        if not held or not held[0]:
            raise dg.Failure(description=f"{spec.resync_job_name}: another resync of this table is running (it "
                                         "holds the table's resync lock at the source); wait for it to end, or "
                                         "terminate it, before starting another")
        yield


def rebuild_table(context: dg.OpExecutionContext, spec: TableSpec, targets_asked: list[str] | None,
                  checks_after: ChecksAfter | None) -> None:
    """What a resync run does, whichever job it is of: rebuilds `spec` at the asked targets (all of
    its own by default), records each rebuild on the target asset, then runs the table's checks."""
    # Tagged as snapshot runs are: the partitions sensor fails this run if its process dies, so
    # that a resync killed outright does not make every later one refuse to start.
    context.instance.add_run_tags(context.run_id, {WORKER_TAG: worker_identity(), SNAPSHOT_RUN_TAG: "true",
                                                   RESYNC_TAG: spec.qualified_name, **spec.tags})
    refuse_concurrent_resync(context.instance, spec, context.run_id)
    targets = list(targets_asked or spec.targets)
    unknown = [t for t in targets if t not in spec.targets]
    if unknown:
        raise dg.Failure(description=f"{spec.resync_job_name}: {spec.qualified_name} does not go to target(s) "
                                     f"{unknown}; its targets are {list(spec.targets)}")
    source_resource: PostgresResource = context.resources.source
    with resync_lock(source_resource.dsn, spec):
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


def build_resync_job(spec: TableSpec, checks_after: ChecksAfter | None = None) -> dg.JobDefinition:
    """`resync_<table>`: rebuilds this one table (run by name; see `resync_requests`)."""
    resource_keys = {f"{target}_target" for target in spec.targets}

    @dg.op(name=resync_op_name(spec), required_resource_keys={"source", *resource_keys},
           description=f"Rebuilds {spec.qualified_name} at its targets from a full snapshot into a shadow table, "
                       "swapped in at once; the stream goes on meanwhile.")
    def _resync(context: dg.OpExecutionContext, config: ResyncRunConfig) -> None:
        rebuild_table(context, spec, config.targets, checks_after)

    @dg.job(name=spec.resync_job_name, tags={RESYNC_TAG: spec.qualified_name, **spec.tags},
            description=f"Rebuilds {spec.qualified_name} at every target it goes to (run config "
                        f"`ops: {{{resync_op_name(spec)}: {{config: {{targets: [clickhouse]}}}}}}` narrows it), "
                        "without downtime for readers.")
    def _job() -> None:
        _resync()

    return _job


class TablesResyncRunConfig(dg.Config):
    """`ops: {rebuild: {config: {table: public.notes, targets: [clickhouse]}}}`."""

    table: str = Field(description="the table to rebuild, as siphon.yaml names it (`public.notes`)")
    targets: list[str] | None = Field(default=None, description="only these of its targets (default: every one)")


def build_tables_resync_job(specs: list[TableSpec], group: str,
                            checks_after: ChecksAfter | None = None) -> dg.JobDefinition:
    """`<group>_resync`: rebuilds the table its run config names; the sensors' and the UI's way to
    a resync (`resync_requests`)."""
    by_name = {spec.qualified_name: spec for spec in specs}
    targets = sorted({target for spec in specs for target in spec.targets})
    name = tables_resync_job_name(group)

    @dg.op(name=RESYNC_OP_NAME, required_resource_keys={"source", *(f"{target}_target" for target in targets)},
           description="Rebuilds the table named in its config at its targets from a full snapshot into a shadow "
                       "table, swapped in at once; the stream goes on meanwhile.")
    def _rebuild(context: dg.OpExecutionContext, config: TablesResyncRunConfig) -> None:
        spec = by_name.get(config.table)
        if spec is None:
            raise dg.Failure(description=f"{name}: table {config.table!r} is not configured; the configured tables "
                                         f"are {', '.join(repr(n) for n in sorted(by_name))}")
        rebuild_table(context, spec, config.targets, checks_after)

    @dg.job(name=name, tags=specs[0].tags if specs else {},
            description="Rebuilds one table at every target it goes to, without downtime for readers: run config "
                        f"`ops: {{{RESYNC_OP_NAME}: {{config: {{table: public.notes}}}}}}` names it "
                        "(`targets: [clickhouse]` narrows it). Each table's `resync_<table>` job does the same "
                        "from the command line.")
    def _job() -> None:
        _rebuild()

    return _job
