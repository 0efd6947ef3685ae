"""The root of the code location: one Definitions object built from the application's siphon.yaml."""

from __future__ import annotations

import dagster as dg

from siphon_core.config import SiphonConfig, load_config_from_environment
from siphon_dagster.assets import build_source_asset, build_target_asset
from siphon_dagster.group_jobs import build_group_stream_job
from siphon_dagster.jobs import build_stream_job
from siphon_dagster.resources import (
    ClickHouseResource,
    NatsResource,
    PostgresResource,
    SnowflakeResource,
    SparkResource,
)
from siphon_dagster.sensors import build_partitions_sensor, build_streaming_sensor
from siphon_dagster.specs import group_name, table_specs
from siphon_dagster.stream_groups import stream_groups


def build_resources(config: SiphonConfig) -> dict[str, object]:
    resources: dict[str, object] = {
        "source": PostgresResource(dsn=config.source.dsn, snapshot_dsn=config.source.snapshot_dsn,
                                   snapshot_spool_directory=config.source.snapshot_spool_directory,
                                   snapshot_spool_max_bytes=config.source.snapshot_spool_max_bytes),
        "queue": NatsResource(url=config.queue.url, application_identifier=config.application_identifier,
                              duplicate_window_seconds=config.queue.duplicate_window_seconds,
                              replicas=config.queue.replicas, max_message_bytes=config.queue.max_message_bytes),
        "spark": SparkResource(master=config.spark.master, remote=config.spark.remote, conf=config.spark.conf,
                               max_python_workers=config.spark.max_python_workers),
    }
    clickhouse = config.targets.clickhouse
    if clickhouse is not None:
        resources["clickhouse_target"] = ClickHouseResource(url=clickhouse.url, database=clickhouse.database,
                                                            username=clickhouse.username,
                                                            password=clickhouse.password)
    snowflake = config.targets.snowflake
    if snowflake is not None:
        resources["snowflake_target"] = SnowflakeResource(
            account=snowflake.account, user=snowflake.user, password=snowflake.password,
            database=snowflake.database, schema_name=snowflake.schema_, warehouse=snowflake.warehouse,
            role=snowflake.role, host=snowflake.host, port=snowflake.port, protocol=snowflake.protocol)
    return resources


def build_definitions(config: SiphonConfig) -> dg.Definitions:
    specs = table_specs(config)
    assets: list[object] = []
    for spec in specs:
        assets.append(build_source_asset(spec))
        assets.extend(build_target_asset(spec, target) for target in spec.targets)
    group = group_name(config.application_identifier)
    # Single-table jobs stay for draining a table by hand; the sensor runs the group jobs.
    stream_jobs = [build_stream_job(spec, target) for spec in specs for target in spec.targets]
    groups = stream_groups(config, specs)
    group_jobs = {stream_group.key: build_group_stream_job(stream_group) for stream_group in groups}
    return dg.Definitions(
        assets=assets,
        jobs=[*stream_jobs, *group_jobs.values()],
        sensors=[
            build_partitions_sensor(specs, group),
            build_streaming_sensor(groups, group, group_jobs, config.streaming.max_failures_before_backoff),
        ],
        resources=build_resources(config),
    )


def load_definitions() -> dg.Definitions:
    return build_definitions(load_config_from_environment())
