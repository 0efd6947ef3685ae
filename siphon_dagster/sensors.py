"""Sensors: block-range partitions kept current as tables grow, and streaming runs kept alive."""


import asyncio
import hashlib
import json
import math
import os
import signal
import time
from collections.abc import Callable, Sequence

import dagster as dg

from siphon_dagster import source as source_db
from siphon_dagster.assets import source_observation
from siphon_dagster.config_drift import ConfigDrift
from siphon_dagster.consumer_sweep import (
    SweepPlan,
    added_again,
    forgotten_removal,
    plan_sweep,
    removal_record,
    table_consumers,
    table_id,
)
from siphon_dagster.location_reload import LocationReloader
from siphon_dagster.partitions import missing_keys, range_count
from siphon_dagster.resources import NatsResource, PostgresResource
from siphon_dagster.resync_requests import ResyncRequests
from siphon_dagster.run_liveness import (
    IN_PROGRESS,
    LAUNCHER_TAG,
    SNAPSHOT_RUN_TAG,
    dead_run_reason,
    replaced_launcher,
)
from siphon_dagster.specs import TableSpec
from siphon_dagster.stream_groups import (
    APPLICATION_TAG,
    ENDED_BY_INTERRUPT,
    ENDED_BY_TAG,
    GROUP_TAG,
    STREAM_TAG,
    TABLES_HASH_TAG,
    StreamGroup,
    lingering_streaming_runs,
    live_streaming_runs,
    served_tables,
    tables_hash,
)
from siphon_dagster.targets.base import TableSchema

# A source table is observed again after this long, or at once when its column list changed: an
# observation every minute of each of hundreds of tables kept the daemon and the code server busy
# writing events nobody reads between two looks at the UI.
SOURCE_OBSERVATION_SECONDS = 600.0
OBSERVED_KEY = "_observed"  # in the cursor: table -> [when last observed, digest of its column list]
# At most this many source observations a tick, besides those of tables whose columns changed: a
# first start of 500 tables recorded 500 at once, each an event the daemon stores, in the minute
# the streaming run sets its tables up; at 200 tables the daemon still spent 6 s of the first 75 s
# of streaming storing the sensors' events. The others wait for the next ticks, the longest
# unobserved first (so their later observations stay spread over the interval). With more tables
# than that keeps each observed every SOURCE_OBSERVATION_SECONDS, a tick takes more
# (`source_observations_per_tick`).
SOURCE_OBSERVATIONS_PER_TICK = 40
_PARTITIONS_TICK_SECONDS = 60
# How long a tick adds partitions at most; the tables left wait for its next tick.
ADD_PARTITIONS_SECONDS = 20.0
VERIFIED_KEY = "_verified"  # in the cursor: table -> when its partitions were last read from the instance
# The streaming sensor looks for consumers of tables no longer replicated this often (a listing of
# the stream's consumers: a few requests for hundreds of tables).
CONSUMER_SWEEP_SECONDS = 300.0
SWEPT_KEY = "_consumers_swept_at"  # in the streaming sensor's cursor
SWEPT_TABLES_KEY = "_consumers_swept_for"  # in it too: a digest of the (target, table) pairs swept for
# In it too: true once the tables' assets were read for removal records, or the table the reading
# goes on from at the next quiet tick.
REMOVALS_READ_KEY = "_removals_read"
# Tables whose assets a tick reads for removal records: about 12 ms each from SQLite storage, and
# all 200 of a first start in one tick took the code server 2.4 s while the streaming run began.
REMOVAL_READS_PER_TICK = 25
REMOVED_KEY = "_unreplicated"  # in it too: table id -> when it was recorded as no longer replicated
LINGERING_KEY = "lingering"  # in it too: run id -> when its lingering worker was first interrupted


