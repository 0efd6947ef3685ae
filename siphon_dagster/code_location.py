"""What Dagster loads from `siphon_dagster`: the definitions, with each table's by-hand jobs found
by their name but left out of the listings, and every stream job built alone when a run's worker
asks for it.

Dagster's daemon fetches the snapshot of every job of a code location every minute, one request
per job, and the webserver and the daemon read all of them when they start. The single-table jobs
are there for draining or rebuilding one table by hand (`dagster job execute -j
stream_<target>_<table>`, `-j resync_<table>`): the streaming sensor runs the group jobs, and the
sensors and the UI rebuild a table through `<group>_resync` (`resync_requests`). Listed, the
stream jobs were as many jobs as the tables times the targets, half of a code location's jobs with
one target and two thirds with two, and the resync jobs 4.6 of the 5.6 MB of job snapshots left at
200 tables. Now such a job is built when it is asked for by name (the CLI, a run's worker); the UI
lists the jobs the sensors and operators launch from it.

A run's worker loads the code location anew and asks it for its one job. Building the listing
(every table's assets, checks and resync job) for that took a streaming run of 500 tables 3.6 s
on an idle core and 6 - 8 s at a busy start, before its first table could stream, and again after
each restart; the listing is now built only when something else than such a job is asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dagster as dg
from dagster._core.definitions.repository_definition.repository_data import RepositoryData
from dagster._core.definitions.repository_definition.valid_definitions import SINGLETON_REPOSITORY_NAME


class JobsByName(RepositoryData):
    """The members of the listing `listed` builds, and the jobs of `by_name` (name -> how to build
    the job alone), each built once on first request. The listing is built once, on the first
    request of anything else: a run's worker asks for its job by name only.

    The jobs of `by_name` that are not in `unlisted` are listed too (the group stream jobs): once
    the listing is built they are answered from it, so that the code server hands out the same
    objects it lists. Those of `unlisted` are found by name (`has_job`, `get_job`, `get_job_names`)
    and never in `get_all_jobs`, which Dagster's snapshots are made of."""

    def __init__(self, listed: Callable[[], dg.RepositoryDefinition],
                 by_name: Mapping[str, Callable[[], dg.JobDefinition]], unlisted: Sequence[str] = ()) -> None:
        missing = sorted(set(unlisted) - set(by_name))
        if missing:
            raise ValueError(f"unlisted jobs without a way to build them: {missing}")
        self._build_listing = listed
        self._listing: dg.RepositoryDefinition | None = None
        self._by_name = dict(by_name)
        self._unlisted = frozenset(unlisted)
        self._built: dict[str, dg.JobDefinition] = {}
        self._building = threading.Lock()

    @property
    def _listed(self) -> dg.RepositoryDefinition:
        if self._listing is not None:
            return self._listing
        with self._building:  # a code server answers from several threads: one builds it
            if self._listing is not None:
                return self._listing
            listing = self._build_listing()
            clashes = sorted(self._unlisted & set(listing.job_names))
            if clashes:
                raise ValueError(f"jobs both listed and built by name: {clashes}")
            absent = sorted(set(self._by_name) - self._unlisted - set(listing.job_names))
            if absent:
                raise ValueError(f"jobs built by name as listed ones, but not in the listing: {absent}")
            self._listing = listing
        return self._listing

    # -- jobs ---------------------------------------------------------------------------------------

    def get_all_jobs(self) -> Sequence[dg.JobDefinition]:
        return self._listed.get_all_jobs()

    def get_job_names(self) -> Sequence[str]:
        return [*self._listed.job_names, *sorted(self._unlisted)]

    def has_job(self, job_name: str) -> bool:
        return job_name in self._by_name or self._listed.has_job(job_name)

    def get_job(self, job_name: str) -> dg.JobDefinition:
        if job_name not in self._by_name or (self._listing is not None and job_name not in self._unlisted):
            return self._listed.get_job(job_name)
        if job_name not in self._built:
            self._built[job_name] = self._by_name[job_name]()
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


def with_jobs_by_name(listed: Callable[[], dg.Definitions], by_name: Mapping[str, Callable[[], dg.JobDefinition]],
                      unlisted: Sequence[str] = ()) -> dg.RepositoryDefinition:
    """The repository of the definitions `listed` builds (see `JobsByName`). Its name, description
    and metadata are those of a `Definitions` (Dagster keys the sensors' state and the runs'
    origins by the name), known without building it."""
    return dg.RepositoryDefinition(SINGLETON_REPOSITORY_NAME,
                                   repository_data=JobsByName(lambda: listed().get_repository_def(), by_name, unlisted))
