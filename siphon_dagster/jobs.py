"""Jobs per table and target: `stream_<target>_<table>` applies the queue to the target."""

import time

import dagster as dg

from siphon_core import naming
from siphon_dagster.run_liveness import WORKER_TAG, stop_when_orphaned, worker_identity
from siphon_dagster.specs import TableSpec
from siphon_dagster.stream_groups import APPLICATION_TAG, STREAM_TAG, runs_applying


class StreamRunConfig(dg.Config):
    """Run config of a streaming job: `ops: {apply_<target>_<table>: {config: {stop_when_drained: true}}}`."""

    stop_when_drained: bool = False
    max_batches: int | None = None


def stream_op_name(spec: TableSpec, target: str) -> str:
    """`apply_clickhouse_notes`: the op to address in run config (`ops: {apply_clickhouse_notes: ...}`)."""
    return f"apply_{target}_{spec.job_suffix}"


def stream_tag_value(spec: TableSpec, target: str) -> str:
    return f"{target}:{spec.qualified_name}"


def build_stream_job(spec: TableSpec, target: str) -> dg.JobDefinition:
    asset_key = spec.target_key(target)
    resource_key = f"{target}_target"
    job_name = spec.stream_job_name(target)

    @dg.op(
        name=stream_op_name(spec, target),
        required_resource_keys={"source", "queue", "spark", resource_key},
        description=f"Pulls {spec.qualified_name}'s packages from JetStream and applies them to {target} with "
                    "PySpark, acking only what the target committed.",
    )
    def _stream(context: dg.OpExecutionContext, config: StreamRunConfig) -> None:
        from siphon_dagster.op_events import OpEvents
        from siphon_dagster.snapshot_sensor import made_anew, was_at_target
        from siphon_dagster.streaming.consumer import StreamConsumer
        from siphon_dagster.streaming.report import BatchReport
        from siphon_dagster.streaming.source_rows import SourceRowReader

        events = OpEvents(context)  # one materialization a batch, not kept in memory until the run ends

        def record(report: BatchReport) -> None:
            if report.created_table:
                if was_at_target(context.instance, asset_key):
                    context.log.info(f"{spec.qualified_name}: no table at {target}; the stream made it and the "
                                     "snapshot sensor loads it again")
                    events.log(made_anew(asset_key, f"{spec.qualified_name} at {target}"))
                else:
                    context.log.info(f"{spec.qualified_name}: new at {target}, made by the stream")
            metadata = {
                "applied_lsn": report.applied_lsn_text,
                "rows_by_operation": dg.MetadataValue.json(report.rows_by_operation),
                "dagster/row_count": report.rows_applied,
                "events": report.events,
                "batch_latency_seconds": round(report.latency_seconds, 3),
                "lag_seconds": round(report.lag_newest_seconds, 3),
                "lag_oldest_seconds": round(report.lag_oldest_seconds, 3),
                "pending_messages": report.pending,
                "first_sequence": report.first_sequence,
                "last_sequence": report.last_sequence,
            }
            if report.load_path is not None:
                metadata["load_path"] = report.load_path
            if report.warnings:
                # Beside the run log, so the asset's history shows which batch needs an operator.
                metadata["warnings"] = dg.MetadataValue.md("\n".join(f"- {w}" for w in report.warnings))
                for warning in report.warnings:
                    context.log.warning(warning)
            events.log(dg.AssetMaterialization(
                asset_key=asset_key,
                description=f"applied stream sequences {report.first_sequence}..{report.last_sequence}",
                metadata=metadata,
            ))

        # Two runs must never pull one table's consumer: a run already applying the table goes first.
        serving = runs_applying(context.instance, spec.tags[APPLICATION_TAG], target, [spec.qualified_name],
                                time.time(), exclude_run_id=context.run_id)
        if serving:
            run = serving[0][0]
            raise dg.Failure(
                f"table {spec.qualified_name} (target {target}) is being applied by run {run.run_id} of job "
                f"{run.job_name}; a second run would pull the same consumer. Stop that run (and, for a group run, "
                "its sensor, or move the table out of the group) before running this job")
        # Lets the streaming sensor tell this run from one whose worker died (run_liveness).
        context.instance.add_run_tags(context.run_id, {WORKER_TAG: worker_identity()})
        destination = getattr(context.resources, resource_key).open_target()
        destination.shadow_lookup_seconds = spec.streaming.shadow_lookup_seconds
        consumer = StreamConsumer(
            queue=context.resources.queue.queue(client_name=f"siphon {job_name}"),
            target=destination,
            table=spec.table,
            spark=context.resources.spark.session(),
            streaming=spec.streaming,
            source=SourceRowReader(context.resources.source.dsn),
        )
        started = time.monotonic()
        try:
            with stop_when_orphaned(consumer.stop, context.log.warning):
                summary = consumer.run(stop_when_drained=config.stop_when_drained, max_batches=config.max_batches,
                                       on_batch=record)
        finally:
            destination.close()
        context.log.info(f"{summary.batches} batches, {summary.events} events, {summary.rows_applied} rows applied "
                         f"in {time.monotonic() - started:.1f}s; applied up to LSN "
                         f"{naming.format_lsn(summary.applied_lsn)}")

    @dg.job(name=job_name, tags={STREAM_TAG: stream_tag_value(spec, target), **spec.tags},
            description=f"Streaming apply of {spec.qualified_name} into {target}; the streaming sensor keeps one "
                        "run alive. Run config `stop_when_drained: true` stops it when the queue is empty.")
    def _job() -> None:
        _stream()

    return _job
