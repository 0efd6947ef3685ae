"""The snapshot sensor: loads new tables, runs failed snapshot partitions again, shows each table's state.

Every tick, for each (target, table): the table's partitions as Dagster records them
(materialized, failed, in progress), the decision of `snapshot_plan.plan_table`, one run request
per partition it asks for (each run snapshots one partition, so the target's snapshot pool
`siphon_snapshot_<target>` decides how many run at once), and an observation of the table's
state when it changed (`table_state`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import dagster as dg
from dagster._core.events import DagsterEventType
from dagster._core.storage.tags import PARTITION_NAME_TAG, PRIORITY_TAG

from siphon_core.config import SnapshotsConfig
from siphon_dagster.assets import first_loads_key, snapshot_pool
from siphon_dagster.sensors import ADD_PARTITIONS_SECONDS, add_partitions, key_count, partition_requests
from siphon_dagster.shared_loads import (
    ALONE_KEY,
    BATCHED_KEY,
    MISSED_KEY,
    SHARED_RUNS_PER_TABLE,
    SharedLoads,
    SharedRuns,
)
from siphon_dagster.snapshot.pool_slots import ensure_pool_limit
from siphon_dagster.snapshot_plan import (
    FAILED,
    IN_PROGRESS,
    MATERIALIZED,
    RUN_ACTIVE,
    RUN_ENDED,
    Partitions,
    exhausted,
    plan_table,
)
from siphon_dagster.specs import TableSpec
from siphon_dagster.stream_groups import APPLICATION_TAG
from siphon_dagster.table_state import (
    FAILED_PARTITIONS_METADATA,
    IN_PROGRESS_RUNS,
    NOT_STREAMING,
    STREAMING_STARTING,
    TableState,
    latest_batch,
    latest_check_results,
    state_observation,
    streaming_states,
)
from siphon_dagster.targets.base import TableSchema

AUTOLOAD_TAG = "siphon/autoload"  # `<target>:<schema>.<table>` on every run this sensor requests
LOAD_TAG = "siphon/load"  # the load a run belongs to (when the load started)
ATTEMPT_TAG = "siphon/attempt"  # a retry: which attempt of its partition it is
# On every load run this sensor asks for, whatever its target: dagster.yaml's run queue caps how many
# run at once on the machine (`concurrency.runs.tag_concurrency_limits`), beside each target's pool.
SENSOR_LOAD_TAG = "siphon/sensor_load"
# Behind streaming runs in the run queue: a load of many partitions never delays a stream's start.
SNAPSHOT_PRIORITY = "-1"
# How often a loaded table's presence at its target is checked (a query per table at the target).
TABLE_CHECK_SECONDS = 120.0
# A tick stops looking at tables after this long (the daemon gives a sensor 60 s), and the next
# tick begins where it stopped: each table costs a few queries of the instance's storage. Half
# the limit: with 40 s, the last table's look and the rest of the tick once took more than the
# 20 s left (300 tables on a loaded 2-core machine).
TICK_BUDGET_SECONDS = 30.0
# A table with nothing for the sensor to do (no load, no failed or running partition, every
# partition loaded or loads off) is looked at again after this long rather than every tick: each
# look costs several queries of the instance's storage, and hundreds of settled tables made the
# sensor a steady share of a small machine's CPU. Its state on the asset is refreshed as often.
SETTLED_LOOK_SECONDS = 120.0
# With many tables, settled ones are looked at no more often than this many a second in all (500
# tables to two targets: every 1,000 s). What such a look alone finds waits that long: a state to
# show, a table gone from its target with nothing recorded. What else changes a settled table's
# plan wakes it for the next tick, whatever the number of tables (`WakeUps`).
SETTLED_LOOKS_PER_SECOND = 1.0
# A tick records at most this many table states; the rest keep their last recorded state and are
# looked at again next tick. A first start of 500 tables changed every table's state twice within a
# minute, a thousand events the daemon stored one by one while the streaming runs were starting.
# Fewer a tick costs more: a table whose state waits is not settled, and is looked at again at
# every tick until it is recorded (at 200 tables, 60 a tick took the code server 29 s of sensor
# time in the first 150 s, against under 2 s in the first 75 s with all 200 at once). A state
# that names failed partitions is recorded whatever the count.
STATE_EVENTS_PER_TICK = 200
SETTLED_KEY = "settled_at"  # in a table's cursor entry: when it was last found settled
RESUME_KEY = "_resume"  # in the cursor: the table the next tick begins with (no table id starts with _)
WAKE_KEY = "_wake_after"  # in the cursor: by event type, the newest event storage id WakeUps read

# Metadata of the observation `siphon-dagster target drop` records on the target asset.
DROPPED_METADATA = "siphon/dropped"
_DROP_LOOKBACK = 100

_Key = TypeVar("_Key")
_Answer = TypeVar("_Answer")

_STATUS = {"MATERIALIZED": MATERIALIZED, "FAILED": FAILED, "IN_PROGRESS": IN_PROGRESS}


def record_drop(instance: dg.DagsterInstance, asset_key: dg.AssetKey, what: str) -> None:
    """Tells the snapshot sensor that a table was dropped at a target, so that it loads it again
    even when a streaming run has created it anew before the sensor looked."""
    instance.report_runless_asset_event(dg.AssetObservation(
        asset_key=asset_key, description=f"{what} dropped; the snapshot sensor loads it again",
        metadata={DROPPED_METADATA: True}))


def made_anew(asset_key: dg.AssetKey, what: str) -> dg.AssetObservation:
    """What a streaming run records when its batch found no table at the target and made it: the
    target lost the table (dropped by hand, a database restored or replaced), and the sensor, which
    looks for a loaded table at its target only every few minutes, would find it there again. The
    observation is the sensor's signal, as a recorded drop is."""
    return dg.AssetObservation(
        asset_key=asset_key,
        description=f"{what} was not at the target, so the stream made it; the snapshot sensor loads it again",
        metadata={DROPPED_METADATA: True})