def read_tables(connection, specs: list[TableSpec],
                on_error: Callable[[source_db.SourceError], None] | None = None,
                ) -> dict[str, tuple[TableSchema, source_db.TableSize]]:
    """Each table's columns and size, by qualified name. A table the source cannot serve (missing,
    or without a primary key: refused as the producer refuses it) is left out; with `on_error` it
    is reported there and holds back no other table, without it the error is raised."""
    tables = [spec.table for spec in specs]
    schemas = source_db.table_schemas(connection, tables)  # refuses a table without a primary key
    sizes = source_db.table_sizes(connection, tables)
    read: dict[str, tuple[TableSchema, source_db.TableSize]] = {}
    for spec in specs:
        table, size = schemas[spec.table.name], sizes[spec.table.name]
        error = table if isinstance(table, source_db.SourceError) else size
        if isinstance(error, source_db.SourceError):
            if on_error is None:
                raise error
            on_error(error)
            continue
        assert isinstance(table, TableSchema) and isinstance(size, source_db.TableSize)
        read[spec.qualified_name] = (table, size)
    return read


def add_partitions(instance: dg.DagsterInstance, requests: Sequence[dg.AddDynamicPartitionsRequest],
                   budget_seconds: float | None = None) -> list[dg.AddDynamicPartitionsRequest]:
    """Adds the requests' partitions to the instance; the requests added, in order. With
    `budget_seconds`, the requests left once it is spent are not added: a sensor's tick has a
    minute in all, and the tables they are for wait for its next tick.

    The sensors add them themselves rather than return them in their result: the daemon looked
    each key up in its storage again before adding it, and wrote a log line of the keys per table.
    On a first start of 500 tables both sensors that add partitions asked for all of them, and the
    daemon spent 38 s doing so while the streaming run set its tables up. A key the instance has
    already is left as it is, so two sensors adding the same table's ranges do no harm."""
    started = time.monotonic()
    added = []
    for request in requests:
        if added and budget_seconds is not None and time.monotonic() - started > budget_seconds:
            break
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        added.append(request)
    return added


def key_count(requests: Sequence[dg.AddDynamicPartitionsRequest]) -> int:
    return sum(len(request.partition_keys) for request in requests)


def partition_requests(instance: dg.DagsterInstance, connection, specs: list[TableSpec],
                       on_error: Callable[[source_db.SourceError], None] | None = None,
                       read: dict[str, tuple[TableSchema, source_db.TableSize]] | None = None,
                       covered: Callable[[TableSpec, int], bool] | None = None,
                       existing: Callable[[TableSpec], Sequence[str]] | None = None,
                       ) -> tuple[list[dg.AddDynamicPartitionsRequest], dict[str, int]]:
    """The ranges missing from the instance for each table, and each table's block count; `read`
    is `read_tables` of the specs when the caller has it (else it is read here, see there).
    `covered(spec, blocks)` says a table's partitions are known to cover that many blocks, and
    spares the read of them from the instance; `existing(spec)` gives a table's partitions when
    the caller has read them already (else they are read from the instance)."""
    if read is None:
        read = read_tables(connection, specs, on_error)
    requests = []
    blocks: dict[str, int] = {}
    for spec in specs:
        if spec.qualified_name not in read:
            continue
        size = read[spec.qualified_name][1]
        blocks[spec.qualified_name] = size.blocks
        if covered is not None and covered(spec, size.blocks):
            continue
        keys = missing_keys(existing(spec) if existing is not None else
                            instance.get_dynamic_partitions(spec.partitions_def_name),
                            size.blocks, spec.table.blocks_per_partition)
        if keys:
            requests.append(dg.AddDynamicPartitionsRequest(partitions_def_name=spec.partitions_def_name,
                                                           partition_keys=keys))
    return requests, blocks


def source_observations_per_tick(tables: int) -> int:
    """Source observations a tick of the partitions sensor makes at most: SOURCE_OBSERVATIONS_PER_TICK,
    or half as many again as `tables` need a tick to be observed every SOURCE_OBSERVATION_SECONDS."""
    return max(SOURCE_OBSERVATIONS_PER_TICK, math.ceil(1.5 * tables * _PARTITIONS_TICK_SECONDS / SOURCE_OBSERVATION_SECONDS))


