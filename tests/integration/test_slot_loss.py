"""A lost replication slot never hides a gap: the producer records it on the queue before a new
slot streams, or stops (`producer.on_slot_lost: stop`); the gap sensor rebuilds every table.

Real PostgreSQL, NATS and Dagster test instances; each test has its own application.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import psycopg
import pytest
import yaml
from psycopg import sql

from siphon_core import naming
from siphon_core.config import SiphonConfig, load_config, parse_config
from siphon_core.gaps import LOST, RESUMED, SlotGap
from siphon_core.queue import JetStreamQueue, StreamSettings
from siphon_dagster import runs, source
from siphon_dagster.checks.command import run_checks, selected_keys
from siphon_dagster.checks.definitions import checks_job_name
from siphon_dagster.definitions import build_definitions, build_resources
from siphon_dagster.gap_sensor import GAP_TAG, build_gap_sensor
from siphon_dagster.resync_requests import RESYNC_TAG, ResyncRequests, tables_resync_job_name
from siphon_dagster.specs import TableSpec, group_name, table_specs
from siphon_dagster.targets import build_target
from siphon_dagster.targets.base import TableSchema
from siphon_stack.postgres import PostgresServer, find_bindir
from siphon_stack.process import free_port
from tests.helpers.application import Application, rows_as_text
from tests.helpers.instance import instance_for_test
from tests.helpers.producer import current_lsn, execute, wait_until
from tests.integration.test_checks import Streaming
from tests.integration.test_targets_version_rule import target_settings

TABLES = ["a", "b"]


def gap_records(app: Application) -> list[tuple[int, SlotGap]]:
    async def read() -> list[tuple[int, bytes]]:
        queue = JetStreamQueue(app.nats_url, StreamSettings(app.identifier))
        await queue.connect()
        try:
            return await queue.messages_after(naming.gap_subject(app.identifier), 0)
        finally:
            await queue.close()

    return [(sequence, SlotGap.from_json(data, str(sequence))) for sequence, data in asyncio.run(read())]


def slot_exists(dsn: str, slot: str) -> bool:
    return bool(execute(dsn, "select 1 from pg_replication_slots where slot_name = %s", (slot,)))


def create_tables(app: Application, dsn: str | None = None) -> None:
    for table in TABLES:
        app.sql(f"create table {{schema}}.{table} (id integer primary key, v text)", dsn=dsn)


def insert(app: Application, row_id: int, dsn: str | None = None) -> None:
    for table in TABLES:
        app.sql(f"insert into {{schema}}.{table} values (%s, 'x')", (row_id,), dsn=dsn)


def ids(app: Application, table: str) -> list[int]:
    return sorted({int(e.new_row()["id"]) for e in app.events(table)})


def dagster_config(app: Application) -> SiphonConfig:
    return parse_config({
        "application_identifier": app.identifier,
        "source": {"dsn": app.dsn},
        "queue": {"url": app.nats_url},
        "tables": [{"name": app.qualified(t)} for t in TABLES],
        "targets": {"clickhouse": {"url": "http://127.0.0.1:1"}, "snowflake": {"account": "a", "user": "u"}},
    })


def placeholder_resyncs(config: SiphonConfig, specs: list[TableSpec] | None = None) -> ResyncRequests:
    """Requests of a job named like the real resync job; the sensor only requests it. `specs`:
    the tables it knows (default: all)."""
    job = _noop_job(tables_resync_job_name(group_name(config.application_identifier)))
    return ResyncRequests.of(job, table_specs(config) if specs is None else specs)


def _noop_job(name: str) -> dg.JobDefinition:
    @dg.op(name=f"{name}_op")
    def _noop() -> None:
        pass

    @dg.job(name=name)
    def _job() -> None:
        _noop()

    return _job


def tick(config: SiphonConfig, instance: dg.DagsterInstance, jobs: ResyncRequests | None,
         cursor: str | None = None):
    sensor = build_gap_sensor(table_specs(config), group_name(config.application_identifier), jobs)
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=build_resources(config))
    return sensor(context)


def test_a_slot_dropped_while_the_producer_was_down_is_recorded_and_every_table_rebuilt(app: Application) -> None:
    create_tables(app)
    producer = app.producer(TABLES)
    insert(app, 1)
    app.wait_for_events(2)
    assert producer.stop() == 0
    execute(app.dsn, "select pg_drop_replication_slot(%s)", (app.slot,))
    insert(app, 2)  # committed with no slot: lost
    lost_before = current_lsn(app.dsn)

    newest_streamed = max(e.commit_lsn for e in app.events())

    restarted = app.producer(TABLES)
    insert(app, 3)
    app.wait_for_events(4)

    (lost_sequence, lost), (resumed_sequence, resumed) = gap_records(app)
    assert (lost.stage, lost.reason, lost.slot, lost.last_confirmed_lsn) == (LOST, "missing", app.slot, None)
    assert (resumed.stage, resumed.reason, resumed.lost_sequence) == (RESUMED, "missing", lost_sequence)
    assert lost.last_streamed_lsn == resumed.last_streamed_lsn == naming.format_lsn(newest_streamed)
    consistent_point = naming.parse_lsn(resumed.consistent_point)
    assert consistent_point >= lost_before
    for table in TABLES:
        assert ids(app, table) == [1, 3]  # 2 is the gap
        after = [e for e in app.events(table) if e.new_row()["id"] == b"3"]
        assert after[0].commit_lsn >= consistent_point and after[0].stream_sequence > resumed_sequence
    assert restarted.metrics()['siphon_producer_slot_gaps_total{reason="missing"}'] == 1
    assert "gap recorded" in restarted.log()

    config = dagster_config(app)
    jobs = placeholder_resyncs(config)
    with instance_for_test() as instance:
        first = tick(config, instance, jobs)
        assert sorted(r.tags[RESYNC_TAG] for r in first.run_requests) == sorted(app.qualified(t) for t in TABLES)
        assert {r.job_name for r in first.run_requests} == {jobs.job_name}
        assert all(r.tags[GAP_TAG] == str(resumed_sequence) for r in first.run_requests)
        assert first.cursor == str(resumed_sequence)
        observed = {e.asset_key.to_user_string(): e.metadata for e in first.asset_events}
        assert set(observed) == {f"{target}/{app.schema}/{t}" for target in ("clickhouse", "snowflake")
                                 for t in TABLES}
        for metadata in observed.values():
            assert metadata["gap_lsn"].value == resumed.consistent_point
            assert metadata["reason"].value == "missing"
            assert metadata["gap_sequence"].value == resumed_sequence
            assert metadata["action"].value.startswith(f"resync requested: {jobs.job_name} for {app.schema}.")

        second = tick(config, instance, jobs, cursor=first.cursor)
        assert isinstance(second, dg.SkipReason) or not second.run_requests

        # A new cursor on an instance that recorded the gap: no second rebuild.
        for event in first.asset_events:
            instance.report_runless_asset_event(event)
        sensor = build_gap_sensor(table_specs(config), group_name(config.application_identifier), jobs)
        context = dg.build_sensor_context(instance=instance, resources=build_resources(config))
        assert isinstance(sensor(context), dg.SkipReason)
        # The sequence found by scanning the assets is kept: the next tick reads on from it.
        assert context.cursor == str(resumed_sequence)

    with instance_for_test() as fresh:
        # Until every table can be rebuilt the gap waits, and is not consumed.
        waiting = tick(config, fresh, placeholder_resyncs(config, table_specs(config)[:1]))
        assert isinstance(waiting, dg.SkipReason) and "no resync job" in waiting.skip_message
        assert tick(config, fresh, jobs).run_requests


def drop_active_slot(dsn: str, slot: str) -> None:
    """What an operator does to a slot in use: end its walsender, then drop it before the producer is back."""
    def dropped() -> bool:
        execute(dsn, "select pg_terminate_backend(active_pid) from pg_replication_slots "
                     "where slot_name = %s and active_pid is not null", (slot,))
        return bool(execute(dsn, "select pg_drop_replication_slot(slot_name) from pg_replication_slots "
                                 "where slot_name = %s and active_pid is null", (slot,)))

    wait_until(dropped, 30, "the slot dropped", interval=0.01)


def test_a_slot_dropped_while_the_producer_runs_is_recorded_when_it_reconnects(app: Application) -> None:
    create_tables(app)
    producer = app.producer(TABLES)
    insert(app, 1)
    app.wait_for_events(2)

    drop_active_slot(app.dsn, app.slot)
    insert(app, 2)  # possibly before the new slot: no assertion on it
    wait_until(lambda: len(gap_records(app)) == 2, 30, "the gap recorded")
    insert(app, 3)

    wait_until(lambda: all(3 in ids(app, table) for table in TABLES), 30, "row 3 streamed")
    assert all(1 in ids(app, table) for table in TABLES)
    (_, lost), (resumed_sequence, resumed) = gap_records(app)
    assert (lost.stage, lost.reason, resumed.stage) == (LOST, "missing", RESUMED)
    assert "connection lost; reconnecting" in producer.log()
    assert producer.process is not None and producer.process.poll() is None
    assert all(e.stream_sequence > resumed_sequence for e in app.events() if e.new_row()["id"] == b"3")


def test_on_slot_lost_stop_exits_3_changes_nothing_and_the_acknowledgement_goes_on(app: Application) -> None:
    create_tables(app)
    producer = app.producer(TABLES, on_slot_lost="stop")  # a first start: no gap, stop does not apply
    insert(app, 1)
    app.wait_for_events(2)
    assert producer.stop() == 0
    execute(app.dsn, "select pg_drop_replication_slot(%s)", (app.slot,))

    refused = app.producer(TABLES, on_slot_lost="stop", start=False).start(wait_streaming=False)
    assert refused.wait(60) == 3
    message = refused.log()
    assert f"replication slot '{app.slot}'" in message and "does not exist" in message
    assert "--accept-slot-loss" in message and naming.resync_job_name(app.schema, "a") in message
    newest = naming.format_lsn(max(e.commit_lsn for e in app.events()))
    assert f"changes committed since {newest} (the newest commit in the queue)" in message
    assert naming.gap_sensor_name(app.identifier) in message
    assert not slot_exists(app.dsn, app.slot) and gap_records(app) == []

    accepted = app.producer(TABLES, on_slot_lost="stop", start=False).start(extra_args=("--accept-slot-loss",))
    insert(app, 2)
    app.wait_for_events(4)
    assert [gap.stage for _, gap in gap_records(app)] == [LOST, RESUMED]
    assert slot_exists(app.dsn, app.slot)
    assert accepted.stop() == 0


def test_a_first_start_records_no_gap(app: Application) -> None:
    create_tables(app)
    producer = app.producer(TABLES, on_slot_lost="stop")
    insert(app, 1)
    app.wait_for_events(2)
    assert gap_records(app) == []
    assert 'siphon_producer_slot_gaps_total{reason="missing"}' not in producer.metrics()
    assert producer.stop() == 0


def test_a_lost_record_without_its_resumed_record_is_finished_by_the_next_start(app: Application) -> None:
    """A producer that died after recording the loss and creating the new slot: the next start finds a
    healthy slot, and still records the consistent point before streaming from it."""
    create_tables(app)
    producer = app.producer(TABLES)
    insert(app, 1)
    app.wait_for_events(2)
    assert producer.stop() == 0
    execute(app.dsn, "select pg_drop_replication_slot(%s)", (app.slot,))
    lost = SlotGap(app.identifier, app.slot, LOST, "missing", "2026-01-01T00:00:00.000+00:00")

    async def record_lost() -> int:
        queue = JetStreamQueue(app.nats_url, StreamSettings(app.identifier))
        await queue.connect()
        try:
            return await queue.publish(naming.gap_subject(app.identifier), lost.to_json(), lost.message_id())
        finally:
            await queue.close()

    lost_sequence = asyncio.run(record_lost())
    made = execute(app.dsn, "select lsn::text from pg_create_logical_replication_slot(%s, 'pgoutput')",
                   (app.slot,))[0][0]

    app.producer(TABLES)
    insert(app, 2)
    app.wait_for_events(4)

    (_, first), (_, resumed) = gap_records(app)
    assert first == lost
    assert (resumed.stage, resumed.consistent_point, resumed.lost_sequence) == (RESUMED, made, lost_sequence)


@pytest.fixture
def small_wal_server(shared_tmp_dir: Path) -> Iterator[PostgresServer]:
    """A server of this test's own whose slots lose their WAL past 1 MB (the shared one is left alone)."""
    server = PostgresServer(shared_tmp_dir / f"small-wal-{free_port()}", free_port(), find_bindir())
    server.initialize()
    pid = server.start()
    try:
        execute(server.dsn, "alter system set max_slot_wal_keep_size = '1MB'")
        execute(server.dsn, "select pg_reload_conf()")
        yield server
    finally:
        server.stop(pid)