def was_at_target(instance: dg.DagsterInstance, asset_key: dg.AssetKey) -> bool:
    """Whether a table the stream found missing at its target had been there: anything of it
    materialized before (a load's partition, a stream's batch). One never materialized is new
    there, not lost: nothing to load again, so no `made_anew` signal (a first start of 500 tables
    recorded 500 of them, and each woke the sensor for a full look at its table)."""
    return bool(instance.fetch_materializations(asset_key, limit=1).records)


def materialized_assets(instance: dg.DagsterInstance, asset_keys: Sequence[dg.AssetKey]) -> set[dg.AssetKey]:
    """`was_at_target` for many assets in one read (their asset records)."""
    return {record.asset_entry.asset_key for record in instance.get_asset_records(list(asset_keys))
            if record.asset_entry.last_materialization_record is not None}


def _drops_since(instance: dg.DagsterInstance, asset_key: dg.AssetKey, seen: int | None
                 ) -> tuple[int | None, int | None]:
    """The storage id of the latest drop recorded after the observation `seen` (None when there is
    none), and the latest observation's id. The first look only sets that mark: an older drop was
    followed by a load."""
    filters = dg.AssetRecordsFilter(asset_key=asset_key, after_storage_id=seen)
    # The first look needs the latest observation only (newest first): the table's own state
    # observations may be a hundred, each read and decoded.
    records = instance.fetch_observations(filters, limit=_DROP_LOOKBACK if seen is not None else 1).records
    if not records:
        return None, seen
    latest = max(record.storage_id for record in records)
    if seen is None:
        return None, latest
    drops = [record.storage_id for record in records
             if record.asset_observation is not None and DROPPED_METADATA in record.asset_observation.metadata]
    return max(drops, default=None), latest