def build_partitions_sensor(specs: list[TableSpec], group: str,
                            observations_per_tick: int | None = None) -> dg.SensorDefinition:
    per_tick = observations_per_tick if observations_per_tick is not None else source_observations_per_tick(len(specs))

    @dg.sensor(
        name=f"{group}_partitions",
        minimum_interval_seconds=_PARTITIONS_TICK_SECONDS,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Adds the block-range partitions of tables that grew and observes each source table "
                    "(size, row estimate, columns, LSN) every 10 minutes and when its columns change. The cursor "
                    "holds each table's block count at the last tick, when it was last observed and when its "
                    "partitions were last read.",
    )
    def _partitions(context: dg.SensorEvaluationContext, source: PostgresResource) -> dg.SensorResult:
        state = json.loads(context.cursor) if context.cursor else {}
        observed: dict[str, list] = dict(state.get(OBSERVED_KEY, {}))
        verified: dict[str, float] = dict(state.get(VERIFIED_KEY, {}))
        now = time.time()

        def covered(spec: TableSpec, blocks: int) -> bool:
            # The last tick's result added the ranges its block count needed: a table that still
            # fits them (a growing table stays inside its last range for many ticks) is looked up
            # in the instance again only every SOURCE_OBSERVATION_SECONDS (a read of the instance's
            # storage per table, each tick, cost a run of 500 tables seconds).
            before, last = state.get(spec.qualified_name), verified.get(spec.qualified_name)
            per = spec.table.blocks_per_partition
            return (before is not None and range_count(blocks, per) <= range_count(before, per)
                    and last is not None and now - last < SOURCE_OBSERVATION_SECONDS)

        with source.connect() as connection:
            # One table's problem holds back no other table.
            read = read_tables(connection, specs, on_error=lambda error: context.log.error(str(error)))
            looked_up = [spec.qualified_name for spec in specs
                         if spec.qualified_name in read and not covered(spec, read[spec.qualified_name][1].blocks)]
            requests, blocks = partition_requests(context.instance, connection, specs, read=read, covered=covered)
            lsn = source_db.current_lsn(connection)
        verified.update(dict.fromkeys(looked_up, now))
        observations, waiting = _source_observations(specs, read, observed, lsn, now, per_tick)
        if waiting:
            context.log.info(f"{waiting} source table observation(s) wait for the next tick")
        fail_dead_snapshot_runs(context, now)
        added = add_partitions(context.instance, requests, budget_seconds=ADD_PARTITIONS_SECONDS)
        if added:
            context.log.info(f"added {key_count(added)} block-range partitions of {len(added)} table(s)")
        if len(added) < len(requests):
            # Not marked as verified: the next tick reads those tables' partitions and adds them.
            left = {request.partitions_def_name for request in requests[len(added):]}
            for spec in specs:
                if spec.partitions_def_name in left:
                    verified.pop(spec.qualified_name, None)
            context.log.info(f"the partitions of {len(requests) - len(added)} table(s) are added next tick")
        cursor = json.dumps({**blocks, OBSERVED_KEY: {name: observed[name] for name in blocks if name in observed},
                             VERIFIED_KEY: {name: verified[name] for name in blocks if name in verified}},
                            sort_keys=True)
        return dg.SensorResult(asset_events=observations, cursor=cursor)

    return _partitions