def test_a_slot_invalidated_by_the_server_is_recorded_and_replaced(app: Application,
                                                                   small_wal_server: PostgresServer) -> None:
    dsn = small_wal_server.dsn
    execute(dsn, f'create schema "{app.schema}"')
    create_tables(app, dsn)
    producer = app.producer(TABLES, dsn=dsn)
    insert(app, 1, dsn)
    app.wait_for_events(2)
    assert producer.stop() == 0
    confirmed = execute(dsn, "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s",
                        (app.slot,))[0][0]
    for _ in range(4):  # WAL past the slot's limit, then a checkpoint that removes it
        insert(app, 1000 + _, dsn)
        execute(dsn, "select pg_switch_wal()")
    execute(dsn, "checkpoint")
    wait_until(lambda: execute(dsn, "select wal_status from pg_replication_slots where slot_name = %s",
                               (app.slot,))[0][0] == "lost", 30, "the slot invalidated")

    restarted = app.producer(TABLES, dsn=dsn)
    insert(app, 2, dsn)
    app.wait_for_events(4)

    (_, lost), (_, resumed) = gap_records(app)
    assert (lost.reason, lost.detail, lost.last_confirmed_lsn) == ("invalidated", "wal_status=lost", confirmed)
    assert resumed.reason == "invalidated" and resumed.consistent_point and resumed.last_streamed_lsn
    assert execute(dsn, "select wal_status from pg_replication_slots where slot_name = %s",
                   (app.slot,))[0][0] != "lost"
    assert json.loads(lost.to_json())["stage"] == LOST
    assert restarted.metrics()['siphon_producer_slot_gaps_total{reason="invalidated"}'] == 1
    assert restarted.stop() == 0
    # The application's slot lives on this server; drop it before the server goes.
    execute(dsn, "select pg_drop_replication_slot(%s)", (app.slot,))


