"""`siphon-dagster status`: every table at every target in one line, and what needs an operator.

With hundreds of tables the UI shows one asset at a time; this reads the same records (the
instance of DAGSTER_HOME, no service is contacted) for all of them at once: whether a live run
streams the table, its latest batch (when, its lag, messages still pending), the snapshot state the
snapshot sensor recorded on the asset, and each check's latest result. A table needs attention
when no live run streams it, its stream stopped on an error, it is behind by more than
`max_lag_seconds`, a snapshot partition failed for good, or a check failed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import dagster as dg

from siphon_core import naming
from siphon_dagster.checks.definitions import check_keys
from siphon_dagster.specs import TableSpec
from siphon_dagster.stream_groups import APPLICATION_TAG, live_streaming_runs, streamed_tables
from siphon_dagster.table_state import NOT_STREAMING, STREAM_STOPPED, latest_check_results

# Observations looked through for the latest state and the latest stop: other observations (a
# table made anew, a drop) come between them only now and then.
_OBSERVATIONS_READ = 20
_OBSERVATIONS_FIRST = 3
# Materializations looked through for the latest batch: snapshot partitions' come between batches.
_MATERIALIZATIONS_READ = 25
DEAD_WORKER = "no live worker"


@dataclass
class TableStatus:
    target: str
    table: str  # schema.table, as in siphon.yaml
    asset: str  # the target asset's key as the UI spells it
    streaming: str  # "running in <run>", "starting in <run>", "no live worker in <run>" or "not running"
    worker_gone: str | None = None  # why the serving run has no live worker
    serving_run: str | None = None  # the run id of the run that serves the table
    batch_run: str | None = None  # the run id of the run that recorded the latest batch
    last_batch_at: float | None = None  # the latest streaming batch's materialization (rate-limited)
    lag_seconds: float | None = None
    pending_messages: int | None = None
    state: str = "no state recorded yet"  # the snapshot sensor's line: "loaded", "snapshotting: ..."
    checks: dict[str, str] = field(default_factory=dict)
    stopped: str | None = None  # the error the stream stopped on, since its latest batch
    stop_run: str | None = None  # the run id of the run it stopped in
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def read_statuses(instance: dg.DagsterInstance, specs: Sequence[TableSpec], targets: Sequence[str] | None = None,
                  max_lag_seconds: float = 300.0, now: float | None = None) -> list[TableStatus]:
    """The status of each (table, target) of `specs`, `targets` narrowing the targets."""
    now = time.time() if now is None else now
    pairs = [(spec, target) for spec in specs for target in spec.targets if targets is None or target in targets]
    runs = _streaming_runs(instance, specs[0].tags[APPLICATION_TAG], now) if specs else {}
    keys = {(spec.qualified_name, target): check_keys(spec, target) for spec, target in pairs}
    latest_checks = latest_check_results(instance, [key for ks in keys.values() for key in ks])
    asset_keys = [spec.target_key(target) for spec, target in pairs]
    latest = {record.asset_entry.asset_key: record.asset_entry.last_materialization_record
              for record in instance.get_asset_records(asset_keys)}
    statuses = []
    for spec, target in pairs:
        asset_key = spec.target_key(target)
        streaming, serving_run, worker_gone = runs.get((target, spec.qualified_name), (NOT_STREAMING, None, None))
        status = TableStatus(target=target, table=spec.qualified_name,
                             asset=naming.asset_path_text(target, spec.schema, spec.name),
                             streaming=streaming, worker_gone=worker_gone, serving_run=serving_run)
        status.checks = {key.name: latest_checks[key] for key in keys[(spec.qualified_name, target)]}
        _read_batch(instance, asset_key, latest.get(asset_key), status)
        _read_observations(instance, asset_key, status)
        status.problems = problems(status, max_lag_seconds, now)
        statuses.append(status)
    return statuses


def _streaming_runs(instance: dg.DagsterInstance, application_tag: str, now: float
                    ) -> dict[tuple[str, str], tuple[str, str, str | None]]:
    """(target, table) -> how the application's in-progress streaming runs serve it ("running in
    <run>", "starting in <run>", "no live worker in <run>"), that run's id, and why its worker is
    gone."""
    served: dict[tuple[str, str], tuple[str, str, str | None]] = {}
    for run, dead_reason in live_streaming_runs(instance, application_tag, now):
        streamed = streamed_tables(run)
        if streamed is None:
            continue
        target, tables = streamed
        short = run.run_id[:8]
        if dead_reason is not None:
            state = f"{DEAD_WORKER} in {short}"
        elif run.status == dg.DagsterRunStatus.STARTED:
            state = f"running in {short}"
        else:
            state = f"{run.status.value.lower()} in {short}"
        for name in tables:
            # A live run wins over one whose worker is gone, a started run over a starting one.
            if not served.get((target, name), ("", "", None))[0].startswith("running"):
                served[(target, name)] = (state, run.run_id, dead_reason)
    return served


def _read_batch(instance: dg.DagsterInstance, asset_key: dg.AssetKey, latest: Any, status: TableStatus) -> None:
    """`latest`: the asset's latest materialization record (None: it has none), read for every
    asset in one query; a snapshot partition's sends the read further back."""
    if latest is None:
        return
    records = [latest] if _is_batch(latest) else \
        instance.fetch_materializations(asset_key, limit=_MATERIALIZATIONS_READ).records
    for record in records:
        if not _is_batch(record):
            continue  # a snapshot partition's
        metadata = record.asset_materialization.metadata
        status.last_batch_at = record.timestamp
        status.batch_run = record.run_id or None
        if "lag_seconds" in metadata:
            status.lag_seconds = float(metadata["lag_seconds"].value)
        if "pending_messages" in metadata:
            status.pending_messages = int(metadata["pending_messages"].value)
        return


