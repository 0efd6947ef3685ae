"""Each table's state at a glance: one observation on its target asset, recorded when it changes.

The observation's description is the state in words ("loaded", "snapshotting: 3 of 10 partitions
loaded, 2 running", "2 partitions failed after 3 attempts: ..."), and its metadata the figures
behind it, so the asset's page (latest observation, Events tab) answers "is this table loaded,
streaming, behind, checked?" without opening runs. Only a change of state is recorded, not each
tick's lag, so hundreds of tables never flood the event log.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_START_TAG, PARTITION_NAME_TAG

from siphon_dagster.run_liveness import IN_PROGRESS, all_run_records
from siphon_dagster.snapshot_plan import Partitions
from siphon_dagster.stream_groups import APPLICATION_TAG, streamed_tables

IN_PROGRESS_RUNS = IN_PROGRESS
# A streaming batch's materialization: the snapshot's carry no LSN. A few snapshot partitions may
# come between two batches; further back, the table has not streamed lately.
_BATCH_LOOKBACK = 25
_LISTED = 5  # partitions named in the state line; the metadata lists them all


@dataclass(frozen=True)
class TableState:
    partitions: Partitions
    loading: bool
    failed_attempts: Mapping[str, int]  # failed partitions (retrying or not) and their attempts so far
    exhausted: Mapping[str, int]  # failed partitions left to an operator
    next_retry: float | None
    streaming: str  # "running", "starting" or "not running"
    checks: Mapping[str, str] = field(default_factory=dict)  # check name -> latest result

    @property
    def text(self) -> str:
        p = self.partitions
        total, loaded = len(p.keys), len(p.materialized)
        if self.exhausted:
            listed = ", ".join(sorted(self.exhausted)[:_LISTED]) + (", ..." if len(self.exhausted) > _LISTED else "")
            attempts = max(self.exhausted.values())
            return (f"{len(self.exhausted)} partition{'s' * (len(self.exhausted) > 1)} failed after "
                    f"{attempts} attempts: {listed} (materialize them to try again; {loaded} of {total} loaded)")
        if self.loading or p.in_progress or p.failed:
            parts = [f"{loaded} of {total} partitions loaded"]
            if p.in_progress:
                parts.append(f"{len(p.in_progress)} running")
            if p.failed:
                when = "" if self.next_retry is None else \
                    f", next attempt at {datetime.datetime.fromtimestamp(self.next_retry, datetime.UTC):%H:%M:%S} UTC"
                parts.append(f"{len(p.failed)} failed, retrying{when}")
            return "snapshotting: " + ", ".join(parts)
        if not loaded:
            return "not loaded"
        if loaded < total:
            # Partitions added as the table grew after its load: their rows came by the stream.
            return f"loaded ({loaded} of {total} partitions snapshotted, the later blocks streamed)"
        return "loaded"

    def digest(self) -> str:
        """What a change of state is judged on: not the lag, which moves every batch."""
        p = self.partitions
        summary = [self.text, len(p.keys), len(p.materialized), len(p.in_progress), sorted(self.failed_attempts.items()),
                   self.streaming, sorted(self.checks.items())]
        return hashlib.sha1(json.dumps(summary).encode()).hexdigest()[:16]


NOT_STREAMING = "not running"
STREAMING_STARTING = "starting"  # the run serving the table has not started yet
FAILED_PARTITIONS_METADATA = "siphon/partitions_failed"
# A check result's metadata key saying why it did not compare (its value, e.g. "loading"): not a failure.
NOT_COMPARED = "not_compared"
# How a group run's observation on a table's asset begins when the table's stream stopped on an error.
STREAM_STOPPED = "streaming stopped"


def streaming_states(instance: dg.DagsterInstance, application_tag: str) -> dict[tuple[str, str], str]:
    """(target, schema.table) -> "running" or "starting" for every table an in-progress streaming
    run of the application serves: the group runs (by the tables they are tagged with) and
    single-table drains. One query for every table; a table left out is `NOT_STREAMING`."""
    records = all_run_records(instance, dg.RunsFilter(statuses=IN_PROGRESS_RUNS,
                                                      tags={APPLICATION_TAG: application_tag}))
    states: dict[tuple[str, str], str] = {}
    for record in records:
        run = record.dagster_run
        streamed = streamed_tables(run)
        if streamed is None:
            continue
        target, tables = streamed
        state = "running" if run.status == dg.DagsterRunStatus.STARTED else STREAMING_STARTING
        for table in tables:
            if states.get((target, table)) != "running":
                states[(target, table)] = state
    return states


def snapshot_runs_in_progress(instance: dg.DagsterInstance, asset_key: dg.AssetKey) -> list[dg.DagsterRun]:
    """The runs, queued or running, that write block ranges of the asset into its live table: a
    partition or a range of them, from the snapshot sensor, a backfill, the UI or the CLI. (A resync
    loads a shadow table and leaves the live one whole until its swap.)"""
    records = all_run_records(instance, dg.RunsFilter(statuses=IN_PROGRESS_RUNS))
    return [record.dagster_run for record in records
            if asset_key in (record.dagster_run.asset_selection or ())
            and (PARTITION_NAME_TAG in record.dagster_run.tags
                 or ASSET_PARTITION_RANGE_START_TAG in record.dagster_run.tags)]


def latest_batch(instance: dg.DagsterInstance, asset_key: dg.AssetKey) -> dict[str, Any]:
    """The latest streaming batch's lag and applied LSN, as the streaming job recorded them."""
    result = instance.fetch_materializations(asset_key, limit=_BATCH_LOOKBACK)
    for record in result.records:
        materialization = record.asset_materialization
        if materialization is None or "applied_lsn" not in materialization.metadata:
            continue
        metadata = materialization.metadata
        batch: dict[str, Any] = {"siphon/applied_lsn": metadata["applied_lsn"].value,
                                 "siphon/last_batch_at": dg.MetadataValue.timestamp(record.timestamp)}
        if "lag_seconds" in metadata:
            batch["siphon/lag_seconds"] = metadata["lag_seconds"].value
        return batch
    return {}


