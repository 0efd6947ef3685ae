"""The root of the code location: one Definitions object built from the application's siphon.yaml."""

from __future__ import annotations

import dagster as dg

from siphon_core.config import SiphonConfig, load_config_from_environment
from siphon_dagster.assets import build_source_asset, build_target_asset
from siphon_dagster.gap_sensor import build_gap_sensor
from siphon_dagster.jobs import build_stream_job
from siphon_dagster.resources import (
    ClickHouseResource,
    NatsResource,
    PostgresResource,
    SnowflakeResource,
    SparkResource,
)
from siphon_dagster.resync import build_resync_job
from siphon_dagster.sensors import build_partitions_sensor, build_streaming_sensor
from siphon_dagster.snapshot_sensor import build_snapshot_sensor
from siphon_dagster.specs import group_name, table_specs


def build_resources(config: SiphonConfig) -> dict[str, object]:
    """Every resource from its section of the configuration, secrets as `${VAR}` references."""
    resources: dict[str, object] = {
        "source": PostgresResource(settings=config.settings("source")),
        "queue": NatsResource(settings=config.settings("queue"), application_identifier=config.application_identifier),
        "spark": SparkResource(settings=config.settings("spark")),
    }
    if config.targets.clickhouse is not None:
        resources["clickhouse_target"] = ClickHouseResource(settings=config.settings("targets.clickhouse"))
    if config.targets.snowflake is not None:
        resources["snowflake_target"] = SnowflakeResource(settings=config.settings("targets.snowflake"))
    return resources


def build_definitions(config: SiphonConfig) -> dg.Definitions:
    specs = table_specs(config)
    assets: list[object] = []
    for spec in specs:
        assets.append(build_source_asset(spec))
        assets.extend(build_target_asset(spec, target) for target in spec.targets)
    group = group_name(config.application_identifier)
    stream_jobs = {(target, spec.qualified_name): build_stream_job(spec, target)
                   for spec in specs for target in spec.targets}
    # Resync jobs: `resync_<table>` rebuilds a table at its targets (siphon_dagster.resync); the gap
    # sensor requests them all after a lost slot.
    resync_job_list = [build_resync_job(spec) for spec in specs]
    resync_jobs = {spec.qualified_name: job for spec, job in zip(specs, resync_job_list, strict=True)}
    return dg.Definitions(
        assets=assets,
        jobs=list(stream_jobs.values()) + resync_job_list,
        sensors=[
            build_partitions_sensor(specs, group),
            build_streaming_sensor(specs, group, stream_jobs, config.streaming.max_failures_before_backoff),
            build_gap_sensor(specs, group, resync_jobs),
            # New tables load, failed snapshot partitions run again, each table's state on its asset.
            build_snapshot_sensor(specs, group, config.snapshots, target_check_keys(assets)),
        ],
        resources=build_resources(config),
    )


def target_check_keys(assets: list[object]) -> dict[dg.AssetKey, list[dg.AssetCheckKey]]:
    """The checks among `definitions` (assets, asset checks), by the asset they check: the snapshot
    sensor shows their latest results."""
    keys: dict[dg.AssetKey, list[dg.AssetCheckKey]] = {}
    for definition in assets:
        for check_key in getattr(definition, "check_keys", ()):
            keys.setdefault(check_key.asset_key, []).append(check_key)
    return keys


def load_definitions() -> dg.Definitions:
    return build_definitions(load_config_from_environment())
