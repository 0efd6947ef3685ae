"""What Dagster loads from `siphon_dagster`: the definitions, with each table's by-hand stream job
found by its name but left out of the listings.

Dagster's daemon fetches the snapshot of every job of a code location every minute, one request
per job, and the webserver and the daemon read all of them when they start. The single-table jobs
(`stream_<target>_<table>`) are there for draining one table by hand (`dagster job execute -j
stream_<target>_<table>`): the streaming sensor runs the group jobs. Listed, they were as many
jobs as the tables times the targets, half of a code location's jobs with one target and two
thirds with two. Now such a job is built when it is asked for by name (the CLI, a run's worker),
from the same resources and executor as the rest; the UI lists the jobs the sensors and operators
launch from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dagster as dg
from dagster._core.definitions.repository_definition.repository_data import RepositoryData


class UnlistedJobs(RepositoryData):
    """`listed`'s members as they are, and the jobs of `unlisted` (name -> how to build it): found
    by name (`has_job`, `get_job`, `get_job_names`), built once on first request, and never in
    `get_all_jobs`, which Dagster's snapshots are made of."""

    def __init__(self, listed: dg.RepositoryDefinition, unlisted: Mapping[str, Callable[[], dg.JobDefinition]]) -> None:
        clashes = sorted(set(unlisted) & set(listed.job_names))
        if clashes:
            raise ValueError(f"jobs both listed and built by name: {clashes}")
        self._listed = listed
        self._unlisted = dict(unlisted)
        self._built: dict[str, dg.JobDefinition] = {}

    # -- jobs ---------------------------------------------------------------------------------------

    def get_all_jobs(self) -> Sequence[dg.JobDefinition]:
        return self._listed.get_all_jobs()

    def get_job_names(self) -> Sequence[str]:
        return [*self._listed.job_names, *self._unlisted]

    def has_job(self, job_name: str) -> bool:
        return job_name in self._unlisted or self._listed.has_job(job_name)

    def get_job(self, job_name: str) -> dg.JobDefinition:
        if job_name not in self._unlisted:
            return self._listed.get_job(job_name)
        if job_name not in self._built:
            self._built[job_name] = self._unlisted[job_name]()
        return self._built[job_name]

    # -- everything else, as listed -----------------------------------------------------------------

    def get_top_level_resources(self) -> Mapping[str, dg.ResourceDefinition]:
        return self._listed.get_top_level_resources()

    def get_env_vars_by_top_level_resource(self) -> Mapping[str, Any]:
        return self._listed.get_env_vars_by_top_level_resource()

    def get_schedule_names(self) -> Sequence[str]:
        return [schedule.name for schedule in self._listed.schedule_defs]

    def get_all_schedules(self) -> Sequence[dg.ScheduleDefinition]:
        return self._listed.schedule_defs

    def get_schedule(self, schedule_name: str) -> dg.ScheduleDefinition:
        return self._listed.get_schedule_def(schedule_name)

    def has_schedule(self, schedule_name: str) -> bool:
        return self._listed.has_schedule_def(schedule_name)

    def get_all_sensors(self) -> Sequence[dg.SensorDefinition]:
        return self._listed.sensor_defs

    def get_sensor_names(self) -> Sequence[str]:
        return [sensor.name for sensor in self._listed.sensor_defs]

    def get_sensor(self, sensor_name: str) -> dg.SensorDefinition:
        return self._listed.get_sensor_def(sensor_name)

    def has_sensor(self, sensor_name: str) -> bool:
        return self._listed.has_sensor_def(sensor_name)

    def get_source_assets_by_key(self) -> Mapping[dg.AssetKey, dg.SourceAsset]:
        return self._listed.source_assets_by_key

    def get_assets_defs_by_key(self) -> Mapping[dg.AssetKey, dg.AssetsDefinition]:
        return self._listed.assets_defs_by_key

    def get_asset_checks_defs_by_key(self) -> Mapping[dg.AssetCheckKey, Any]:
        return self._listed.asset_checks_defs_by_key

    def get_component_tree(self) -> Any:
        return self._listed.get_component_tree()


def with_unlisted_jobs(definitions: dg.Definitions,
                       unlisted: Mapping[str, Callable[[], dg.JobDefinition]]) -> dg.RepositoryDefinition:
    """`definitions`' repository (its name, description and metadata kept: Dagster keys the
    sensors' state and the runs' origins by the repository's name) with `unlisted` found by name."""
    listed = definitions.get_repository_def()
    return dg.RepositoryDefinition(listed.name, repository_data=UnlistedJobs(listed, unlisted),
                                   description=listed.description, metadata=listed.metadata,
                                   repository_load_data=listed.repository_load_data)
