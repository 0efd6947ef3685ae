"""Sensors: block-range partitions kept current as tables grow, and streaming runs kept alive."""


import asyncio
import json
import time

import dagster as dg

from siphon_dagster import source as source_db
from siphon_dagster.assets import observe_source
from siphon_dagster.partitions import missing_keys
from siphon_dagster.resources import NatsResource, PostgresResource
from siphon_dagster.run_liveness import SNAPSHOT_RUN_TAG, dead_run_reason
from siphon_dagster.specs import TableSpec


def partition_requests(instance: dg.DagsterInstance, connection, specs: list[TableSpec]
                       ) -> tuple[list[dg.AddDynamicPartitionsRequest], dict[str, int]]:
    """The ranges missing from the instance for each table, and each table's block count."""
    requests = []
    blocks: dict[str, int] = {}
    for spec in specs:
        size = source_db.table_size(connection, spec.table)
        blocks[spec.qualified_name] = size.blocks
        existing = instance.get_dynamic_partitions(spec.partitions_def_name)
        keys = missing_keys(existing, size.blocks, spec.table.blocks_per_partition)
        if keys:
            requests.append(dg.AddDynamicPartitionsRequest(partitions_def_name=spec.partitions_def_name,
                                                           partition_keys=keys))
    return requests, blocks


def build_partitions_sensor(specs: list[TableSpec], group: str) -> dg.SensorDefinition:
    @dg.sensor(
        name=f"{group}_partitions",
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Adds the block-range partitions of tables that grew and observes each source table "
                    "(size, row estimate, LSN). The cursor holds each table's block count at the last tick.",
    )
    def _partitions(context: dg.SensorEvaluationContext, source: PostgresResource) -> dg.SensorResult:
        with source.connect() as connection:
            requests, blocks = partition_requests(context.instance, connection, specs)
            observations = []
            for spec in specs:
                try:
                    observations.append(observe_source(spec, connection))
                except source_db.SourceError as error:  # one table's problem holds back no other table
                    context.log.error(str(error))
        fail_dead_snapshot_runs(context, time.time())
        cursor = json.dumps(blocks, sort_keys=True)
        added = sum(len(r.partition_keys) for r in requests)
        if added:
            context.log.info(f"adding {added} block-range partitions")
        return dg.SensorResult(dynamic_partitions_requests=requests, asset_events=observations, cursor=cursor)

    return _partitions


IN_PROGRESS = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


# Failures that ended longer ago than this are forgotten: a streak from an earlier session (runs
# failed when a local instance was stopped hard, say) must not hold back a fresh start.
FAILURE_MEMORY_SECONDS = 3600.0


def consecutive_failures(instance: dg.DagsterInstance, job_name: str, now: float, window: int = 20) -> tuple[int, float]:
    """Failures since the last run that ended otherwise, within the last hour, and when the latest
    of them ended."""
    records = instance.get_run_records(filters=dg.RunsFilter(job_name=job_name), limit=window)
    failures, last_end = 0, 0.0
    for record in records:  # newest first
        if record.dagster_run.status != dg.DagsterRunStatus.FAILURE:
            break
        ended = record.end_time or record.update_timestamp.timestamp()
        if ended < now - FAILURE_MEMORY_SECONDS:
            break
        failures += 1
        last_end = max(last_end, ended)
    return failures, last_end


def backoff_seconds(failures: int, threshold: int) -> float:
    """No wait below the threshold, then 30 s doubling up to 10 minutes."""
    if failures < threshold:
        return 0.0
    return min(600.0, 30.0 * 2 ** (failures - threshold))


def build_streaming_sensor(specs: list[TableSpec], group: str, jobs: dict[tuple[str, str], dg.JobDefinition],
                           failure_threshold: int, now=time.time) -> dg.SensorDefinition:
    @dg.sensor(
        name=f"{group}_streaming",
        jobs=list(jobs.values()),
        minimum_interval_seconds=15,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Keeps one streaming run per (target, table) alive: starts one when none is queued or "
                    "running, backs off after repeated failures. The cursor records each job's failures, "
                    "backoff and the queue's pending count.",
    )
    def _streaming(context: dg.SensorEvaluationContext, queue: NatsResource) -> dg.SensorResult:
        state = json.loads(context.cursor) if context.cursor else {}
        pending = _pending_counts(context, queue, jobs)
        requests = []
        for job in jobs.values():
            entry = state.setdefault(job.name, {})
            if pending.get(job.name) is not None:
                entry["pending"] = pending[job.name]
            if _live_runs(context, job.name, now()):
                entry["failures"] = 0
                continue
            failures, last_end = consecutive_failures(context.instance, job.name, now())
            entry["failures"] = failures
            wait = backoff_seconds(failures, failure_threshold)
            if wait and now() < last_end + wait:
                entry["backoff_until"] = last_end + wait
                context.log.warning(f"{job.name}: {failures} consecutive failed runs; next start in "
                                    f"{last_end + wait - now():.0f}s (see the failed runs for the error)")
                continue
            entry.pop("backoff_until", None)
            requests.append(dg.RunRequest(job_name=job.name, tags={"siphon/started-by": "streaming-sensor"}))
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(state, sort_keys=True))

    return _streaming


def _live_runs(context: dg.SensorEvaluationContext, job_name: str, now: float) -> list[dg.DagsterRun]:
    """The job's in-progress runs that may have a live worker; the others are reported failed."""
    live = []
    for record in context.instance.get_run_records(dg.RunsFilter(job_name=job_name, statuses=IN_PROGRESS), limit=5):
        reason = dead_run_reason(record.dagster_run, record.start_time, now)
        if reason is None:
            live.append(record.dagster_run)
            continue
        _end_dead_run(context, record.dagster_run, f"{job_name}: run {record.dagster_run.run_id}", reason)
    return live


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
                    jobs: dict[tuple[str, str], dg.JobDefinition]) -> dict[str, int | None]:
    """Each consumer's pending messages; an unreachable queue is logged, never fatal to the tick."""
    from siphon_core import naming

    async def fetch() -> dict[str, int | None]:
        queue = resource.queue(client_name="siphon streaming sensor")
        await queue.connect(connect_timeout=2.0)
        counts: dict[str, int | None] = {}
        try:
            for (target, table), job in jobs.items():
                schema, _, name = table.partition(".")
                try:
                    counts[job.name] = await queue.pending(naming.consumer_name(target, schema, name))
                except Exception:  # the consumer does not exist until its first run
                    counts[job.name] = None
        finally:
            await queue.close()
        return counts

    try:
        return asyncio.run(asyncio.wait_for(fetch(), timeout=10.0))
    except Exception as error:
        context.log.warning(f"could not read pending counts from the queue: {error}")
        return {}