def _lost_partitions(instance: dg.DagsterInstance, asset_key: dg.AssetKey, keys: Sequence[str],
                     drop: int | None) -> frozenset[str]:
    """The partitions whose rows the drop recorded at storage id `drop` took away: every one not
    materialized since (a range a growing table filled after its load holds rows the stream wrote).
    One materialized after it (a load that ran after the table was made again) is at the target."""
    if drop is None:
        return frozenset()
    latest = instance.event_log_storage.get_latest_storage_id_by_partition(
        asset_key, DagsterEventType.ASSET_MATERIALIZATION, set(keys))
    return frozenset(key for key in keys if latest.get(key, -1) < drop)


class WakeUps:
    """The target assets with an event since the last tick that changes what the sensor decides for
    a settled table: a run of a partition planned (a backfill, a run by hand) or failed, a drop
    recorded (`record_drop`, `made_anew`). Read for every table at once, a few queries a tick: a
    settled table is otherwise looked at only every `settled_look_interval`.

    The first tick only notes where the event log ends (every table is looked at then). An event
    stored with a smaller id after a newer one was read is missed here, and found by the table's
    next settled look as before."""

    EVENTS = (DagsterEventType.ASSET_MATERIALIZATION_PLANNED, DagsterEventType.ASSET_FAILED_TO_MATERIALIZE,
              DagsterEventType.ASSET_OBSERVATION)
    PAGE = 1000
    # Pages read per event type a tick; beyond (a sensor stopped for days), every table is woken
    # and the reading starts again from the log's end.
    MAX_PAGES = 20

    def __init__(self, instance: dg.DagsterInstance, after: Mapping[str, int] | None) -> None:
        storage = instance.event_log_storage
        self.keys: set[dg.AssetKey] = set()
        self.everything = False
        self.marks: dict[str, int] = dict(after or {})
        for event_type in self.EVENTS:
            mark = self.marks.get(event_type.value)
            if mark is None:  # where the log ends now: nothing before it wakes a table
                self.marks[event_type.value] = self._newest(storage, event_type)
                continue
            for _ in range(self.MAX_PAGES):
                records = storage.get_event_records(
                    dg.EventRecordsFilter(event_type=event_type, after_cursor=mark), limit=self.PAGE, ascending=True)
                for record in records:
                    if record.asset_key is not None and _wakes(record):
                        self.keys.add(record.asset_key)
                if records:
                    mark = records[-1].storage_id
                if len(records) < self.PAGE:
                    break
            else:
                self.everything = True
                mark = self._newest(storage, event_type)
            self.marks[event_type.value] = mark

    @staticmethod
    def _newest(storage: Any, event_type: DagsterEventType) -> int:
        newest = storage.get_event_records(dg.EventRecordsFilter(event_type=event_type), limit=1)
        return newest[0].storage_id if newest else 0

    def woken(self, asset_key: dg.AssetKey) -> bool:
        return self.everything or asset_key in self.keys


def _wakes(record: Any) -> bool:
    observation = record.asset_observation
    return observation is None or DROPPED_METADATA in observation.metadata  # observations: drops only


class ChunkedReads(Generic[_Key, _Answer]):
    """Answers per key read `CHUNK` keys at a time, as a tick reaches them (`keys`: those it will
    look at, in order). One query answers for a chunk where asking for one key cost Dagster's
    SQLite storage a connection and a few milliseconds of CPU; a chunk is read just before its
    tables are looked at, so what it says is seconds old at most. A key not listed is read alone."""

    CHUNK = 50

    def __init__(self, keys: Sequence[_Key], read: Callable[[list[_Key]], Mapping[_Key, _Answer]]) -> None:
        self._keys = list(keys)
        self._position = {key: index for index, key in enumerate(self._keys)}
        self._read = read
        self._known: dict[_Key, _Answer] = {}

    def __call__(self, key: _Key) -> _Answer:
        if key not in self._known:
            start = self._position.get(key)
            chunk = [key] if start is None else \
                [k for k in self._keys[start:start + self.CHUNK] if k not in self._known]
            self._known.update(self._read(chunk))
        return self._known[key]