def latest_check_results(instance: dg.DagsterInstance, check_keys: Sequence[dg.AssetCheckKey]
                         ) -> dict[dg.AssetCheckKey, str]:
    """Each check's latest execution: passed, failed (with its severity), or running; one query."""
    if not check_keys:
        return {}
    latest = instance.event_log_storage.get_latest_asset_check_execution_by_key(list(check_keys))
    results: dict[dg.AssetCheckKey, str] = {}
    for key in check_keys:
        record = latest.get(key)
        if record is None:
            results[key] = "never run"
            continue
        evaluation = None
        if record.event is not None and record.event.dagster_event is not None \
                and record.event.dagster_event.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION:
            evaluation = record.event.dagster_event.asset_check_evaluation_data
        if evaluation is None:
            results[key] = record.status.value.lower()
        elif NOT_COMPARED in evaluation.metadata:
            results[key] = f"not compared ({evaluation.metadata[NOT_COMPARED].value})"
        elif evaluation.passed:
            results[key] = "passed"
        else:
            results[key] = f"failed ({evaluation.severity.value.lower()})"
    return results


def state_observation(asset_key: dg.AssetKey, state: TableState, batch: Mapping[str, Any]) -> dg.AssetObservation:
    p = state.partitions
    metadata: dict[str, Any] = {
        "siphon/state": state.text,
        "siphon/partitions_loaded": len(p.materialized),
        "siphon/partitions_total": len(p.keys),
        "siphon/partitions_running": len(p.in_progress),
        "siphon/streaming": state.streaming,
    }
    if state.failed_attempts:
        metadata[FAILED_PARTITIONS_METADATA] = dg.MetadataValue.json(dict(sorted(state.failed_attempts.items())))
    if state.checks:
        metadata["siphon/checks"] = dg.MetadataValue.json(dict(sorted(state.checks.items())))
    metadata.update(batch)
    return dg.AssetObservation(asset_key=asset_key, description=state.text, metadata=metadata)
