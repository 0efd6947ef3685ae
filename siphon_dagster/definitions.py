"""The root of the code location: the definitions built from the application's siphon.yaml.

`build_definitions` makes every definition, the single-table stream jobs included (tests, runs in
one process); `load_definitions` is what Dagster loads, those jobs found by name only
(`code_location`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache, partial

import dagster as dg

from siphon_core import naming
from siphon_core.config import CONFIG_VARIABLE, SiphonConfig, load_config_from_environment
from siphon_dagster.assets import build_first_loads_asset, build_source_asset, build_target_asset
from siphon_dagster.checks.definitions import build_asset_checks, build_checks_job, build_checks_schedule
from siphon_dagster.code_location import with_jobs_by_name
from siphon_dagster.config_drift import ConfigDrift
from siphon_dagster.gap_sensor import build_gap_sensor
from siphon_dagster.group_jobs import build_group_stream_job
from siphon_dagster.jobs import build_stream_job
from siphon_dagster.location_reload import LocationReloader
from siphon_dagster.resources import (
    ClickHouseResource,
    NatsResource,
    PostgresResource,
    SnowflakeResource,
    SparkResource,
)
from siphon_dagster.resync import build_resync_job, build_tables_resync_job
from siphon_dagster.resync_requests import ResyncRequests
from siphon_dagster.sensors import build_partitions_sensor, build_streaming_sensor
from siphon_dagster.snapshot_sensor import build_snapshot_sensor
from siphon_dagster.specs import group_name, table_specs
from siphon_dagster.stream_groups import stream_groups


def build_resources(config: SiphonConfig) -> dict[str, object]:
    """Every resource from its section of the configuration, secrets as `${VAR}` references."""
    resources: dict[str, object] = {
        "source": PostgresResource(settings=config.settings("source"),
                                   publication=config.producer.publication_name
                                   or naming.publication_name(config.application_identifier)),
        "queue": NatsResource(settings=config.settings("queue"), application_identifier=config.application_identifier),
        "spark": SparkResource(settings=config.settings("spark")),
    }
    if config.targets.clickhouse is not None:
        resources["clickhouse_target"] = ClickHouseResource(settings=config.settings("targets.clickhouse"))
    if config.targets.snowflake is not None:
        resources["snowflake_target"] = SnowflakeResource(settings=config.settings("targets.snowflake"))
    return resources


def bound_resources(resources: dict[str, object]) -> dict[str, dg.ResourceDefinition]:
    """The resources as the code location binds them: built from siphon.yaml, with no run
    configuration of their own.

    A resource that takes run configuration puts its config schema, with every setting as its
    default, into the snapshot of every job that uses it. Dagster's daemon fetches and hashes those
    snapshots every minute, and each table has jobs of its own. At 500 tables the resources' schemas
    were 8.6 of the 41.4 MB (the executor's fixed settings took 3.4 more; 29.4 MB are left), and a
    fetch costs the code server and the daemon 4.7 s of CPU instead of 6.0. A run's settings come
    from siphon.yaml in any case.
    """
    return {key: dg.ResourceDefinition.hardcoded_resource(resource, _first_line(type(resource).__doc__))
            for key, resource in resources.items()}


def _first_line(text: str | None) -> str | None:
    return text.strip().splitlines()[0] if text and text.strip() else None


# Every run executes its steps in its own process: a snapshot partition or a check run is one
# process, not a run worker plus a process per step (each a full interpreter with Dagster, pyarrow
# and the drivers loaded, a few hundred MB). Its settings are fixed at their defaults, for the same
# reason as the resources' (`bound_resources`): the executor's run-config schema was a tenth of each
# job's snapshot.
EXECUTOR = dg.in_process_executor.configured({}, name="in_process")


def build_definitions(config: SiphonConfig, config_path: str | None = None,
                      resources: dict[str, dg.ResourceDefinition] | None = None,
                      table_jobs: bool = True) -> dg.Definitions:
    """`config_path`: the file `config` was loaded from, which the streaming sensor watches for
    changes this code location cannot serve until it is reloaded. `resources`: as
    `bound_resources` makes them (by default from `config`). `table_jobs`: whether the
    single-table jobs (`stream_<target>_<table>`, `resync_<table>`) are among the jobs."""
    specs = table_specs(config)
    assets: list[object] = []
    for spec in specs:
        assets.append(build_source_asset(spec))
        assets.extend(build_target_asset(spec, target) for target in spec.targets)
    group = group_name(config.application_identifier)
    if config.snapshots.tables_per_load_run > 1:  # small tables' loads, many to a run (snapshot sensor)
        assets.extend(build_first_loads_asset(specs, target, group)
                      for target in sorted({target for spec in specs for target in spec.targets}))
    # Single-table jobs stay for draining or rebuilding a table by hand; the sensors run the group
    # jobs and `<group>_resync`.
    stream_jobs = [build_stream_job(spec, target) for spec in specs for target in spec.targets] if table_jobs else []
    groups = stream_groups(config, specs)
    group_jobs = {stream_group.key: build_group_stream_job(stream_group) for stream_group in groups}
    # Resync jobs (siphon_dagster.resync): `<group>_resync` rebuilds the table its run config names,
    # `resync_<table>` that one table; the gap sensor requests a rebuild of every table after a lost slot.
    built: list[dg.Definitions] = []  # the checks run through the definitions being built here
    checks_after = _checks_after_resync(built, group)
    tables_resync = build_tables_resync_job(specs, group, checks_after=checks_after)
    resyncs = ResyncRequests.of(tables_resync, specs)
    table_resync_jobs = [build_resync_job(spec, checks_after=checks_after) for spec in specs] if table_jobs else []
    # Checks on every target asset, their job and schedule (siphon_dagster.checks).
    asset_checks = build_asset_checks(specs, config)
    checks_job = build_checks_job(group, asset_checks)
    definitions = dg.Definitions(
        assets=assets,
        asset_checks=asset_checks,
        schedules=[build_checks_schedule(group, checks_job, config)],
        jobs=[*stream_jobs, *group_jobs.values(), tables_resync, *table_resync_jobs, checks_job],
        sensors=[
            build_partitions_sensor(specs, group),
            build_streaming_sensor(groups, group, group_jobs, config.streaming.max_failures_before_backoff,
                                   drift=ConfigDrift(config_path, config) if config_path else None,
                                   reloader=LocationReloader() if config.streaming.reload_location_on_change else None,
                                   resyncs=resyncs),
            build_gap_sensor(specs, group, resyncs),
            # New tables load, failed snapshot partitions run again, each table's state on its asset.
            build_snapshot_sensor(specs, group, config.snapshots, target_check_keys([*assets, *asset_checks])),
        ],
        resources=resources if resources is not None else bound_resources(build_resources(config)),
        executor=EXECUTOR,
    )
    built.append(definitions)
    return definitions


def target_check_keys(assets: list[object]) -> dict[dg.AssetKey, list[dg.AssetCheckKey]]:
    """The checks among `definitions` (assets, asset checks), by the asset they check: the snapshot
    sensor shows their latest results."""
    keys: dict[dg.AssetKey, list[dg.AssetCheckKey]] = {}
    for definition in assets:
        for check_key in getattr(definition, "check_keys", ()):
            keys.setdefault(check_key.asset_key, []).append(check_key)
    return keys


def _checks_after_resync(built: list[dg.Definitions], group: str):
    """A resync ends by running the table's checks at the rebuilt targets (a run of the checks job,
    recorded on the assets as any other)."""

    def run(context: dg.OpExecutionContext, spec, targets: list[str]) -> list[str]:
        from siphon_dagster.checks.command import run_checks, status_line
        from siphon_dagster.checks.definitions import check_keys

        keys = [key for target in targets for key in check_keys(spec, target)]
        failed = []
        evaluations = run_checks(built[0], group, keys, context.instance)
        for evaluation in evaluations:
            line = status_line(evaluation)
            if evaluation.passed:
                context.log.info(line)
            elif evaluation.severity == dg.AssetCheckSeverity.ERROR:
                context.log.error(line)
                failed.append(line)
            else:
                context.log.warning(line)
        # A check that never reported (its run failed before it) proves nothing: the resync fails.
        reported = {(e.asset_key, e.check_name) for e in evaluations}
        for key in keys:
            if (key.asset_key, key.name) not in reported:
                line = f"FAIL  {key.asset_key.to_user_string()}  {key.name}  did not run (see the checks run's log)"
                context.log.error(line)
                failed.append(line)
        return failed

    return run


def build_code_location(config: SiphonConfig, config_path: str | None = None) -> dg.RepositoryDefinition:
    """The definitions as Dagster loads them: every one of `build_definitions`, listed when first
    needed, with the stream jobs built alone when asked for by name (a run's worker) and the
    single-table ones left out of the listings and snapshots (see `code_location`)."""
    resources = bound_resources(build_resources(config))

    def alone(build: Callable[[], dg.JobDefinition]) -> Callable[[], dg.JobDefinition]:
        def resolved() -> dg.JobDefinition:
            job = build()
            return dg.Definitions(jobs=[job], resources=resources, executor=EXECUTOR).resolve_job_def(job.name)
        return resolved

    specs = table_specs(config)
    with_table_jobs = cache(lambda: build_definitions(config, config_path, resources=resources))

    def with_the_rest(name: str) -> Callable[[], dg.JobDefinition]:
        # A resync ends with the table's checks, which run through the definitions it is part of.
        return lambda: with_table_jobs().resolve_job_def(name)

    single = {spec.stream_job_name(target): alone(partial(build_stream_job, spec, target)) for spec in specs
              for target in spec.targets}
    single.update({spec.resync_job_name: with_the_rest(spec.resync_job_name) for spec in specs})
    groups = {group.job_name: alone(partial(build_group_stream_job, group)) for group in stream_groups(config, specs)}
    return with_jobs_by_name(lambda: build_definitions(config, config_path, resources=resources, table_jobs=False),
                             {**groups, **single}, unlisted=list(single))


def load_definitions() -> dg.RepositoryDefinition:
    return build_code_location(load_config_from_environment(), os.environ.get(CONFIG_VARIABLE))