class RecordedAssets(ChunkedReads[dg.AssetKey, bool]):
    """Whether each target asset has anything recorded (a materialization, a planned run, an
    observation): asking for one asset cost 8 - 16 ms of CPU, about what the reads it spares cost."""

    def __init__(self, instance: dg.DagsterInstance, keys: Sequence[dg.AssetKey]) -> None:
        def read(chunk: list[dg.AssetKey]) -> dict[dg.AssetKey, bool]:
            found = {record.asset_entry.asset_key for record in instance.get_asset_records(chunk)}
            return {key: key in found for key in chunk}

        super().__init__(keys, read)


class LatestChecks(ChunkedReads[dg.AssetKey, dict[str, str]]):
    """Each target asset's checks by name, with their latest results (`latest_check_results`):
    3 ms of CPU asked for one table, 0.1 ms per table asked for 50."""

    def __init__(self, instance: dg.DagsterInstance, keys: Sequence[dg.AssetKey],
                 check_keys: Mapping[dg.AssetKey, Sequence[dg.AssetCheckKey]]) -> None:
        def read(chunk: list[dg.AssetKey]) -> dict[dg.AssetKey, dict[str, str]]:
            latest = latest_check_results(instance, [check for key in chunk for check in check_keys.get(key, ())])
            return {key: {check.name: latest[check] for check in check_keys.get(key, ())} for key in chunk}

        super().__init__(keys, read)


def table_id(spec: TableSpec, target: str) -> str:
    return f"{target}:{spec.qualified_name}"


class TargetProbe:
    """Whether tables exist at one target; a target that cannot be reached is asked once a tick."""

    def __init__(self, name: str, resource: Any, log: Any) -> None:
        self.name = name
        self._resource = resource
        self._log = log
        self._target: Any = None
        self.error: str | None = None

    def table_missing(self, spec: TableSpec) -> bool | None:
        if self.error is not None:
            return None
        try:
            if self._target is None:
                self._target = self._resource.open_target()
            return not self._target.table_exists(TableSchema(spec.schema, spec.name, ()))
        except Exception as error:  # any failure to reach it: this target waits, the others go on
            self.error = str(error)
            self._log.warning(f"{self.name}: cannot reach the target, so no snapshot of it is requested this "
                              f"tick: {error}")
            return None

    def close(self) -> None:
        if self._target is not None:
            try:
                self._target.close()
            except Exception as error:
                self._log.warning(f"{self.name}: closing the target: {error}")


def settled_look_interval(tables: int) -> float:
    """How long a settled table waits for its next look, in a sensor of `tables` (table, target)s."""
    return max(SETTLED_LOOK_SECONDS, tables / SETTLED_LOOKS_PER_SECOND)


