"""The asset checks on the real stack, under a live workload with the producer streaming, at ClickHouse
and at Snowflake (fakesnow): they pass on converged tables, and they find rows deleted, inserted and
changed by hand at a target and a column added at the source, naming the keys."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import random
import sys
import threading
import time
import uuid

import dagster as dg
import psycopg
import pytest
import yaml
from dagster._core.storage.tags import PARTITION_NAME_TAG
from psycopg import sql

from siphon_core.config import load_config
from siphon_dagster import source
from siphon_dagster.checks.command import main as check_command
from siphon_dagster.checks.command import run_checks, selected_keys
from siphon_dagster.checks.digest import DIFFERS, EXTRA, MISSING
from siphon_dagster.checks.row_parity import compared_columns, find_divergent_rows
from siphon_dagster.definitions import build_definitions, build_resources
from siphon_dagster.parity_repair import stream_watch
from siphon_dagster.partitions import ranges_for
from siphon_dagster.specs import group_name, table_specs
from siphon_dagster.table_state import latest_check_results
from siphon_dagster.targets import build_target
from siphon_dagster.targets.base import TableSchema
from siphon_stack.process import free_port, start_process, stop_pid
from tests.helpers.instance import instance_for_test
from tests.helpers.producer import producer_streaming, wait_until

SCHEMA_DDL = """
create table {schema}.items (
    id bigserial primary key, title text not null, qty integer, price numeric(12, 2), ratio double precision,
    tags text[], meta jsonb, blob bytea, ref uuid, at timestamptz default now(),
    flag boolean default true, addr inet default '10.1.2.3', code char(4) default 'ab'
);
create table {schema}.pairs (left_id integer, right_id text, weight real, primary key (left_id, right_id));
"""
HAND_EDITED = range(1, 11)  # ids of items the workload never touches


class Workload:
    """Inserts, updates and deletes of items above HAND_EDITED, from a thread, until stopped."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rnd = random.Random(3)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                c.execute(sql.SQL("set search_path to {}").format(sql.Identifier(self.schema)))
                step = 0
                while not self.stop.is_set():
                    step += 1
                    choice = rnd.random()
                    if choice < 0.5:
                        c.execute("insert into items (title, qty, price, ratio, tags, meta, blob, ref) values "
                                  "(%s, %s, %s, %s, %s, %s, %s, gen_random_uuid())",
                                  (f"live {step}", step, step / 7, step / 3, ["a", None], psycopg.types.json.Jsonb(
                                      {"s": step}), bytes([step % 256, 0, 255])))
                    elif choice < 0.8:
                        c.execute("update items set qty = qty + 1, title = title || '.' where id in "
                                  "(select id from items where id > 100 order by random() limit 3)")
                    else:
                        c.execute("delete from items where id = (select max(id) from items where id > 100)")
                    time.sleep(0.02)
        except BaseException as error:  # surfaced by the test
            self.errors.append(error)


def drain_once(defs, specs, instance, max_batches: int | None = None) -> None:
    for spec in specs:
        for target in spec.targets:
            job = defs.resolve_job_def(spec.stream_job_name(target))
            op = f"apply_{target}_{spec.job_suffix}"
            config = {"stop_when_drained": True, "max_batches": max_batches}
            run = job.execute_in_process(run_config={"ops": {op: {"config": config}}}, instance=instance,
                                         raise_on_error=False)
            failures = [e.step_failure_data.error.message for e in run.all_events if e.is_step_failure]
            assert run.success, f"{job.name} failed: {failures}"


def _stream_until(config_path: str, stop: multiprocessing.synchronize.Event,
                  errors: multiprocessing.queues.SimpleQueue) -> None:
    try:
        config = load_config(config_path)
        defs, specs = build_definitions(config), table_specs(config)
        with dg.DagsterInstance.ephemeral() as instance:
            while not stop.is_set():
                # A few batches at a time, so that a table the workload keeps busy never keeps the others waiting.
                drain_once(defs, specs, instance, max_batches=2)
    except BaseException as error:
        errors.put(f"{type(error).__name__}: {error}")
        raise


