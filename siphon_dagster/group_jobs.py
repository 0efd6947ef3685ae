"""Jobs per (target, streaming group): one run applies every table of the group.

The run is one process (Dagster's in-process executor), one NATS connection, at most one Spark
session (started on the first batch too large to decode in the process) and one source
connection; each table keeps its own consumer, asset, materializations and error strategy.
"""


import contextlib
import time
from collections.abc import Sequence
from typing import Any

import dagster as dg

from siphon_core.config import TableConfig
from siphon_dagster.run_liveness import in_step_process, stop_when_orphaned, worker_tags
from siphon_dagster.stream_groups import (
    APPLICATION_TAG,
    ENDED_BY_INTERRUPT,
    ENDED_BY_TAG,
    StreamGroup,
    runs_applying,
)
from siphon_dagster.streaming.materializations import AggregatedBatches
from siphon_dagster.table_state import STREAM_STOPPED


class GroupRunConfig(dg.Config):
    """Run config of a group job: `ops: {apply_<target>[__<group>]: {config: {stop_when_drained: true}}}`."""

    stop_when_drained: bool = False
    # First wait before a failed table is started again within the run; it doubles up to 10 minutes.
    retry_initial_seconds: float = 15.0


def build_group_stream_job(group: StreamGroup) -> dg.JobDefinition:
    resource_key = f"{group.target}_target"
    specs = {spec.qualified_name: spec for spec in group.specs}
    streaming = group.specs[0].streaming

    @dg.op(
        name=group.op_name,
        required_resource_keys={"source", "queue", "spark", resource_key},
        description=f"Pulls the packages of {len(specs)} tables from JetStream and applies them to {group.target}, "
                    "each table on its own consumer, acking only what the target committed.",
    )
    def _stream(context: dg.OpExecutionContext, config: GroupRunConfig) -> None:
        from siphon_dagster.op_events import OpEvents
        from siphon_dagster.snapshot_sensor import made_anew, materialized_assets
        from siphon_dagster.streaming import metrics as stream_metrics
        from siphon_dagster.streaming.consumer import StreamConsumer
        from siphon_dagster.streaming.created_tables import CreatedTables
        from siphon_dagster.streaming.group_run import GroupRunner, TableFailure
        from siphon_dagster.streaming.materializations import MaterializationLimiter
        from siphon_dagster.streaming.pace import BatchPace
        from siphon_dagster.streaming.report import BatchReport
        from siphon_dagster.streaming.source_rows import SharedSourceRowReader

        limiter = MaterializationLimiter(streaming.materialization_interval_seconds,
                                         streaming.max_materializations_per_second)
        events = OpEvents(context)  # the run's reports, not kept in memory until it ends

        def materialize(aggregate: AggregatedBatches) -> None:
            spec = specs[aggregate.table]
            events.log(dg.AssetMaterialization(
                asset_key=spec.target_key(group.target),
                description=f"applied stream sequences {aggregate.first_sequence}..{aggregate.last_sequence} "
                            f"in {aggregate.batches} batches",
                metadata=materialization_metadata(aggregate),
            ))
            for warning in aggregate.warnings:
                context.log.warning(f"{aggregate.table}: {warning}")

        # Tables whose batch found no table at the target and made it, named in one log line a tick:
        # a first start of hundreds of new tables made as many lines, each a write to the event log
        # on the reporting thread while the run's tables were starting. Each table made again still
        # gets its own observation on its asset (the snapshot sensor's signal) at the next tick.
        made: list[str] = []
        created: list[str] = []  # new at the target (never materialized): made, nothing to load again

        def log_made() -> None:
            if made:
                names = sorted(made)
                made.clear()
                context.log.info(f"no table at {group.target} for {len(names)} table(s), so the stream made them and the "
                                 f"snapshot sensor loads them again: {', '.join(names)}")
            if created:
                names = sorted(created)
                created.clear()
                context.log.info(f"{len(names)} table(s) new at {group.target}, made by the stream: {', '.join(names)}")

        def record(report: BatchReport) -> None:  # on the run's event loop, as the batch is acked
            stream_metrics.record_batch(group.target, report.table, report)

        def materialized(tables: Sequence[str]) -> set[str]:
            keys = {specs[table].target_key(group.target): table for table in tables}
            return {keys[key] for key in materialized_assets(context.instance, list(keys))}

        # A table the stream made waits, with its batches' reports, for the next tick's one read.
        created_tables = CreatedTables(materialized)

        def answer_created(absorb: bool = False) -> None:
            answered = created_tables.answer()
            created.extend(answered.new)
            for table in answered.made_again:
                made.append(table)
                events.log(made_anew(specs[table].target_key(group.target), f"{table} at {group.target}"))
            for report in answered.reports:
                if absorb:
                    limiter.absorb(report)
                else:
                    add(report)

        def add(report: BatchReport) -> None:
            aggregate = limiter.add(report, time.monotonic())
            if aggregate is not None:
                materialize(aggregate)

        def on_batch(report: BatchReport) -> None:
            if not created_tables.hold(report):
                add(report)

        def on_failure(failure: TableFailure) -> None:
            spec = specs[failure.table]
            then = "not retried: the run drains the other tables and fails" if failure.retry_in_seconds is None \
                else f"started again in {failure.retry_in_seconds:.0f}s (attempt {failure.attempt + 1})"
            message = f"table {failure.table} (target {group.target}) stopped: {failure.error}; {then}"
            context.log.error(message)
            events.log(dg.AssetObservation(
                asset_key=spec.target_key(group.target),
                description=f"{STREAM_STOPPED}: {type(failure.error).__name__}",
                metadata={"error": dg.MetadataValue.md(str(failure.error)), "attempt": failure.attempt,
                          "retry_in_seconds": -1.0 if failure.retry_in_seconds is None
                          else round(failure.retry_in_seconds, 1),
                          "run_id": context.run_id},
            ))

        # Two runs must never pull one table's consumer: a run already applying one of the group's
        # tables (a group run started by hand beside the sensor's, a single-table drain) goes first.
        others = runs_applying(context.instance, group.tags[APPLICATION_TAG], group.target, group.tables,
                               time.time(), exclude_run_id=context.run_id)
        if others:
            described = "; ".join(f"run {run.run_id} of job {run.job_name} applies {', '.join(tables)}"
                                  for run, tables in others)
            raise dg.Failure(f"{group.job_name}: other runs already apply tables of this group to {group.target} "
                             f"({described}); a second run would pull the same consumers. Stop them first: the "
                             "streaming sensor starts this job once they have ended")
        stale = {key: value for key, value in group.served_tags.items() if context.run.tags.get(key) != value}
        if stale:
            # The run was made from an older copy of this job (the code location reloaded since):
            # its tags must say what it applies, for the sensor keeps two runs off one table by them.
            context.log.warning(f"the run's tags named other tables than this code serves ({group.job_name}); "
                                "corrected to the tables it applies")
        context.instance.add_run_tags(context.run_id, {**stale, **worker_tags()})
        # /metrics of this run (streaming.metrics_port; 0 serves none): lag, pending, rows per table.
        stream_metrics.serve(streaming.metrics_port, streaming.metrics_host)
        targets: dict[str, Any] = {}
        opened: list[Any] = []  # the target whose connections the tables' targets share
        source = SharedSourceRowReader(context.resources.source.dsn)
        queue = context.resources.queue.queue(client_name=f"siphon {group.job_name}")
        spark = context.resources.spark
        remote_spark = spark.remote  # read once: it validates the spark section

        def make_consumer(table: TableConfig) -> StreamConsumer:
            if table.name not in targets:
                if not opened:
                    opened.append(getattr(context.resources, resource_key).open_target())
                    opened[0].shadow_lookup_seconds = streaming.shadow_lookup_seconds
                targets[table.name] = opened[0].sibling()
            consumer = StreamConsumer(queue=queue, target=targets[table.name], table=table, spark=spark.session,
                                      streaming=streaming, source=source, run_tables=len(specs),
                                      remote_spark=remote_spark)
            if not config.stop_when_drained:  # draining needs exact pending counts and short pulls
                consumer.idle_pull_seconds = streaming.idle_pull_seconds
                consumer.exact_pending = False
            consumer.pipelined = len(specs) == 1
            return consumer

        def tick() -> None:
            answer_created()
            log_made()
            for aggregate in limiter.due(time.monotonic()):
                materialize(aggregate)
            spark.stop_if_idle()

        # Draining by hand cuts batches at the configured wait: the pace is for a run that keeps up.
        pace = None if config.stop_when_drained else BatchPace(streaming.batch_max_wait_seconds,
                                                               streaming.max_batches_per_second)
        apply_threads = streaming.apply_threads_for(group.target)
        # As many again for first batches: a run of hundreds of new tables starts faster, and the
        # tables already streaming keep the target's own number of turns.
        runner = GroupRunner(queue, [spec.table for spec in group.specs], make_consumer, on_batch, on_failure,
                             retry_initial_seconds=config.retry_initial_seconds,
                             tick=tick, on_applied=record,
                             pace=pace, apply_threads=apply_threads, first_batch_turns=apply_threads)
        started = time.monotonic()
        context.log.info(f"streaming {len(specs)} tables to {group.target}: {', '.join(group.tables)}")
        try:
            if in_step_process():
                with stop_when_orphaned(runner.stop, context.log.warning):
                    summary = runner.run(stop_when_drained=config.stop_when_drained)
            else:
                summary = runner.run(stop_when_drained=config.stop_when_drained)
        except (KeyboardInterrupt, dg.DagsterExecutionInterruptedError):
            # Dagster records the run as failed; the tag tells the streaming sensor it was stopped.
            with contextlib.suppress(Exception):
                context.instance.add_run_tags(context.run_id, {ENDED_BY_TAG: ENDED_BY_INTERRUPT})
            raise
        finally:
            # Batches applied and acked whose reports an interrupt cancelled: the table the stream
            # made is the snapshot sensor's signal to load it, and each table's latest
            # materialization says what it applied last, in one event a table.
            # A failure here (the event log's storage) must neither hide why the run ended nor keep
            # the connections open.
            try:
                for report in runner.unreported_batches():
                    if not created_tables.hold(report):
                        limiter.absorb(report)
                answer_created(absorb=True)
                log_made()
                for aggregate in limiter.flush(time.monotonic()):
                    materialize(aggregate)
            except Exception as error:
                context.log.warning(f"the run's last materializations could not be recorded: {error}")
            for closable in [*targets.values(), *opened, source]:
                try:
                    closable.close()
                except Exception as error:
                    context.log.warning(f"closing a connection failed: {error}")
        batches = sum(s.batches for s in summary.tables.values())
        events = sum(s.events for s in summary.tables.values())
        context.log.info(f"{len(specs)} tables, {batches} batches, {events} events in "
                         f"{time.monotonic() - started:.1f}s")
        if summary.failed:
            raise dg.Failure(description="tables that stopped: " + "; ".join(
                f"{table}: {error}" for table, error in sorted(summary.failed.items())))

    @dg.job(name=group.job_name, tags=group.tags, executor_def=dg.in_process_executor,
            description=f"Streaming apply of {len(specs)} tables into {group.target} in one run; the streaming "
                        "sensor keeps one run alive and replaces it when the group's tables change.")
    def _job() -> None:
        _stream()

    return _job


def materialization_metadata(aggregate: AggregatedBatches) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "applied_lsn": aggregate.applied_lsn_text,
        "rows_by_operation": dg.MetadataValue.json(aggregate.rows_by_operation),
        "dagster/row_count": aggregate.rows_applied,
        "events": aggregate.events,
        "batches": aggregate.batches,
        "batches_decoded_in_driver": aggregate.decoded_in_driver,
        "lag_seconds": round(aggregate.lag_seconds, 3),
        "lag_max_seconds": round(aggregate.lag_max_seconds, 3),
        "pending_messages": aggregate.pending,
        "first_sequence": aggregate.first_sequence,
        "last_sequence": aggregate.last_sequence,
        "schema_changed": aggregate.schema_changed,
    }
    if aggregate.warnings:
        metadata["warnings"] = dg.MetadataValue.md("\n".join(f"- {w}" for w in aggregate.warnings))
    return metadata
