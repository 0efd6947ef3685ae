"""Streaming groups: which tables one streaming run serves, and how its runs are tagged.

One run per (target, group) applies every table of the group (`stream_<target>` for the default
group, `stream_<target>__<group>` for a group named under `streaming.groups`). Each run is tagged
with the exact table set it serves, so that the streaming sensor can tell a run started under an
older configuration and replace it, and so that no two runs ever pull one table's consumer.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

import dagster as dg

from siphon_core.config import DEFAULT_GROUP, SiphonConfig
from siphon_dagster.specs import TableSpec

GROUP_TAG = "siphon/stream-group"  # `<target>:<group>`
TABLES_TAG = "siphon/stream-tables"  # the tables served: a JSON list of schema.table names
TABLES_HASH_TAG = "siphon/stream-tables-hash"  # a digest of that list, compared by the sensor
APPLICATION_TAG = "siphon/application"
STREAM_TAG = "siphon/stream"  # `<target>:<schema.table>` on a single-table run (siphon_dagster.jobs)
# On a streaming run its operator stopped (Ctrl-C of `dagster dev`, a SIGTERM at shutdown): Dagster
# records it as failed, but it says nothing of whether the next run fails (`consecutive_failures`).
ENDED_BY_TAG = "siphon/ended-by"
ENDED_BY_INTERRUPT = "interrupt"


@dataclass(frozen=True)
class StreamGroup:
    target: str
    name: str
    specs: tuple[TableSpec, ...]

    @property
    def key(self) -> str:
        return f"{self.target}:{self.name}"

    @property
    def job_name(self) -> str:
        return f"stream_{self.target}" if self.name == DEFAULT_GROUP else f"stream_{self.target}__{self.name}"

    @property
    def op_name(self) -> str:
        return "apply_" + self.job_name.removeprefix("stream_")

    @property
    def tables(self) -> tuple[str, ...]:
        return tuple(sorted(spec.qualified_name for spec in self.specs))

    @property
    def tables_hash(self) -> str:
        return tables_hash(self.tables)

    @property
    def tags(self) -> dict[str, str]:
        return {**self.specs[0].tags, **self.served_tags}

    @property
    def served_tags(self) -> dict[str, str]:
        """The tags that say which tables a run of this group applies: the sensor's one source of
        truth that no two runs apply one table."""
        return {GROUP_TAG: self.key, TABLES_TAG: json.dumps(list(self.tables), ensure_ascii=False),
                TABLES_HASH_TAG: self.tables_hash}


def tables_hash(tables: tuple[str, ...] | list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(tables)).encode()).hexdigest()[:16]


def served_tables(run: dg.DagsterRun) -> tuple[str, str, set[str]] | None:
    """(target, group, tables) of a group run, None for any other run."""
    key = run.tags.get(GROUP_TAG)
    if key is None:
        return None
    target, _, group = key.partition(":")
    return target, group, _tagged_tables(run.tags.get(TABLES_TAG, ""))


def _tagged_tables(value: str) -> set[str]:
    """The tables of a TABLES_TAG value: a JSON list, since a table's name may hold a comma; a
    run tagged by an earlier version joined them with commas."""
    if value.startswith("["):
        try:
            return set(json.loads(value))
        except ValueError:
            pass
    return set(value.split(",")) if value else set()


def streamed_tables(run: dg.DagsterRun) -> tuple[str, set[str]] | None:
    """(target, tables) a streaming run applies: a group run's tagged tables, a single-table
    run's one table; None for any other run."""
    served = served_tables(run)
    if served is not None:
        return served[0], served[2]
    if STREAM_TAG in run.tags:
        target, _, table = run.tags[STREAM_TAG].partition(":")
        return target, {table}
    return None


def stream_groups(config: SiphonConfig, specs: list[TableSpec]) -> list[StreamGroup]:
    """One group per (target, group name) that has at least one table replicated to the target."""
    members: dict[tuple[str, str], list[TableSpec]] = {}
    for spec in specs:
        group = config.streaming.group_of(spec.qualified_name)
        for target in spec.targets:
            members.setdefault((target, group), []).append(spec)
    groups = [StreamGroup(target, name, tuple(tables)) for (target, name), tables in members.items()]
    table_jobs = {spec.stream_job_name(target): spec.qualified_name for spec in specs for target in spec.targets}
    for group in groups:
        if group.job_name in table_jobs:
            raise ValueError(f"streaming.groups.{group.name}: the group's job {group.job_name} has the name of "
                             f"table {table_jobs[group.job_name]}'s own job; rename the group")
    return groups


def live_streaming_runs(instance: dg.DagsterInstance, application_tag: str, now: float
                        ) -> list[tuple[dg.DagsterRun, str | None]]:
    """The application's in-progress streaming runs (group and single-table), each with why its
    worker is gone (None: it may be alive)."""
    from siphon_dagster.run_liveness import IN_PROGRESS, all_run_records, dead_run_reason

    records = all_run_records(instance, dg.RunsFilter(statuses=IN_PROGRESS, tags={APPLICATION_TAG: application_tag}))
    return [(r.dagster_run, dead_run_reason(r.dagster_run, r.start_time, now)) for r in records
            if GROUP_TAG in r.dagster_run.tags or STREAM_TAG in r.dagster_run.tags]


# How far back an ended run's worker is looked for: Dagster's run monitoring marks a run canceled
# once it has been canceling for a few minutes, whether or not its worker stopped.
LINGERING_WITHIN_SECONDS = 24 * 3600.0


def lingering_streaming_runs(instance: dg.DagsterInstance, application_tag: str, now: float
                             ) -> list[tuple[dg.DagsterRun, int, float]]:
    """The application's streaming runs that Dagster records as canceled or failed while their
    worker process still runs on this host, each with that process's id and when the run ended.
    Such a worker still applies its tables: run monitoring marks a cancellation done after its
    timeout whether or not the worker stopped."""
    from siphon_dagster.run_liveness import all_run_records, live_worker_pid

    ended = [dg.DagsterRunStatus.CANCELED, dg.DagsterRunStatus.FAILURE]
    records = all_run_records(instance, dg.RunsFilter(statuses=ended, tags={APPLICATION_TAG: application_tag},
                                                      updated_after=_utc(now - LINGERING_WITHIN_SECONDS)))
    lingering = []
    for record in records:
        run = record.dagster_run
        if GROUP_TAG not in run.tags and STREAM_TAG not in run.tags:
            continue
        pid = live_worker_pid(run)
        if pid is not None:
            lingering.append((run, pid, record.end_time or record.update_timestamp.timestamp()))
    return lingering


def _utc(timestamp: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)


def runs_applying(instance: dg.DagsterInstance, application_tag: str, target: str, tables: Iterable[str],
                  now: float, exclude_run_id: str | None = None) -> list[tuple[dg.DagsterRun, list[str]]]:
    """Live streaming runs (group or single-table) other than `exclude_run_id` that apply any of
    `tables` to `target`, each with those of `tables` it applies: a run about to pull those
    tables' consumers must not start beside them."""
    wanted = set(tables)
    applying = []
    for run, dead in live_streaming_runs(instance, application_tag, now):
        streamed = streamed_tables(run)
        if dead is None and run.run_id != exclude_run_id and streamed and streamed[0] == target:
            shared = wanted & streamed[1]
            if shared:
                applying.append((run, sorted(shared)))
    return applying
