"""New small tables loaded many to a run (`snapshots.tables_per_load_run`), for the snapshot sensor.

A run costs seconds of start-up (a process, Dagster's imports and definitions, its events) while
loading a table of a few thousand rows costs a tenth of one: a first start of hundreds of small
tables spent nearly all its time starting runs. The sensor hands each new table whose load is a
single partition to `SharedLoads`, which asks for one run of the target's `first_loads` asset
(`assets.build_first_loads_asset`) per `tables_per_load_run` of them; that run records each
table's partition materialized on the table's own asset.

Each table's cursor entry keeps the run's id (`BATCHED_KEY`) while its load is in progress, and
`SharedRuns` tells the sensor whether that run is still active: an active shared run covers the
table's partition as a run of its own would. A table the run did not load (the run was killed
or never made, or the table failed there) goes into the next tick's shared runs again: a kill -9
takes every table of the runs in flight, and tens of them each in a run of its own cost minutes of
run start-ups. After `SHARED_RUNS_PER_TABLE` shared runs ended without it (counted in
`MISSED_KEY`), it is marked `ALONE_KEY` and loads in runs of its own, with the usual retries and
their limit, until it is loaded: a table that fails in every run no longer holds up a shared one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import dagster as dg

from siphon_dagster.assets import FirstLoadsConfig, first_loads_key
from siphon_dagster.snapshot_plan import RUN_ACTIVE, RUN_ENDED
from siphon_dagster.specs import TableSpec
from siphon_dagster.table_state import IN_PROGRESS_RUNS

FIRST_LOADS_TAG = "siphon/first_loads"  # on a shared load run: its id
BATCHED_KEY = "batched"  # in a table's cursor entry: {"id": the run's id, "key": its partition, "at": asked}
MISSED_KEY = "shared_missed"  # in a table's cursor entry: shared runs that ended without loading it
ALONE_KEY = "alone"  # in a table's cursor entry: that many shared runs did not load it
SHARED_RUNS_PER_TABLE = 2  # shared runs a table may end without being loaded by, before it loads alone
# A shared run asked for but still not in the instance after this long (the daemon dropped the
# request) counts as ended: its tables load again.
GRACE_SECONDS = 120.0


class SharedRuns:
    """Whether shared load runs are active or ended, each looked up once a tick."""

    def __init__(self, instance: dg.DagsterInstance) -> None:
        self._instance = instance
        self._known: dict[str, str | None] = {}

    def state(self, batched: Mapping[str, Any], now: float) -> str:
        """RUN_ACTIVE or RUN_ENDED for the shared run a table's entry names."""
        run_id = batched["id"]
        if run_id not in self._known:
            records = self._instance.get_run_records(dg.RunsFilter(tags={FIRST_LOADS_TAG: run_id}), limit=1)
            self._known[run_id] = None if not records else (
                RUN_ACTIVE if records[0].dagster_run.status in IN_PROGRESS_RUNS else RUN_ENDED)
        known = self._known[run_id]
        if known is None:  # asked for, not yet created by the daemon
            return RUN_ACTIVE if now - float(batched["at"]) < GRACE_SECONDS else RUN_ENDED
        return known


@dataclass(frozen=True)
class _NewTable:
    spec: TableSpec
    target: str
    name: str  # the table's id in the cursor
    request: dg.RunRequest  # the run of its own it would have had


class SharedLoads:
    """This tick's new one-partition tables, made into shared runs per target at the tick's end."""

    def __init__(self, tables_per_run: int, now: float) -> None:
        self.tables_per_run = tables_per_run
        self.now = now
        self._tables: list[_NewTable] = []
        self.targets: set[str] = set()  # the targets this tick asked shared runs of

    @property
    def enabled(self) -> bool:
        return self.tables_per_run > 1

    def add(self, spec: TableSpec, target: str, name: str, request: dg.RunRequest) -> None:
        self._tables.append(_NewTable(spec, target, name, request))

    def requests(self, cursor: MutableMapping[str, Any], tags: Mapping[str, str],
                 log: Callable[[str], None]) -> list[dg.RunRequest]:
        """A run per `tables_per_run` tables of a target (a table left alone keeps its own run),
        with `tags`; each shared table's `cursor` entry notes the run."""
        requests: list[dg.RunRequest] = []
        by_target: dict[str, list[_NewTable]] = {}
        for table in self._tables:
            by_target.setdefault(table.target, []).append(table)
        for target, tables in by_target.items():
            for start in range(0, len(tables), self.tables_per_run):
                chunk = tables[start:start + self.tables_per_run]
                if len(chunk) == 1:
                    requests.append(chunk[0].request)
                    continue
                run_id = f"{target}:{self.now}:{start // self.tables_per_run}"
                config = FirstLoadsConfig(tables=[t.spec.qualified_name for t in chunk],
                                          partitions=[t.request.partition_key or "" for t in chunk])
                requests.append(dg.RunRequest(
                    run_key=f"first_loads:{run_id}",
                    asset_selection=[first_loads_key(target)],
                    asset_check_keys=[],
                    run_config=dg.RunConfig(ops={first_loads_key(target).to_python_identifier(): config}),
                    tags={**tags, FIRST_LOADS_TAG: run_id},
                ))
                for table in chunk:
                    cursor[table.name] = {**cursor.get(table.name, {}),
                                          BATCHED_KEY: {"id": run_id, "key": table.request.partition_key,
                                                        "at": self.now}}
                self.targets.add(target)
                log(f"{target}: {len(chunk)} new tables load in one run: {', '.join(config.tables[:5])}"
                    f"{', ...' if len(chunk) > 5 else ''}")
        return requests