def _source_observations(specs: list[TableSpec], read: dict[str, tuple[TableSchema, source_db.TableSize]],
                         observed: dict[str, list], lsn: int, now: float,
                         per_tick: int) -> tuple[list[dg.AssetObservation], int]:
    """This tick's observations of source tables, `observed` updated, and how many due ones wait: a
    table whose columns changed is always observed; one never observed, or last observed over
    SOURCE_OBSERVATION_SECONDS ago, takes one of `per_tick` places, the longest unobserved first."""
    changed, due = [], []
    for spec in specs:
        if spec.qualified_name not in read:
            continue
        digest = _columns_digest(read[spec.qualified_name][0])
        last = observed.get(spec.qualified_name)
        if last is not None and last[1] != digest:
            changed.append((spec, digest))
        elif last is None or now - last[0] >= SOURCE_OBSERVATION_SECONDS:
            due.append((last[0] if last is not None else -math.inf, spec, digest))
    due.sort(key=lambda entry: entry[0])
    chosen = changed + [(spec, digest) for _, spec, digest in due[:per_tick]]
    observations = []
    for spec, digest in chosen:
        table, size = read[spec.qualified_name]
        observations.append(source_observation(spec, size, lsn, table))
        observed[spec.qualified_name] = [now, digest]
    return observations, max(0, len(due) - per_tick)


def _columns_digest(table: TableSchema) -> str:
    return hashlib.sha256(repr(table.columns).encode()).hexdigest()[:16]


# Failures that ended longer ago than this are forgotten: a streak from an earlier session (runs
# failed when a local instance was stopped hard, say) must not hold back a fresh start.
FAILURE_MEMORY_SECONDS = 3600.0


def consecutive_failures(instance: dg.DagsterInstance, job_name: str, now: float, window: int = 20) -> tuple[int, float]:
    """Failures since the last run that ended otherwise, within the last hour, and when the latest
    of them ended. A run its operator stopped (`ENDED_BY_TAG`) is left out: stopping and starting
    `dagster dev` a few times must not hold the next start back as a streak of failures would."""
    records = instance.get_run_records(filters=dg.RunsFilter(job_name=job_name), limit=window)
    failures, last_end = 0, 0.0
    for record in records:  # newest first
        if record.dagster_run.status != dg.DagsterRunStatus.FAILURE:
            break
        ended = record.end_time or record.update_timestamp.timestamp()
        if ended < now - FAILURE_MEMORY_SECONDS:
            break
        if record.dagster_run.tags.get(ENDED_BY_TAG) == ENDED_BY_INTERRUPT:
            continue
        failures += 1
        last_end = max(last_end, ended)
    return failures, last_end


def backoff_seconds(failures: int, threshold: int) -> float:
    """No wait below the threshold, then 30 s doubling up to 10 minutes."""
    if failures < threshold:
        return 0.0
    return min(600.0, 30.0 * 2 ** (failures - threshold))