def build_snapshot_sensor(specs: list[TableSpec], group: str, settings: SnapshotsConfig,
                          check_keys: Mapping[dg.AssetKey, Sequence[dg.AssetCheckKey]] | None = None,
                          table_check_seconds: float = TABLE_CHECK_SECONDS,
                          tick_budget_seconds: float = TICK_BUDGET_SECONDS,
                          settled_look_seconds: float | None = None,
                          state_events_per_tick: int = STATE_EVENTS_PER_TICK) -> dg.SensorDefinition:
    """`{group}_snapshots`. `check_keys` names each target asset's checks, whose latest results the
    table's state shows. A tick looks at tables for `tick_budget_seconds` at most, and the next
    one goes on from the first table it left. A settled table is looked at every
    `settled_look_seconds` (default: `settled_look_interval`, or 0 when `table_check_seconds` is 0)."""
    if settled_look_seconds is None:
        tables = sum(len(spec.targets) for spec in specs)
        settled_look_seconds = settled_look_interval(tables) if table_check_seconds else 0.0
    targets = sorted({target for spec in specs for target in spec.targets})
    checks = dict(check_keys or {})
    application_tag = specs[0].tags[APPLICATION_TAG] if specs else ""

    @dg.sensor(
        name=f"{group}_snapshots",
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        asset_selection=[spec.target_key(target) for spec in specs for target in spec.targets]
        + ([first_loads_key(target) for target in targets] if settings.tables_per_load_run > 1 else []),
        required_resource_keys={"source", *(f"{target}_target" for target in targets)},
        description="Snapshots every partition of a table new to the configuration or missing at its target, "
                    f"runs a failed snapshot partition again (up to {settings.max_attempts} attempts, waiting "
                    "longer each time), and records each table's state on its target asset when it changes. "
                    "The cursor holds each table's load in progress and failed partitions' attempts.",
    )
    def _snapshots(context: dg.SensorEvaluationContext, **_resources: Any) -> dg.SensorResult:
        # The resources are read from the context (which targets there are depends on the
        # configuration); a direct call also passes them by name, hence `_resources`.
        started = time.monotonic()
        state: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}
        now = time.time()

        def settled(name: str) -> bool:
            at = state.get(name, {}).get(SETTLED_KEY)
            return at is not None and now - at < settled_look_seconds

        # A table's partitions are read when it is looked at, once per table: a read of the
        # instance's storage each, and a tick that ends at its budget leaves the rest unread.
        existing: dict[str, Sequence[str]] = {}

        def partitions_of(spec: TableSpec) -> Sequence[str]:
            if spec.partitions_def_name not in existing:
                existing[spec.partitions_def_name] = context.instance.get_dynamic_partitions(spec.partitions_def_name)
            return existing[spec.partitions_def_name]

        probes = {target: TargetProbe(target, getattr(context.resources, f"{target}_target"), context.log)
                  for target in targets}
        run_requests: list[dg.RunRequest] = []
        events: list[dg.AssetObservation] = []
        tables = [(spec, target) for spec in specs for target in spec.targets]
        names = [table_id(spec, target) for spec, target in tables]
        # Tables left over by the last tick come first, so that every table has its turn.
        first = names.index(state[RESUME_KEY]) if state.get(RESUME_KEY) in names else 0
        cursor: dict[str, Any] = {name: state[name] for name in names if name in state}
        wake_ups = WakeUps(context.instance, state.get(WAKE_KEY))
        cursor[WAKE_KEY] = wake_ups.marks

        def due(index: int) -> bool:
            spec, target = tables[index]
            return not settled(names[index]) or wake_ups.woken(spec.target_key(target))

        # The target assets this tick looks at, in order: what is recorded of them is read in chunks.
        looked_at = [tables[i][0].target_key(tables[i][1]) for i in [*range(first, len(tables)), *range(first)] if due(i)]
        recorded = RecordedAssets(context.instance, looked_at)
        latest_checks = LatestChecks(context.instance, looked_at, checks)

        shared_runs = SharedRuns(context.instance)
        shared_loads = SharedLoads(settings.tables_per_load_run, now)
        # Which tables the streaming runs serve: read once a tick, for every table at once.
        streaming: list[dict[tuple[str, str], str]] = []

        def streaming_of(target: str, table: str) -> str:
            if not streaming:
                streaming.append(streaming_states(context.instance, application_tag))
            return streaming[0].get((target, table), NOT_STREAMING)

        def tick(spec: TableSpec, target: str, name: str, keys: Sequence[str]) -> None:
            try:
                requests, event, entry, shareable = _tick_table(context, spec, target, keys, state.get(name, {}), probes[target],
                                                     settings, latest_checks(spec.target_key(target)),
                                                     table_check_seconds, streaming_of,
                                                     recorded(spec.target_key(target)), shared_runs)
            except Exception as error:  # one table's problem holds back no other table
                context.log.error(f"{name}: {error}")
                return
            if shareable and shared_loads.enabled:
                shared_loads.add(spec, target, name, requests[0])
            else:
                run_requests.extend(requests)
            if event is not None:
                if len(events) < state_events_per_tick or FAILED_PARTITIONS_METADATA in event.metadata:
                    events.append(event)
                else:  # recorded at a later tick: the entry keeps the state recorded last
                    entry = {key: value for key, value in entry.items() if key not in ("state", SETTLED_KEY)}
                    if "state" in state.get(name, {}):
                        entry["state"] = state[name]["state"]
                    deferred.append(name)
            cursor[name] = entry

        # Tables without partitions yet (the partitions sensor has not run since they were
        # configured) are ticked last, with the partitions this tick adds before it requests their
        # loads: their sizes are read at the source in one query.
        without_partitions: list[tuple[TableSpec, str, str]] = []
        deferred: list[str] = []  # tables whose new state waits for a later tick
        try:
            for index in range(first, first + len(tables)):
                spec, target = tables[index % len(tables)]
                name = names[index % len(tables)]
                if not due(index % len(tables)):
                    continue  # its cursor entry is carried over as it is
                if index > first and time.monotonic() - started > tick_budget_seconds:
                    context.log.info(f"tick budget of {tick_budget_seconds:.0f}s spent: {name} and the tables after "
                                     "it are looked at next tick")
                    cursor[RESUME_KEY] = name
                    break
                keys = partitions_of(spec)
                if keys:
                    tick(spec, target, name, keys)
                else:
                    without_partitions.append((spec, target, name))
            if without_partitions:
                new_specs = list({spec.partitions_def_name: spec for spec, _, _ in without_partitions}.values())
                added = _missing_partitions(context, new_specs, partitions_of)
                for position, (spec, target, name) in enumerate(without_partitions):
                    # The budget holds here too: on a first start every table is new, and one tick
                    # looked at 500 of them for 99 s, a core taken from the streaming runs starting
                    # beside it. The rest have their partitions from this tick, and wait for the next.
                    if position and time.monotonic() - started > tick_budget_seconds:
                        context.log.info(f"tick budget of {tick_budget_seconds:.0f}s spent: {name} and the new "
                                         "tables after it are looked at next tick")
                        cursor.setdefault(RESUME_KEY, name)
                        break
                    tick(spec, target, name, added.get(spec.partitions_def_name, []))
        finally:
            for probe in probes.values():
                probe.close()
        run_requests.extend(shared_loads.requests(cursor, {PRIORITY_TAG: SNAPSHOT_PRIORITY, SENSOR_LOAD_TAG: "true",
                                                           **(specs[0].tags if specs else {})}, context.log.info))
        if deferred:
            context.log.info(f"{len(deferred)} table state(s) are recorded at the next ticks (at most "
                             f"{state_events_per_tick} a tick): {', '.join(deferred[:5])}{', ...' * (len(deferred) > 5)}")
        requested_targets = {request.tags[AUTOLOAD_TAG].split(":", 1)[0] for request in run_requests
                             if AUTOLOAD_TAG in request.tags} | shared_loads.targets
        for target in sorted(requested_targets):
            try:
                ensure_pool_limit(context.instance, snapshot_pool(target))
            except Exception as error:  # the loads still go; the run queue sets the limit a pass later
                context.log.warning(f"{target}: cannot set the limit of pool {snapshot_pool(target)}: {error}")
        return dg.SensorResult(run_requests=run_requests, asset_events=events,
                               cursor=json.dumps(cursor, sort_keys=True))

    return _snapshots