def _is_batch(record: Any) -> bool:
    materialization = record.asset_materialization
    return materialization is not None and "applied_lsn" in materialization.metadata


def _read_observations(instance: dg.DagsterInstance, asset_key: dg.AssetKey, status: TableStatus) -> None:
    # The few latest first: most tables' latest observation is their state, and no stop followed
    # their latest batch.
    for limit in (_OBSERVATIONS_FIRST, _OBSERVATIONS_READ):
        records = instance.fetch_observations(asset_key, limit=limit).records
        state = next((r.asset_observation for r in records
                      if r.asset_observation is not None and "siphon/state" in r.asset_observation.metadata), None)
        stop = next((r for r in records if r.asset_observation is not None
                     and (r.asset_observation.description or "").startswith(STREAM_STOPPED)), None)
        # The stop that matters came after the latest batch: one older than the oldest record read
        # would not.
        seen_past_batch = len(records) < limit or status.last_batch_at is None \
            or records[-1].timestamp <= status.last_batch_at
        if (state is not None or len(records) < limit) and (stop is not None or seen_past_batch):
            break
    if state is not None:
        status.state = str(state.metadata["siphon/state"].value)
    # A batch applied after the stop means the table streams again.
    if stop is not None and (status.last_batch_at is None or stop.timestamp > status.last_batch_at):
        metadata = stop.asset_observation.metadata
        status.stopped = str(metadata["error"].value) if "error" in metadata else stop.asset_observation.description
        status.stop_run = str(metadata["run_id"].value) if "run_id" in metadata else (stop.run_id or None)


def problems(status: TableStatus, max_lag_seconds: float, now: float) -> list[str]:
    """Why the table needs an operator; empty when it does not."""
    found = []
    if status.streaming == NOT_STREAMING:
        found.append("not streaming: no run serves it (the streaming sensor starts one while it is running)")
    elif status.worker_gone is not None:
        found.append(f"not streaming: run {(status.serving_run or '')[:8]} has no live worker "
                     f"({status.worker_gone}); the streaming sensor replaces it")
    # A stop in a run that no longer serves the table is history: the run serving it now starts
    # the table afresh (and records a stop of its own if the error comes back).
    if status.stopped is not None and (status.serving_run is None or status.stop_run == status.serving_run):
        found.append(f"its stream stopped: {status.stopped}")
    # Judged on a batch the serving run recorded: a run killed outright leaves the reports of its
    # last batches unwritten (they are applied and acked), so its latest recorded batch may show
    # a lag or a backlog that it cleared before it ended.
    own_batch = status.batch_run is not None and status.batch_run == status.serving_run
    if own_batch and status.lag_seconds is not None and status.lag_seconds > max_lag_seconds:
        found.append(f"behind: its latest batch was {status.lag_seconds:.0f}s behind the source")
    if own_batch and status.last_batch_at is not None and status.pending_messages \
            and now - status.last_batch_at > max_lag_seconds:
        found.append(f"stalled: no batch for {now - status.last_batch_at:.0f}s with {status.pending_messages} "
                     "message(s) pending")
    if "failed after" in status.state:
        found.append(f"snapshot: {status.state}")
    failed = sorted(name for name, result in status.checks.items() if result.startswith("failed"))
    if failed:
        found.append("check(s) failed: " + ", ".join(f"{name} {status.checks[name]}" for name in failed))
    return found


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def _clipped(text: str, width: int = 70) -> str:
    """A long state in the column (a failure lists partitions); the problem line holds it whole."""
    return text if len(text) <= width else text[:width - 3] + "..."


def _checks_text(checks: dict[str, str]) -> str:
    if not checks:
        return "-"
    # Failures by name, the rest counted: four checks a table, hundreds of tables.
    failed = [f"{name} {result}" for name, result in sorted(checks.items()) if result.startswith("failed")]
    counts: dict[str, int] = {}
    for result in checks.values():
        if not result.startswith("failed"):
            counts[result] = counts.get(result, 0) + 1
    return ", ".join(failed + [f"{count} {result}" for result, count in sorted(counts.items())])


def render_lines(statuses: Sequence[TableStatus], now: float) -> list[str]:
    """A column-aligned line per table, its problems indented beneath it (no lines for no tables)."""
    if not statuses:
        return []
    header = ("STATUS", "ASSET", "STREAMING", "LAST BATCH", "LAG", "PENDING", "STATE", "CHECKS")
    rows = [("OK" if s.ok else "ATTN", s.asset, s.streaming,
             _ago(None if s.last_batch_at is None else now - s.last_batch_at),
             "-" if s.lag_seconds is None else f"{s.lag_seconds:.1f}s",
             "-" if s.pending_messages is None else str(s.pending_messages),
             _clipped(s.state), _checks_text(s.checks)) for s in statuses]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]

    def line(row: Sequence[str]) -> str:
        return "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]]).rstrip()

    lines = [line(header)]
    for status, row in zip(statuses, rows, strict=True):
        lines.append(line(row))
        lines.extend(f"    - {problem}" for problem in status.problems)
    return lines


def summary_line(statuses: Sequence[TableStatus]) -> str:
    attention = sum(1 for s in statuses if not s.ok)
    return f"{attention} of {len(statuses)} table(s) at their targets need attention"


def render_json(statuses: Sequence[TableStatus]) -> list[str]:
    """A JSON object per table, for scripts and alerting."""
    return [json.dumps({**asdict(s), "ok": s.ok}, sort_keys=True) for s in statuses]