class Streaming:
    """Applies every table's stream to every target, again and again, in a process of its own (as
    the streaming sensor's runs do), until stopped."""

    def __init__(self, config_path) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.errors = context.SimpleQueue()  # why the process stopped, for the assertion's message
        self.process = context.Process(target=_stream_until, args=(str(config_path), self.stop, self.errors),
                                       daemon=True)

    def start(self) -> None:
        self.process.start()

    def halt(self) -> None:
        self.stop.set()
        self.process.join(timeout=120)
        if self.process.is_alive():
            self.process.kill()
        why = self.errors.get() if not self.errors.empty() else ""
        assert self.process.exitcode == 0, f"the streaming process exited with {self.process.exitcode}: {why}"


def a_commit_waits_for_the_standby(dsn: str, admin: psycopg.Connection, scratch: sql.Composable) -> bool:
    """Whether a commit now waits for the (absent) synchronous standby. A session's own setting is
    not enough: commits wait only once the checkpointer has read the reloaded configuration too,
    and under load it can lag behind the sessions. The probe writes a row of `scratch` (a table
    outside the publication) and its commit is let go by cancelling its wait, as the test lets its
    real commit go later."""
    with psycopg.connect(dsn, autocommit=True) as probe:
        pid = probe.info.backend_pid

        def commit() -> None:
            # Cancelled while waiting on anything but the standby, the insert is rolled back.
            with contextlib.suppress(psycopg.errors.QueryCanceled):
                probe.execute(sql.SQL("insert into {} values (1)").format(scratch))

        committing = threading.Thread(target=commit, daemon=True)
        committing.start()
        committing.join(1.0)
        if not committing.is_alive():
            return False  # committed without waiting
        waiting = admin.execute("select wait_event from pg_stat_activity where pid = %s", (pid,)).fetchone()[0]
        admin.execute("select pg_cancel_backend(%s)", (pid,))
        committing.join(10)
        return waiting == "SyncRep"


@pytest.fixture
def stack(tmp_path, postgres_dsn, nats_url, clickhouse_url, snowflake_env, unique_name):
    """Tables snapshotted into both targets and streamed, a producer running, and a Dagster instance."""
    with psycopg.connect(postgres_dsn, autocommit=True) as c:
        c.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        c.execute(SCHEMA_DDL.format(schema=unique_name))
        c.execute(sql.SQL("set search_path to {}").format(sql.Identifier(unique_name)))
        c.execute("insert into items (title, qty, price, ratio, tags, meta, blob, ref) select 'seed ' || g, g, g / 3.0, "
                  "g / 7.0, array['x', null], jsonb_build_object('g', g), decode(md5(g::text), 'hex'), "
                  "gen_random_uuid() from generate_series(1, 1500) g")
        c.execute("insert into pairs select g % 40, 'r' || (g / 40), g / 3.0 from generate_series(1, 400) g")
    config_path = tmp_path / "siphon.yaml"
    config_path.write_text(yaml.safe_dump({
        "application_identifier": unique_name,
        "source": {"dsn": postgres_dsn},
        "queue": {"url": nats_url},
        "producer": {"flush_interval_seconds": 0.3, "metrics_port": free_port(), "status_interval_seconds": 0.5,
                     "heartbeat_interval_seconds": 1},
        "tables": [{"name": f"{unique_name}.items", "blocks_per_partition": 16},
                   {"name": f"{unique_name}.pairs", "blocks_per_partition": 4}],
        "targets": {
            "clickhouse": {"url": clickhouse_url, "database": unique_name},
            "snowflake": {"account": snowflake_env["SIPHON_SNOWFLAKE_ACCOUNT"],
                          "user": snowflake_env["SIPHON_SNOWFLAKE_USER"],
                          "password": snowflake_env["SIPHON_SNOWFLAKE_PASSWORD"],
                          "database": unique_name.upper(), "schema": "PUBLIC",
                          "host": "127.0.0.1", "port": int(snowflake_env["SIPHON_SNOWFLAKE_PORT"]),
                          "protocol": "http"},
        },
        "streaming": {"batch_max_wait_seconds": 0.3},
        "checks": {"settle_timeout_seconds": 90, "settle_interval_seconds": 1, "freshness_warn_seconds": 120},
    }))
    config = load_config(config_path)
    producer = start_process("siphon-producer", [sys.executable, "-m", "producer_service.cli", "run", "--config",
                                                 str(config_path)], tmp_path / "producer.log")
    try:
        wait_until(lambda: producer_streaming(config.producer.metrics_port), 60, "producer streaming")
        defs = build_definitions(config)
        specs = table_specs(config)
        with instance_for_test() as instance:
            with source.connect(config.source.dsn) as connection:
                for spec in specs:
                    size = source.table_size(connection, spec.table)
                    keys = [r.key for r in ranges_for(size.blocks, spec.table.blocks_per_partition)]
                    instance.add_dynamic_partitions(spec.partitions_def_name, keys)
                    for target in spec.targets:
                        asset = defs.resolve_assets_def(spec.target_key(target))
                        for key in keys:
                            assert dg.materialize([asset], partition_key=key, instance=instance).success
            yield config, defs, specs, instance, config_path
    finally:
        stop_pid(producer.pid, timeout=30)
        for resource in ("clickhouse_target", "snowflake_target"):
            destination = build_resources(config)[resource].open_target()
            try:
                for spec in table_specs(config):
                    destination.drop_table(TableSchema(spec.schema, spec.name, ()))
            finally:
                destination.close()