def build_streaming_sensor(groups: list[StreamGroup], sensor_prefix: str, jobs: dict[str, dg.JobDefinition],
                           failure_threshold: int, now=time.time, drift: ConfigDrift | None = None,
                           reloader: LocationReloader | None = None,
                           resyncs: ResyncRequests | None = None,
                           sweep_seconds: float = CONSUMER_SWEEP_SECONDS) -> dg.SensorDefinition:
    """`jobs` maps each group's key (`<target>:<group>`) to its group job; `drift`, when given,
    tells whether siphon.yaml changed since the code location loaded, and `reloader`, when given,
    has the code location loaded again when it did. `resyncs` rebuild a table replicated again
    after it was removed; every `sweep_seconds` the
    consumers of tables no longer replicated are recorded and deleted (consumer_sweep)."""
    application = groups[0].specs[0].tags[APPLICATION_TAG]
    by_key = {group.key: group for group in groups}
    configured_digest = tables_hash([f"{group.target}:{table}" for group in groups for table in group.tables])

    @dg.sensor(
        name=f"{sensor_prefix}_streaming",
        jobs=[*jobs.values(), *([resyncs.job] if resyncs is not None else [])],
        minimum_interval_seconds=15,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Keeps one streaming run per (target, group) alive, serving exactly the group's tables: "
                    "starts one when none is alive, replaces a run whose table set changed (terminating it first), "
                    "never lets two runs apply one table, backs off after repeated failures. The cursor records "
                    "each group's failures, backoff and its tables' pending messages.",
    )
    def _streaming(context: dg.SensorEvaluationContext, queue: NatsResource) -> dg.SensorResult:
        state = json.loads(context.cursor) if context.cursor else {}
        stale = drift.message() if drift is not None else None
        if stale:
            # The runs go on serving the tables as loaded until the new definitions take over.
            changes = drift.what_changed() if drift is not None else None
            if reloader is not None and changes is not None:
                stale = f"siphon.yaml no longer matches this code location ({changes}): {reloader.request(changes)}"
            context.log.warning(stale)
        pending = _pending_counts(context, queue, groups)
        clock = now()
        live = _live_streaming_runs(context, application, clock)
        terminated = _terminate_stale_runs(context, live, by_key)
        if not stale:
            # Only with definitions that match siphon.yaml: those of the code server now serving.
            _terminate_runs_of_replaced_code_servers(context, [run for run in live if run.run_id not in terminated])
        # A worker whose run Dagster records as ended but that still runs still applies its
        # tables: it is interrupted, and its tables' new run waits until it is gone.
        live += _stop_lingering_workers(context, application, clock, state)
        requests = []
        for group in groups:
            job = jobs[group.key]
            entry = state.setdefault(job.name, {})
            if pending.get(group.key) is not None:
                entry["pending"] = pending[group.key]
            if any(_serves_group(run, group) for run in live):
                entry["failures"] = 0
                entry.pop("waiting_for", None)
                continue
            busy = [run for run in live if _overlaps(run, group)]
            if busy:
                # The old run (or a by-hand single-table run) still holds some of these tables'
                # consumers; the new run starts once it is gone.
                entry["waiting_for"] = sorted(run.run_id for run in busy)
                context.log.info(f"{job.name}: waiting for run(s) {', '.join(entry['waiting_for'])} "
                                 f"({', '.join(sorted({run.job_name for run in busy}))}), which apply some of its "
                                 "tables, to end")
                continue
            entry.pop("waiting_for", None)
            failures, last_end = consecutive_failures(context.instance, job.name, clock)
            entry["failures"] = failures
            wait = backoff_seconds(failures, failure_threshold)
            if wait and clock < last_end + wait:
                entry["backoff_until"] = last_end + wait
                context.log.warning(f"{job.name}: {failures} consecutive failed runs; next start in "
                                    f"{last_end + wait - clock:.0f}s (see the failed runs for the error)")
                continue
            entry.pop("backoff_until", None)
            # The group's tables as this sensor's definitions have them: a daemon whose copy of the
            # job is older than the code location (just reloaded) would give the run the old ones.
            requests.append(dg.RunRequest(job_name=job.name,
                                          tags={**group.served_tags, "siphon/started-by": "streaming-sensor"}))
        # Swept every sweep_seconds, and at once when the tables changed (a table added again is
        # rebuilt without waiting for the next sweep).
        if not stale and (clock >= state.get(SWEPT_KEY, 0.0) + sweep_seconds
                          or state.get(SWEPT_TABLES_KEY) != configured_digest
                          or (state.get(REMOVALS_READ_KEY) is not True and not requests)):
            # Only with definitions that match siphon.yaml: tables the file has but this code does
            # not know are not removed tables.
            requests += _sweep_consumers(context, queue, application, groups, live, state, clock, resyncs,
                                         quiet=not requests)
            if state.get(SWEPT_KEY) == clock:  # swept (an unreachable queue is tried again next tick)
                state[SWEPT_TABLES_KEY] = configured_digest
        for name in set(state) - {jobs[group.key].name for group in groups} - {SWEPT_KEY, SWEPT_TABLES_KEY,
                                                                                REMOVED_KEY, REMOVALS_READ_KEY,
                                                                                LINGERING_KEY}:
            del state[name]  # a group that no longer exists
        if stale:
            state["siphon.yaml"] = stale
        else:
            state.pop("siphon.yaml", None)
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(state, sort_keys=True))

    return _streaming


