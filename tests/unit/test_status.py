"""`siphon-dagster status`: each table's line read from a real Dagster instance's records, and
the tables that need attention (the command itself: tests/integration/test_status_command.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dagster as dg
import pytest

from siphon_core.config import parse_config
from siphon_dagster.checks.definitions import check_keys
from siphon_dagster.run_liveness import WORKER_TAG, worker_identity
from siphon_dagster.specs import table_specs
from siphon_dagster.status import read_statuses, render_json, render_lines, summary_line
from siphon_dagster.stream_groups import stream_groups
from siphon_dagster.table_state import STREAM_STOPPED
from tests.helpers.instance import instance_for_test

CONFIG = {
    "application_identifier": "shop",
    "source": {"dsn": "postgresql://siphon@127.0.0.1:1/app"},
    "queue": {"url": "nats://127.0.0.1:1"},
    "tables": [{"name": "public.notes"}, {"name": "public.events"}, {"name": 'public.odd "name"'},
               {"name": "audit.log", "targets": ["clickhouse"]}],
    "targets": {"clickhouse": {"url": "http://127.0.0.1:1"}, "snowflake": {"account": "a", "user": "u"}},
    "streaming": {"groups": {"hot": ["public.events"]}},
}


def specs_by_name(config):
    return {spec.qualified_name: spec for spec in table_specs(config)}


def add_run(instance: dg.DagsterInstance, tags: dict[str, str], worker: str | None,
            status: dg.DagsterRunStatus = dg.DagsterRunStatus.STARTED) -> str:
    run_id = str(uuid.uuid4())
    instance.add_run(dg.DagsterRun(job_name="stream", run_id=run_id, status=status,
                                   tags={**tags, **({WORKER_TAG: worker} if worker else {})}))
    return run_id


def batch(spec, target, lag: float, pending: int) -> dg.AssetMaterialization:
    return dg.AssetMaterialization(asset_key=spec.target_key(target), metadata={
        "applied_lsn": "0/16B3748", "lag_seconds": lag, "pending_messages": pending})


def state(spec, target, text: str) -> dg.AssetObservation:
    return dg.AssetObservation(asset_key=spec.target_key(target), description=text, metadata={"siphon/state": text})


def dead_worker() -> str:
    """The identity of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return worker_identity(process.pid)


@pytest.fixture
def recorded(tmp_path: Path):
    """An instance holding what runs and sensors record: a live group run serving ClickHouse's
    default group, a run whose worker died serving the `hot` group, and per table its batches,
    states, checks and a stop."""
    config = parse_config(CONFIG)
    specs = specs_by_name(config)
    groups = {group.job_name: group for group in stream_groups(config, list(specs.values()))}
    with instance_for_test(temp_dir=str(tmp_path)) as instance:
        live = add_run(instance, groups["stream_clickhouse"].tags, worker_identity())
        add_run(instance, groups["stream_clickhouse__hot"].tags, dead_worker())
        add_run(instance, groups["stream_snowflake"].tags, None, dg.DagsterRunStatus.STARTING)
        notes, events, odd, log = (specs[n] for n in ("public.notes", "public.events", 'public.odd "name"', "audit.log"))
        for event in [
            batch(notes, "clickhouse", 0.8, 0), state(notes, "clickhouse", "loaded"),
            batch(notes, "snowflake", 1.5, 3), state(notes, "snowflake", "snapshotting: 3 of 10 partitions loaded, 2 running"),
            batch(events, "clickhouse", 2.0, 0),
            # Read further back: a snapshot partition's materialization after the batch, and a stop
            # after it under more observations than the first read takes.
            batch(events, "snowflake", 4.0, 7),
            dg.AssetObservation(asset_key=events.target_key("snowflake"), description=f"{STREAM_STOPPED}: TargetError",
                                metadata={"error": dg.MetadataValue.md("merge refused")}),
            dg.AssetMaterialization(asset_key=events.target_key("snowflake"), partition="00000000-00008191",
                                    metadata={"dagster/row_count": 10}),
            *(state(events, "snowflake", f"snapshotting: {n} of 3 partitions loaded") for n in range(4)),
            # A stop after the latest batch: the table stays stopped.
            batch(odd, "clickhouse", 0.5, 0),
            dg.AssetObservation(asset_key=odd.target_key("clickhouse"), description=f"{STREAM_STOPPED}: TargetError",
                                metadata={"error": dg.MetadataValue.md("column x: cannot convert"), "run_id": live}),
            # A stop followed by a batch: streaming again.
            dg.AssetObservation(asset_key=log.target_key("clickhouse"), description=f"{STREAM_STOPPED}: TargetError",
                                metadata={"error": dg.MetadataValue.md("went away"), "run_id": live}),
            batch(log, "clickhouse", 900.0, 40),
            state(log, "clickhouse", "2 partitions failed after 3 attempts: 00000000-00008191, 00008192-00016383 "
                                     "(materialize them to try again; 0 of 2 loaded)"),
        ]:
            instance.report_runless_asset_event(event)
        keys = {key.name: key for key in check_keys(notes, "clickhouse")}
        row_count, parity = keys["row_count"], keys["row_parity"]
        instance.report_runless_asset_event(dg.AssetCheckEvaluation(
            asset_key=row_count.asset_key, check_name=row_count.name, passed=True))
        instance.report_runless_asset_event(dg.AssetCheckEvaluation(
            asset_key=parity.asset_key, check_name=parity.name, passed=False, severity=dg.AssetCheckSeverity.ERROR))
        yield config, instance