def outcomes(config, instance, table=None, target=None) -> dict[tuple[str, str], dg.AssetCheckEvaluation]:
    evaluations = run_checks(build_definitions(config), group_name(config.application_identifier),
                             selected_keys(config, table, target), instance)
    return {(e.asset_key.to_user_string(), e.check_name): e for e in evaluations}


def describe(results) -> str:
    return "\n".join(f"{k}: {'PASS' if e.passed else 'FAIL'} {e.description}" for k, e in sorted(results.items()))


def test_every_check_passes_on_converged_tables_under_a_live_workload(stack):
    config, defs, specs, instance, config_path = stack
    schema = config.tables[0].schema_name
    workload = Workload(config.source.dsn, schema)
    streaming = Streaming(config_path)
    drain_once(defs, specs, instance)
    workload.thread.start()
    streaming.start()
    try:
        time.sleep(3)  # the workload is running and the stream follows it
        results = outcomes(config, instance)
        assert len(results) == 2 * 2 * 4
        assert all(e.passed for e in results.values()), describe(results)
        parity = results[(f"clickhouse/{schema}/items", "row_parity")]
        assert parity.metadata["source_rows"].value > 1000
        assert parity.metadata["divergent_keys"].value == 0
        # Recorded on the asset, as the UI shows it.
        record = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            [dg.AssetCheckKey(specs[0].target_key("snowflake"), "row_count")])
        assert record and next(iter(record.values())).status.value == "SUCCEEDED"
    finally:
        workload.stop.set()
        workload.thread.join(timeout=30)
        streaming.halt()
    assert not workload.errors, workload.errors