def _missing_partitions(context: dg.SensorEvaluationContext, empty: list[TableSpec],
                        existing: Callable[[TableSpec], Sequence[str]]) -> dict[str, list[str]]:
    """The partitions of `empty`, tables that have none yet (the partitions sensor has not run
    since they were configured), added to the instance before this tick requests their loads;
    `existing(spec)`: the partitions this tick read of a table (none), not read again."""
    if not empty:
        return {}
    try:
        with context.resources.source.connect() as connection:
            requests, _ = partition_requests(context.instance, connection, empty, existing=existing)
    except Exception as error:  # the source's problem: the tables wait for their partitions
        context.log.warning(f"cannot read the size of {len(empty)} new table(s) at the source: {error}")
        return {}
    added = add_partitions(context.instance, requests, budget_seconds=ADD_PARTITIONS_SECONDS)
    if added:
        context.log.info(f"added {key_count(added)} block-range partitions of {len(added)} new table(s)")
    if len(added) < len(requests):
        context.log.info(f"the partitions of {len(requests) - len(added)} new table(s) are added next tick")
    return {r.partitions_def_name: list(r.partition_keys) for r in added}


def _tick_table(context: dg.SensorEvaluationContext, spec: TableSpec, target: str, keys: Sequence[str],
                entry: Mapping[str, Any], probe: TargetProbe, settings: SnapshotsConfig,
                checks: Mapping[str, str], table_check_seconds: float,
                streaming_of: Callable[[str, str], str], recorded: bool = True,
                shared_runs: SharedRuns | None = None,
                ) -> tuple[list[dg.RunRequest], dg.AssetObservation | None, dict[str, Any], bool]:
    """The table's requests, its state to record, its next cursor entry, and whether the requests are
    a new table's load of its one partition, which may run with other tables' (`SharedLoads`).

    `checks`: the target asset's checks' latest results by name (`LatestChecks`). `recorded`:
    whether anything of the target asset is recorded (`RecordedAssets`). With nothing recorded (as
    on a first start), no partition has a status and no drop was recorded, so neither is read:
    Dagster's partition status alone was most of a table's look. `shared_runs`: the shared load
    runs' states, read once a tick."""
    instance = context.instance
    asset_key = spec.target_key(target)
    name = table_id(spec, target)
    statuses = (instance.get_status_by_partition(asset_key, list(keys), spec.partitions_def) or {}) \
        if keys and recorded else {}
    status = {key: _STATUS.get(value.name) if value is not None else None for key, value in statuses.items()}
    load_runs = _load_runs(instance, name, entry.get("load"))
    batched = entry.get(BATCHED_KEY) if entry.get("load") is not None else None
    if batched is not None:  # the table's load is a shared run's: it covers the table's partition
        load_runs[batched["key"]] = (shared_runs or SharedRuns(instance)).state(batched, time.time())
    partitions = Partitions.of(keys, status, load_runs)
    drop, seen = _drops_since(instance, asset_key, entry.get("seen")) if recorded else (None, entry.get("seen"))
    now = time.time()
    plan = plan_table(partitions, entry, load_runs=load_runs, table_missing=lambda: probe.table_missing(spec),
                      now=now, auto_load=settings.auto_load, max_attempts=settings.max_attempts,
                      first_retry_delay=settings.retry_delay_seconds, table_check_seconds=table_check_seconds,
                      lost=_lost_partitions(instance, asset_key, keys, drop))
    if batched is not None and "load" in plan.entry:
        plan.entry[BATCHED_KEY] = batched
    loaded = bool(keys) and partitions.materialized == frozenset(keys)
    missed = int(entry.get(MISSED_KEY, 0)) if not loaded else 0
    if batched is not None and "load" not in plan.entry and not loaded:  # the shared run ended without it
        missed += 1
        alone = missed >= SHARED_RUNS_PER_TABLE
        context.log.info(f"{name}: its shared load run ended without loading it; it loads again "
                         + ("in runs of its own" if alone else "in the next shared load run"))
    if missed:
        plan.entry[MISSED_KEY] = missed
    if not loaded and (entry.get(ALONE_KEY) or missed >= SHARED_RUNS_PER_TABLE):
        plan.entry[ALONE_KEY] = True  # runs of its own from now on
    if plan.drop_deferred:
        seen = entry.get("seen")  # not acted on (the target did not answer): looked at again next tick
    if seen is not None:
        plan.entry["seen"] = seen
    requests = []
    if plan.load_started:
        context.log.info(f"{name}: loading all {len(plan.load)} partitions")
    load_id = str(plan.entry["load"]["at"]) if plan.load else ""
    # Partitions a drop took away may have run in this load already: their runs need keys of their own.
    again = f":drop:{drop}" if plan.reload else ""
    for key in plan.load:
        requests.append(_request(spec, target, key, run_key=f"{name}:{key}:load:{load_id}{again}",
                                 tags={LOAD_TAG: load_id}))
    # A new table of one partition may load in a run shared with others (`SharedLoads`).
    shareable = (plan.load_started and not plan.reload and not plan.retries and len(keys) == 1
                 and not plan.entry.get(ALONE_KEY))
    for retry in plan.retries:
        context.log.info(f"{name}: partition {retry.key} failed; attempt {retry.attempt} of {settings.max_attempts}")
        requests.append(_request(spec, target, retry.key, run_key=f"{name}:{retry.key}:retry:{retry.since}:{retry.attempt}",
                                 tags={ATTEMPT_TAG: str(retry.attempt)}))
    failed = plan.entry.get("failed", {})
    waiting = [record["retry_at"] for record in failed.values()
               if record.get("retry_at") is not None and record["attempts"] < settings.max_attempts]
    table_state = TableState(
        partitions=partitions,
        loading="load" in plan.entry,
        failed_attempts={key: record["attempts"] for key, record in failed.items()},
        exhausted=exhausted(plan.entry, settings.max_attempts),
        next_retry=min(waiting) if waiting else None,
        streaming=streaming_of(target, spec.qualified_name),
        checks=dict(checks),
    )
    digest = table_state.digest()
    event = None
    # A run that is starting is running a tick later: a table that already has a state waits for
    # that, rather than recording a state that lasts seconds (every table of a run at once).
    transient = table_state.streaming == STREAMING_STARTING and "state" in entry and not table_state.failed_attempts
    if digest != entry.get("state") and not transient:
        event = state_observation(asset_key, table_state, latest_batch(instance, asset_key) if recorded else {})
    if table_state.exhausted and not exhausted(entry, settings.max_attempts):
        context.log.error(f"{name}: {table_state.text}")
    recorded_state = event is not None or digest == entry.get("state")
    plan.entry["state"] = digest if recorded_state else entry["state"]
    plan.entry.pop(SETTLED_KEY, None)
    if (recorded_state and not requests and "load" not in plan.entry and "failed" not in plan.entry and not partitions.in_progress
            and keys and not plan.drop_deferred and (not settings.auto_load or partitions.materialized == frozenset(keys))):
        plan.entry[SETTLED_KEY] = now
    return requests, event, plan.entry, shareable