def by_asset(statuses):
    return {status.asset: status for status in statuses}


def test_each_table_at_each_target_gets_its_streaming_batch_state_and_checks(recorded):
    config, instance = recorded
    statuses = by_asset(read_statuses(instance, table_specs(config), max_lag_seconds=300.0))
    assert set(statuses) == {"clickhouse/public/notes", "snowflake/public/notes", "clickhouse/public/events",
                             "snowflake/public/events", 'clickhouse/public/odd "name"', 'snowflake/public/odd "name"',
                             "clickhouse/audit/log"}
    notes = statuses["clickhouse/public/notes"]
    assert notes.streaming.startswith("running in ")
    assert (notes.lag_seconds, notes.pending_messages, notes.state) == (0.8, 0, "loaded")
    assert notes.checks["row_count"] == "passed" and notes.checks["row_parity"] == "failed (error)"
    assert notes.problems == ["check(s) failed: row_parity failed (error)"]
    # A starting run serves the Snowflake tables: not a problem, nor is a snapshot under way.
    snow = statuses["snowflake/public/notes"]
    assert snow.streaming.startswith("starting in ") and snow.ok, snow.problems
    assert snow.state.startswith("snapshotting: 3 of 10")
    # The hot group's run has no live worker.
    events = statuses["clickhouse/public/events"]
    assert events.streaming.startswith("no live worker in ") and "is gone" in events.worker_gone
    assert [p.split(":")[0] for p in events.problems] == ["not streaming"]
    assert "has no live worker (its worker process" in events.problems[0]
    assert statuses["clickhouse/public/events"].state == "no state recorded yet"
    deep = statuses["snowflake/public/events"]
    assert (deep.lag_seconds, deep.pending_messages) == (4.0, 7)
    assert deep.state == "snapshotting: 3 of 3 partitions loaded" and deep.stopped == "merge refused"
    odd = statuses['clickhouse/public/odd "name"']
    assert odd.stopped == "column x: cannot convert"
    assert odd.problems == ["its stream stopped: column x: cannot convert"]
    log = statuses["clickhouse/audit/log"]
    assert log.stopped is None  # a batch came after the stop
    # Its latest batch is 900 s behind, but no run that serves it recorded that batch (a run's
    # own batches: test_a_run_is_judged_on_its_own_batches_and_stops).
    assert [p.split(":")[0] for p in log.problems] == ["snapshot"]


