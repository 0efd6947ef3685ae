"""How the sensors and the UI start a table's rebuild: a run of the code location's one listed
resync job (`<group>_resync`), the table named in its run config.

Every table's `resync_<table>` job is still there by name, for `dagster job execute -m
siphon_dagster -j resync_notes` and `siphon-dagster resync`, but left out of the listing as the
single-table stream jobs are (see `code_location`): Dagster's daemon fetches the snapshot of every
listed job every minute, one request per job, and at 200 tables the resync jobs were 4.6 MB of the
5.6 MB of job snapshots and four fifths of the CPU each refresh took the daemon and the code server
(2.0 s against 0.45 s), once a minute on a machine that streams. Both kinds of run carry the
table's `RESYNC_TAG`, by which two resyncs of one table are kept apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import dagster as dg

from siphon_dagster.specs import TableSpec

RESYNC_TAG = "siphon/resync"  # on every resync run: the table it rebuilds (qualified name)
RESYNC_OP_NAME = "rebuild"  # the op of `<group>_resync`, to address in run config


def tables_resync_job_name(group: str) -> str:
    """`siphon_app_resync`: the listed job that rebuilds the table its run config names."""
    return f"{group}_resync"


@dataclass(frozen=True)
class ResyncRequests:
    """Run requests of `job` (the `<group>_resync` job), for the tables it knows."""

    job: dg.JobDefinition
    tables: frozenset[str]  # qualified names

    @classmethod
    def of(cls, job: dg.JobDefinition, specs: Iterable[TableSpec]) -> ResyncRequests:
        return cls(job, frozenset(spec.qualified_name for spec in specs))

    @property
    def job_name(self) -> str:
        return self.job.name

    def covers(self, spec: TableSpec) -> bool:
        return spec.qualified_name in self.tables

    def describe(self, spec: TableSpec) -> str:
        """How a record names the rebuild: `siphon_app_resync for public.notes`."""
        return f"{self.job_name} for {spec.qualified_name}"

    def request(self, spec: TableSpec, run_key: str, tags: Mapping[str, str] | None = None) -> dg.RunRequest:
        if not self.covers(spec):
            raise ValueError(f"{self.job_name} does not know {spec.qualified_name}; it knows {sorted(self.tables)}")
        return dg.RunRequest(job_name=self.job_name, run_key=run_key,
                             run_config={"ops": {RESYNC_OP_NAME: {"config": {"table": spec.qualified_name}}}},
                             tags={RESYNC_TAG: spec.qualified_name, **spec.tags, **(tags or {})})