def _live_streaming_runs(context: dg.SensorEvaluationContext, application: str, now: float) -> list[dg.DagsterRun]:
    """The application's streaming runs that may have a live worker; the others are ended."""
    live = []
    for run, dead in live_streaming_runs(context.instance, application, now):
        if dead is None:
            live.append(run)
        else:
            _end_dead_run(context, run, f"{run.job_name}: run {run.run_id}", dead)
    return live


# A worker still there this long after its run ended is lingering, not exiting: it is interrupted
# (SIGINT: it stops after its batches in progress, as Dagster's own termination does), and killed
# if it is still there LINGERING_KILL_AFTER_SECONDS after that.
LINGERING_AFTER_END_SECONDS = 60.0
LINGERING_KILL_AFTER_SECONDS = 120.0


def _stop_lingering_workers(context: dg.SensorEvaluationContext, application: str, now: float,
                            state: dict) -> list[dg.DagsterRun]:
    """The streaming runs recorded as canceled or failed whose worker still runs on this host: a
    new run of their tables waits for them. A worker that outlived its run by
    LINGERING_AFTER_END_SECONDS is interrupted, then killed; `state` (the sensor's cursor)
    remembers when each was first interrupted."""
    interrupted = state.get(LINGERING_KEY, {})
    lingering = lingering_streaming_runs(context.instance, application, now)
    still = {}
    for run, pid, ended in lingering:
        if now - ended < LINGERING_AFTER_END_SECONDS:
            continue  # a worker on its way out after its run ended
        first = interrupted.get(run.run_id)
        kill = first is not None and now - first >= LINGERING_KILL_AFTER_SECONDS
        context.log.warning(f"{run.job_name}: run {run.run_id} is recorded {run.status.value.lower()} but its worker "
                            f"(process {pid}) still runs and applies its tables: "
                            f"{'killing' if kill else 'interrupting'} it; a new run of its tables waits until it "
                            "has ended")
        try:
            os.kill(pid, signal.SIGKILL if kill else signal.SIGINT)
        except ProcessLookupError:
            continue
        still[run.run_id] = first if first is not None else now
    if still:
        state[LINGERING_KEY] = still
    else:
        state.pop(LINGERING_KEY, None)
    return [run for run, _, _ in lingering]