def test_row_parity_reads_again_a_key_whose_commit_was_in_the_wal_before_the_source_could_see_it(stack):
    """PostgreSQL flushes a commit's WAL record before the commit shows in snapshots. With a
    synchronous standby that never answers, a commit waits in between for as long as the test
    likes, while the stream applies it: the target holds a row the source's read cannot see yet.
    One read calls that key extra; the second read, once the commit shows, finds it equal."""
    config, defs, specs, instance, config_path = stack
    pairs = next(spec for spec in specs if spec.name == "pairs")
    dsn = config.source.dsn
    key = ("777", "waits for a standby")
    streaming = Streaming(config_path)
    drain_once(defs, specs, instance)
    streaming.start()
    destination = build_target("clickhouse", config)
    errors: list[BaseException] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as admin, psycopg.connect(dsn, autocommit=True) as writer:
            table = compared_columns(source.table_schema(admin, pairs.table), destination)
            scratch = sql.Identifier(pairs.schema, "synchronous_commit_probe")
            admin.execute(sql.SQL("create table {} (x int)").format(scratch))
            admin.execute("alter system set synchronous_standby_names = 'siphon_absent_standby'")
            admin.execute("select pg_reload_conf()")
            try:
                wait_until(lambda: writer.execute("show synchronous_standby_names").fetchone()[0] != "", 10,
                           "the writer's session taking the new setting")
                wait_until(lambda: a_commit_waits_for_the_standby(dsn, admin, scratch), 30,
                           "commits waiting for the standby")

                def insert() -> None:
                    try:
                        writer.execute(sql.SQL("insert into {} values (777, 'waits for a standby', 1)").format(
                            sql.Identifier(pairs.schema, pairs.name)))
                    except BaseException as error:  # noqa: BLE001 - reported by the test
                        errors.append(error)

                inserting = threading.Thread(target=insert, daemon=True)
                inserting.start()
                pid = writer.info.backend_pid
                wait_until(lambda: errors or admin.execute("select wait_event from pg_stat_activity where pid = %s",
                                                           (pid,)).fetchone()[0] == "SyncRep", 20, "the commit waiting")
                assert not errors, errors
                wait_until(lambda: key in destination.key_rows(table, [key]), 60, "the stream applying the commit")
                hidden = admin.execute(sql.SQL("select count(*) from {} where left_id = 777").format(
                    sql.Identifier(pairs.schema, pairs.name))).fetchone()[0]
                assert hidden == 0, "the source shows the commit already: the test has nothing to show"

                def release(_message: str) -> None:
                    # Called inside the first read, after its digests: that read keeps missing the commit.
                    admin.execute("alter system reset synchronous_standby_names")
                    admin.execute("select pg_reload_conf()")
                    admin.execute("select pg_cancel_backend(%s)", (pid,))
                    inserting.join(timeout=20)

                report = find_divergent_rows(pairs, destination, dsn, stream_watch(config, pairs, "clickhouse"),
                                             config.checks, release)
            finally:
                admin.execute("alter system reset synchronous_standby_names")
                admin.execute("select pg_reload_conf()")
    finally:
        destination.close()
        streaming.halt()
    assert not errors, errors
    assert report.mismatched_buckets == 1, "the first read did not see the target's extra row"
    assert (report.divergent, report.in_flight, report.rounds) == ([], [], 1)


def hand_edit_clickhouse(config, schema: str) -> None:
    from siphon_dagster.targets.clickhouse import ClickHouseTarget

    target = ClickHouseTarget(config.targets.clickhouse)
    client = target._connect()
    table = f"`{schema}`.`{schema}__items`"
    client.command(f"ALTER TABLE {table} DELETE WHERE id = 3 SETTINGS mutations_sync = 1")
    client.command(f"ALTER TABLE {table} UPDATE title = 'changed by hand' WHERE id = 5 SETTINGS mutations_sync = 1")
    client.command(f"INSERT INTO {table} (id, title, _siphon_version, _siphon_deleted, _siphon_synced_at) "
                   "VALUES (900001, 'inserted by hand', 1, 0, now64()), (900002, 'inserted by hand', 1, 0, now64())")
    client.command(f"INSERT INTO `{schema}`.`{schema}__pairs` (left_id, right_id, _siphon_version, _siphon_deleted, "
                   "_siphon_synced_at) VALUES (999, 'by hand', 1, 0, now64())")
    target.close()


def hand_edit_snowflake(config, schema: str) -> None:
    from siphon_dagster.targets.snowflake import SnowflakeTarget

    target = SnowflakeTarget(config.targets.snowflake)
    cursor = target._connect().cursor()
    table = f'"{target.database}"."{target.schema}"."{schema}__items"'
    cursor.execute(f"DELETE FROM {table} WHERE id = 3")
    cursor.execute(f"UPDATE {table} SET title = 'changed by hand' WHERE id = 5")
    for key in (900001, 900002):
        cursor.execute(f"INSERT INTO {table} (id, title, _siphon_version, _siphon_deleted, _siphon_synced_at) "
                       f"VALUES ({key}, 'inserted by hand', 1, FALSE, SYSDATE())")
    cursor.execute(f'INSERT INTO "{target.database}"."{target.schema}"."{schema}__pairs" (left_id, right_id, '
                   "_siphon_version, _siphon_deleted, _siphon_synced_at) VALUES (999, 'by hand', 1, FALSE, SYSDATE())")
    target.close()