# --- end to end: a lost slot under a live writer, rebuilt by the gap sensor's resyncs ---------------
E2E_TABLES = ["orders", "lines"]
E2E_TARGETS = ("clickhouse", "snowflake")


class Writer:
    """Inserts, updates and deletes in both tables, one small transaction after another, until stopped."""

    def __init__(self, app: Application) -> None:
        self.app = app
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.transactions = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rnd = random.Random(7)
        try:
            with psycopg.connect(self.app.dsn, autocommit=True) as connection:
                while not self.stop.is_set():
                    table = self.app.table(rnd.choice(E2E_TABLES))
                    choice = rnd.random()
                    if choice < 0.4:
                        connection.execute(sql.SQL("insert into {} (v, n) values (%s, %s)").format(table),
                                           (f"live {self.transactions}", self.transactions))
                    elif choice < 0.8:
                        connection.execute(sql.SQL("update {} set n = n + 1, v = v || '.' where id = %s")
                                           .format(table), (rnd.randint(100, 400),))
                    else:
                        connection.execute(sql.SQL("delete from {} where id = %s").format(table),
                                           (rnd.randint(100, 400),))
                    self.transactions += 1
                    time.sleep(0.02)
        except BaseException as error:  # surfaced by the test
            self.errors.append(error)

    def halt(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.errors, self.errors


@pytest.fixture
def e2e_config(request: pytest.FixtureRequest, app: Application, tmp_path: Path) -> Iterator[tuple[SiphonConfig, Path]]:
    """Both tables seeded, a siphon.yaml with both targets (a database and a schema of this test's own)."""
    for table in E2E_TABLES:
        app.sql(f"create table {{schema}}.{table} (id bigserial primary key, v text not null, n integer)")
        app.sql(f"insert into {{schema}}.{table} (v, n) select 'seed ' || g, g from generate_series(1, 400) g")
    path = tmp_path / "siphon.yaml"
    path.write_text(yaml.safe_dump({
        "application_identifier": app.identifier,
        "source": {"dsn": app.dsn},
        "queue": {"url": app.nats_url},
        "tables": [{"name": app.qualified(t), "blocks_per_partition": 2} for t in E2E_TABLES],
        "targets": {name: target_settings(request, name, app.identifier) for name in E2E_TARGETS},
        # Batches are decoded in the run's process (no Spark JVM to start): the test is about the gap.
        "streaming": {"batch_max_wait_seconds": 0.3, "driver_decode_max_bytes": 100_000_000,
                      "shadow_lookup_seconds": 1},
        "checks": {"settle_timeout_seconds": 90, "settle_interval_seconds": 1},
    }))
    config = load_config(path)
    try:
        yield config, path
    finally:
        for name in E2E_TARGETS:
            destination = build_target(name, config)
            try:
                for spec in table_specs(config):
                    destination.drop_table(TableSchema(spec.schema, spec.name, ()))
            finally:
                destination.close()


def e2e_differences(config: SiphonConfig) -> list[str]:
    problems = []
    for spec in table_specs(config):
        with source.connect(config.source.dsn) as connection:
            table = source.table_schema(connection, spec.table)
        keys = [i for i, c in enumerate(table.columns) if c.primary_key]
        expected = {tuple(row[i] for i in keys): row for row in rows_as_text(config.source.dsn, table)}
        for name in E2E_TARGETS:
            destination = build_target(name, config)
            try:
                actual = {tuple(row[i] for i in keys): row for row in destination.current_rows_as_text(table)}
            finally:
                destination.close()
            if actual != expected:
                missing, extra = expected.keys() - actual.keys(), actual.keys() - expected.keys()
                differing = sorted(k for k in expected.keys() & actual.keys() if expected[k] != actual[k])
                problems.append(f"{spec.qualified_name} at {name}: missing {sorted(missing)[:5]}, extra "
                                f"{sorted(extra)[:5]}, differing {differing[:5]}")
    return problems


def test_a_lost_slot_under_a_live_writer_is_rebuilt_by_the_gap_sensors_resyncs_until_every_check_passes(
        app: Application, e2e_config: tuple[SiphonConfig, Path]) -> None:
    config, config_path = e2e_config
    specs = table_specs(config)
    defs = build_definitions(config)
    producer = app.producer(E2E_TABLES)
    writer = Writer(app)
    streaming = Streaming(config_path)
    with instance_for_test() as instance:
        # Loaded and streaming under a live writer (the snapshots and the stream meet by the apply rule).
        writer.thread.start()
        streaming.start()
        try:
            runs.refresh_partitions(instance, config, specs)
            for spec in specs:
                spans = runs.partition_spans(instance, spec, "all")
                for target in E2E_TARGETS:
                    assert all(o.success for o in runs.snapshot(config, spec, target, spans, instance))
            wait_until(lambda: writer.transactions > 50, 30, "the writer busy")

            # The slot is lost while the producer is down, and changes are committed meanwhile: no
            # slot ever decodes them.
            assert producer.stop() == 0
            execute(app.dsn, "select pg_drop_replication_slot(%s)", (app.slot,))
            for table in E2E_TABLES:
                app.sql(f"insert into {{schema}}.{table} (id, v, n) values (100001, 'lost insert', 1)")
                app.sql(f"update {{schema}}.{table} set v = 'lost update' where id in (10, 11)")
                app.sql(f"delete from {{schema}}.{table} where id in (20, 21)")
            time.sleep(1)  # the writer's changes are lost too
            app.producer(E2E_TABLES)
            for table in E2E_TABLES:
                app.sql(f"insert into {{schema}}.{table} (id, v, n) values (100002, 'after the gap', 2)")

            # The stream goes on after the gap, and the gap is real: the lost delete never arrives.
            clickhouse = build_target("clickhouse", config)
            try:
                tables = {spec.name: app.table_schema(spec.name) for spec in specs}

                def ids(table: TableSchema) -> set[str | None]:
                    return {row[0] for row in clickhouse.current_rows_as_text(table)}

                wait_until(lambda: all("100002" in ids(t) for t in tables.values()), 120,
                           "the change after the gap applied")
                for table in tables.values():
                    assert "20" in ids(table) and "100001" not in ids(table)
            finally:
                clickhouse.close()

            # The gap sensor, as the daemon runs it: it requests a resync of every table.
            sensor = next(s for s in defs.sensors if s.name == naming.gap_sensor_name(app.identifier))
            context = dg.build_sensor_context(instance=instance, resources=build_resources(config), definitions=defs)
            result = sensor(context)
            assert isinstance(result, dg.SensorResult), result
            assert sorted(r.tags[RESYNC_TAG] for r in result.run_requests) == sorted(s.qualified_name for s in specs)
            for event in result.asset_events:
                instance.report_runless_asset_event(event)

            # Each requested run executes (it ends by running the table's checks, under the writer).
            for request in result.run_requests:
                job = defs.resolve_job_def(request.job_name)
                run = job.execute_in_process(run_config=request.run_config, instance=instance, tags=request.tags,
                                             raise_on_error=False)
                failures = [e.step_failure_data.error.message for e in run.all_events if e.is_step_failure]
                print("\n".join(failures))  # shown in full when the test fails
                assert run.success, failures
                assert run.dagster_run.tags[GAP_TAG] == request.tags[GAP_TAG]
            # The resyncs' checks ran as runs of the checks job, one per table, and no ERROR check failed.
            checks_runs = instance.get_runs(dg.RunsFilter(job_name=checks_job_name(group_name(app.identifier))))
            assert len(checks_runs) == len(specs)
            assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in checks_runs)

            writer.halt()
            wait_until(lambda: not e2e_differences(config), 60, "every table equal to its source")
        finally:
            writer.stop.set()
            streaming.halt()
        assert not e2e_differences(config), e2e_differences(config)
        # Afterwards every check passes at every target, as `siphon-dagster check` runs them.
        results = run_checks(defs, group_name(config.application_identifier), selected_keys(config, None, None),
                             instance)
        assert len(results) == len(specs) * len(E2E_TARGETS) * 4
        failed = [f"{e.asset_key.to_user_string()} {e.check_name}: {e.description}" for e in results if not e.passed]
        assert not failed, failed