def _sweep_consumers(context: dg.SensorEvaluationContext, resource: NatsResource, application: str,
                     groups: list[StreamGroup], live: list[dg.DagsterRun], state: dict, now: float,
                     resyncs: ResyncRequests | None, quiet: bool) -> list[dg.RunRequest]:
    """Records and deletes the consumers of tables no longer replicated, and requests the rebuild
    of a table replicated again (consumer_sweep). An unreachable queue is logged, never fatal.
    `quiet`: the tick starts no run, so it may read every table's observations once."""
    tables = {table_id(group.target, spec.qualified_name): (group.target, spec)
              for group in groups for spec in group.specs}
    configured = {(target, spec.qualified_name) for target, spec in tables.values()}
    served = set()
    for run in live:
        of_run = served_tables(run)
        if of_run is not None:
            served |= {(of_run[0], table) for table in of_run[2]}
        elif run.tags.get(STREAM_TAG):
            target, _, table = run.tags[STREAM_TAG].partition(":")
            served.add((target, table))
    removed: dict[str, float] = dict(state.get(REMOVED_KEY, {}))

    async def sweep() -> SweepPlan:
        queue = resource.queue(client_name="siphon streaming sensor")
        await queue.connect(connect_timeout=2.0)
        try:
            consumers = table_consumers(await queue.consumers(), application)
            plan = plan_sweep(consumers, configured, served, removed, now)
            for consumer in plan.to_delete:
                await queue.delete_consumer(consumer.name)
            return plan
        finally:
            await queue.close()

    try:
        plan = asyncio.run(asyncio.wait_for(sweep(), timeout=30.0))
    except Exception as error:
        context.log.warning(f"could not look for consumers of tables no longer replicated: {error}")
        return []
    state[SWEPT_KEY] = now
    for consumer in plan.newly_unreplicated:
        context.log.warning(f"{consumer.qualified_name} is no longer replicated to {consumer.target}: its queue "
                            f"consumer {consumer.name} is removed once idle; the table at the target is kept")
        context.instance.report_runless_asset_event(removal_record(consumer))
        removed[table_id(consumer.target, consumer.qualified_name)] = now
    for consumer in plan.to_delete:
        context.log.info(f"removed queue consumer {consumer.name} of {consumer.qualified_name} "
                         f"({consumer.target}), which is no longer replicated")
    again = {name: removed[name] for name in plan.added_again}
    read_from = state.get(REMOVALS_READ_KEY)
    if read_from is not True and quiet:
        # A cursor without the list (new, or reset): the tables' assets tell which were removed and
        # not rebuilt. A read of every table's observations, so not in a tick that starts runs, and
        # REMOVAL_READS_PER_TICK tables a tick.
        unread = sorted(name for name in tables if not isinstance(read_from, str) or name >= read_from)
        for name in unread[:REMOVAL_READS_PER_TICK]:
            target, spec = tables[name]
            if name not in again:
                at = forgotten_removal(context.instance, target, spec.schema, spec.name)
                if at is not None:
                    again[name] = at
        state[REMOVALS_READ_KEY] = True if len(unread) <= REMOVAL_READS_PER_TICK else unread[REMOVAL_READS_PER_TICK]
    requests: dict[str, dg.RunRequest] = {}
    for name, removed_at in again.items():
        target, spec = tables[name]
        if resyncs is None or not resyncs.covers(spec):
            continue  # kept until this code location can rebuild the table
        removed.pop(name, None)
        request, record = added_again(target, spec, removed_at, resyncs)
        context.log.warning(f"{record.description}")
        context.instance.report_runless_asset_event(record)
        requests.setdefault(spec.qualified_name, request)
    if removed:
        state[REMOVED_KEY] = removed
    else:
        state.pop(REMOVED_KEY, None)
    return list(requests.values())


def _serves_group(run: dg.DagsterRun, group: StreamGroup) -> bool:
    served = served_tables(run)
    return served is not None and run.tags.get(GROUP_TAG) == group.key \
        and run.tags.get(TABLES_HASH_TAG) == group.tables_hash and run.status in IN_PROGRESS \
        and run.status != dg.DagsterRunStatus.CANCELING  # a lingering worker's run serves nothing: it is waited for


def _overlaps(run: dg.DagsterRun, group: StreamGroup) -> bool:
    """Whether the run applies any table of the group to the group's target."""
    served = served_tables(run)
    if served is not None:
        return served[0] == group.target and bool(served[2] & set(group.tables))
    target, _, table = run.tags.get(STREAM_TAG, "").partition(":")
    return target == group.target and table in group.tables


def _terminate_stale_runs(context: dg.SensorEvaluationContext, live: list[dg.DagsterRun],
                          groups: dict[str, StreamGroup]) -> set[str]:
    """Asks every group run whose table set is no longer its group's (tables added, removed or
    moved, a group gone) to terminate; its replacement starts once it has ended. Returns their ids."""
    terminated = set()
    for run in live:
        key = run.tags.get(GROUP_TAG)
        if key is None or run.status == dg.DagsterRunStatus.CANCELING:
            continue
        group = groups.get(key)
        if group is not None and run.tags.get(TABLES_HASH_TAG) == group.tables_hash:
            continue
        _terminate(context, run, "its group is no longer configured" if group is None else "its group's tables changed")
        terminated.add(run.run_id)
    return terminated