def test_a_table_no_run_serves_needs_attention(recorded):
    config, instance = recorded
    specs = specs_by_name(config)
    statuses = by_asset(read_statuses(instance, [specs["public.notes"]], ["snowflake"]))
    assert list(statuses) == ["snowflake/public/notes"]
    # No run of this application serves the table (the batches and checks are the asset's).
    lone = parse_config({**CONFIG, "application_identifier": "other"})
    status, = read_statuses(instance, [specs_by_name(lone)["public.notes"]], ["clickhouse"])
    assert status.streaming == "not running"
    assert status.problems[0] == "not streaming: no run serves it (the streaming sensor starts one while it is running)"


def test_lines_align_and_list_problems_and_json_holds_every_field(recorded):
    config, instance = recorded
    now = time.time()
    statuses = read_statuses(instance, table_specs(config), now=now)
    lines = render_lines(statuses, now)
    assert lines[0].split() == ["STATUS", "ASSET", "STREAMING", "LAST", "BATCH", "LAG", "PENDING", "STATE", "CHECKS"]
    rows = [line for line in lines[1:] if not line.startswith("    - ")]
    assert len(rows) == len(statuses)
    assert len({row.index(" running in ") if " running in " in row else None for row in rows} - {None}) == 1
    notes_row = next(row for row in rows if "clickhouse/public/notes" in row)
    assert notes_row.startswith("ATTN") and "row_parity failed (error), 2 never run, 1 passed" in notes_row
    assert "    - check(s) failed: row_parity failed (error)" in lines
    assert summary_line(statuses) == f"5 of {len(statuses)} table(s) at their targets need attention"
    assert render_lines([], now) == []  # `--problems` with none: only the closing count
    records = [json.loads(line) for line in render_json(statuses)]
    assert {r["asset"] for r in records} == {s.asset for s in statuses}
    assert all(set(r) >= {"ok", "problems", "streaming", "lag_seconds", "state", "checks"} for r in records)


def test_a_run_is_judged_on_its_own_batches_and_stops(tmp_path: Path):
    """A real run records a table's batch (far behind, a backlog pending) and another table's
    stop, and reads the status while it runs: both need attention. Once another run serves the
    tables, that batch and that stop are the past run's: a terminated run leaves its last
    batches' reports unwritten, so its latest recorded batch may describe a backlog it cleared."""
    config = parse_config({**CONFIG, "streaming": {}})
    specs = specs_by_name(config)
    group = next(g for g in stream_groups(config, list(specs.values())) if g.target == "clickhouse")
    notes, events = specs["public.notes"], specs["public.events"]
    later = time.time() + 3600  # an hour on, no batch since
    seen: dict[str, list[str]] = {}

    @dg.op
    def serve(context) -> None:  # unannotated: Dagster cannot read an annotation this module defers
        context.log_event(batch(notes, "clickhouse", 900.0, 40))
        context.log_event(dg.AssetObservation(asset_key=events.target_key("clickhouse"),
                                              description=f"{STREAM_STOPPED}: TargetError",
                                              metadata={"error": dg.MetadataValue.md("cannot convert"),
                                                        "run_id": context.run_id}))
        for status in read_statuses(context.instance, [notes, events], ["clickhouse"], now=later):
            seen[status.table] = [p.split(":")[0] for p in status.problems]

    @dg.job(tags={**group.tags, WORKER_TAG: worker_identity()})
    def stream_clickhouse() -> None:
        serve()

    with instance_for_test(temp_dir=str(tmp_path)) as instance:
        assert stream_clickhouse.execute_in_process(instance=instance).success
        assert seen == {"public.notes": ["behind", "stalled"], "public.events": ["its stream stopped"]}
        add_run(instance, group.tags, worker_identity())  # the run that serves them now
        statuses = {s.table: s for s in read_statuses(instance, [notes, events], ["clickhouse"], now=later)}
        assert statuses["public.notes"].lag_seconds == 900.0 and statuses["public.notes"].ok
        assert statuses["public.events"].stopped == "cannot convert" and statuses["public.events"].ok