def _request(spec: TableSpec, target: str, key: str, run_key: str, tags: Mapping[str, str]) -> dg.RunRequest:
    return dg.RunRequest(
        run_key=run_key,
        asset_selection=[spec.target_key(target)],
        asset_check_keys=[],  # a partition's load is no occasion for whole-table checks
        partition_key=key,
        # Not the snapshot-run tag: the op sets it with its worker's identity once it holds a pool
        # slot; a run waiting that long for a slot without a worker tag would look dead.
        tags={AUTOLOAD_TAG: table_id(spec, target), PRIORITY_TAG: SNAPSHOT_PRIORITY, SENSOR_LOAD_TAG: "true",
              **spec.tags, **tags},
    )


def _load_runs(instance: dg.DagsterInstance, name: str, load: Mapping[str, Any] | None) -> dict[str, str]:
    """The partitions that runs of the load in progress cover, active or ended."""
    if load is None:
        return {}
    covered: dict[str, str] = {}
    records = instance.get_run_records(dg.RunsFilter(tags={AUTOLOAD_TAG: name, LOAD_TAG: str(load["at"])}))
    for record in records:
        key = record.dagster_run.tags.get(PARTITION_NAME_TAG)
        if key is None:
            continue
        active = record.dagster_run.status in IN_PROGRESS_RUNS
        if active or key not in covered:
            covered[key] = RUN_ACTIVE if active else RUN_ENDED
    return covered