def _terminate_runs_of_replaced_code_servers(context: dg.SensorEvaluationContext, live: list[dg.DagsterRun]) -> None:
    """Asks every group run launched by a code server that a reload has since replaced to terminate.
    While the new code server loads, the old one's sensor still starts runs (those a fault ended),
    and their workers, loading siphon.yaml as it is now, may already serve the new table set: such a
    run is the one this sensor wants, but the old code server, which ends only once its runs have,
    would stay with it (a few hundred MB). Its replacement starts on this code server."""
    for run in live:
        if run.tags.get(GROUP_TAG) is None or run.status == dg.DagsterRunStatus.CANCELING:
            continue
        launcher = run.tags.get(LAUNCHER_TAG)
        pid = replaced_launcher(launcher) if launcher else None
        if pid is not None:
            _terminate(context, run, f"it was launched by code server process {pid}, which a reload replaced and "
                                     "which lives on until the run ends; its replacement starts on this code server")


def _terminate(context: dg.SensorEvaluationContext, run: dg.DagsterRun, why: str) -> None:
    context.log.info(f"{run.job_name}: terminating run {run.run_id}: {why}")
    try:
        # The coordinator cancels a queued run itself and asks the launcher to terminate a
        # launched one (the run is CANCELING until its worker has stopped).
        context.instance.run_coordinator.cancel_run(run.run_id)
    except Exception as error:  # the next tick asks again
        context.log.warning(f"{run.job_name}: could not terminate run {run.run_id}: {error}")


def _end_dead_run(context: dg.SensorEvaluationContext, run: dg.DagsterRun, what: str, reason: str) -> None:
    """Ends a run whose worker is gone: canceled when it was being canceled (its worker went as
    asked, and a cancellation is no failure to back off from), failed otherwise."""
    if run.status == dg.DagsterRunStatus.CANCELING:
        message = f"{what} is marked canceled: {reason} while the run was being canceled"
        context.log.info(message)
        context.instance.report_run_canceled(run, message)
        return
    message = f"{what} is marked failed: {reason}"
    context.log.warning(message)
    context.instance.report_run_failed(run, message)


def fail_dead_snapshot_runs(context: dg.SensorEvaluationContext, now: float) -> list[str]:
    """Snapshot runs whose worker process is gone are reported failed, so that the pool slots they
    hold are freed (`run_monitoring.free_slots_after_run_end_seconds`) and later snapshots run."""
    failed = []
    records = context.instance.get_run_records(
        dg.RunsFilter(statuses=IN_PROGRESS, tags={SNAPSHOT_RUN_TAG: "true"}), limit=100)
    for record in records:
        reason = dead_run_reason(record.dagster_run, record.start_time, now)
        if reason is not None:
            _end_dead_run(context, record.dagster_run, f"snapshot run {record.dagster_run.run_id}", reason)
            failed.append(record.dagster_run.run_id)
    return failed


def _pending_counts(context: dg.SensorEvaluationContext, resource: NatsResource,
                    groups: list[StreamGroup]) -> dict[str, int | None]:
    """Each group's pending messages over its tables' consumers (None: none of them exists yet, as
    before a table's first run); an unreachable queue is logged, never fatal to the tick. The
    stream's consumers are listed in one request per 256: asked one by one, 500 tables to two
    targets were a thousand requests every tick, most of the sensor's time."""
    from siphon_core import naming

    async def fetch() -> dict[str, int | None]:
        queue = resource.queue(client_name="siphon streaming sensor")
        await queue.connect(connect_timeout=2.0)
        try:
            consumers = await queue.consumers()
        finally:
            await queue.close()
        pending = {info.name: int(info.num_pending or 0) + int(info.num_ack_pending or 0) for info in consumers}
        counts: dict[str, int | None] = {}
        for group in groups:
            found = [pending[name] for name in (naming.consumer_name(group.target, spec.schema, spec.name)
                                                for spec in group.specs) if name in pending]
            counts[group.key] = sum(found) if found else None
        return counts

    try:
        return asyncio.run(asyncio.wait_for(fetch(), timeout=10.0))
    except Exception as error:
        context.log.warning(f"could not read pending counts from the queue: {error}")
        return {}