def test_checks_find_rows_changed_by_hand_and_a_column_added_at_the_source(stack, capsys, monkeypatch):
    config, defs, specs, instance, config_path = stack
    schema = config.tables[0].schema_name
    workload = Workload(config.source.dsn, schema)
    streaming = Streaming(config_path)
    drain_once(defs, specs, instance)
    hand_edit_clickhouse(config, schema)
    hand_edit_snowflake(config, schema)
    # pairs sees no change, so no change event carries the new column to the targets.
    with psycopg.connect(config.source.dsn, autocommit=True) as c:
        c.execute(sql.SQL("alter table {} add column note text").format(sql.Identifier(schema, "pairs")))
    workload.thread.start()
    streaming.start()
    try:
        time.sleep(2)
        results = outcomes(config, instance)
    finally:
        workload.stop.set()
        workload.thread.join(timeout=30)
        streaming.halt()
    assert not workload.errors, workload.errors
    for target in ("clickhouse", "snowflake"):
        items, pairs = f"{target}/{schema}/items", f"{target}/{schema}/pairs"
        parity = results[(items, "row_parity")]
        assert not parity.passed, describe(results)
        found = {tuple(d["key"]): (d["kind"], d["partition"]) for d in parity.metadata["divergent"].value}
        assert found == {("3",): (MISSING, "00000000-00000015"), ("5",): (DIFFERS, "00000000-00000015"),
                         ("900001",): (EXTRA, None), ("900002",): (EXTRA, None)}, describe(results)
        assert parity.metadata["partitions"].value == ["00000000-00000015"]
        # Under the workload the count band of items is wide (every row updated since the read moves
        # from C1 to C2); on pairs, which nothing else changes, the row inserted by hand is drift.
        count = results[(pairs, "row_count")]
        assert not count.passed and "drift" in count.description, describe(results)
        assert count.metadata["source_rows"].value == 400
        assert count.metadata["target_rows_at_or_before_read"].value == 401
        pairs_parity = results[(pairs, "row_parity")]
        assert [(d["key"], d["kind"]) for d in pairs_parity.metadata["divergent"].value] == [(["999", "by hand"], EXTRA)]
        schema_check = results[(pairs, "schema_parity")]
        assert not schema_check.passed and "missing at target: note" in schema_check.description
        assert results[(items, "schema_parity")].passed, describe(results)
    # The command line: one line per check, exit 1 on a failed ERROR check, 2 on bad input.
    monkeypatch.setattr(dg.DagsterInstance, "get", staticmethod(lambda: instance))
    assert check_command(config, build_definitions(config), f"{schema}.pairs", "clickhouse") == 1
    lines = capsys.readouterr().out.splitlines()
    assert f"FAIL  clickhouse/{schema}/pairs  schema_parity  missing at target: note" in lines
    assert any(line.startswith(f"FAIL  clickhouse/{schema}/pairs  row_count  drift") for line in lines), lines
    assert len(lines) == 4
    # While a partition of pairs is being written at ClickHouse, its row checks say so instead of
    # reporting the load as drift; schema parity still runs. After that run ends, they compare again.
    pairs_key = specs[1].target_key("clickhouse")
    loading_run = instance.add_run(dg.DagsterRun(
        job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED,
        asset_selection=frozenset({pairs_key}), tags={PARTITION_NAME_TAG: "00000000-00000003"}))
    assert check_command(config, build_definitions(config), f"{schema}.pairs", "clickhouse") == 1
    lines = capsys.readouterr().out.splitlines()
    assert f"FAIL  clickhouse/{schema}/pairs  schema_parity  missing at target: note" in lines
    for name in ("row_count", "row_parity"):
        assert any(line.startswith(f"SKIP  clickhouse/{schema}/pairs  {name}  not compared: the table is being "
                                   f"loaded by 1 snapshot run(s), {loading_run.run_id[:8]} (partition "
                                   "00000000-00000003)") for line in lines), lines
    key = dg.AssetCheckKey(pairs_key, "row_count")
    assert latest_check_results(instance, [key]) == {key: "not compared (loading)"}
    instance.report_run_failed(loading_run)
    results = outcomes(config, instance, f"{schema}.pairs", "clickhouse")
    assert "drift" in results[(f"clickhouse/{schema}/pairs", "row_count")].description, describe(results)
    assert check_command(config, build_definitions(config), "public.nope", None) == 2
    assert f"{schema}.items" in capsys.readouterr().err
    assert check_command(config, build_definitions(config), None, "bigquery") == 2
    assert "clickhouse, snowflake" in capsys.readouterr().err
