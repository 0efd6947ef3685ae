"""The whole path under a live workload: PostgreSQL -> siphon-producer -> JetStream -> streaming runs and
snapshot partitions (through Dagster) -> ClickHouse and Snowflake, compared row for row with the source."""

from __future__ import annotations

import random
import sys
import threading
import time

import dagster as dg
import psycopg
import pytest
import yaml
from psycopg import sql

from siphon_core import naming
from siphon_core.config import load_config
from siphon_dagster import source
from siphon_dagster.definitions import build_definitions, build_resources
from siphon_dagster.partitions import ranges_for
from siphon_dagster.specs import table_specs
from siphon_stack.process import free_port, start_process, stop_pid
from tests.helpers.instance import instance_for_test
from tests.helpers.producer import producer_streaming, wait_until

SCHEMA_DDL = """
create table {schema}.items (
    id bigserial primary key,
    title text not null,
    body text,
    qty integer,
    price numeric(12, 2),
    tags text[],
    meta jsonb,
    updated_at timestamptz default now()
);
alter table {schema}.items alter column body set storage external;
create table {schema}.pairs (
    left_id integer,
    right_id text,
    weight double precision,
    primary key (left_id, right_id)
);
"""


def big_text(seed: int) -> str:
    # Incompressible and above the TOAST threshold, so an update of another column leaves it unchanged.
    rnd = random.Random(seed)
    return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(9000))


class Workload:
    """Inserts, updates, deletes, primary-key updates, TOASTed rows, a large transaction, TRUNCATE
    and an added column, from a background thread until stopped."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.transactions = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rnd = random.Random(11)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as connection:
                connection.execute(sql.SQL("set search_path to {}").format(sql.Identifier(self.schema)))
                step = 0
                while not self.stop.is_set():
                    step += 1
                    with connection.transaction():
                        self._step(connection, rnd, step)
                    self.transactions += 1
                    time.sleep(0.005)
        except BaseException as error:  # surfaced by the test
            self.errors.append(error)

    def _step(self, c: psycopg.Connection, rnd: random.Random, step: int) -> None:
        choice = rnd.random()
        if step == 40:
            c.execute("insert into items (title, qty, price) select 'bulk ' || g, g, g / 3.0 "
                      "from generate_series(1, 5000) g")
        elif step == 80:
            # Without a DEFAULT: rows that predate the column read NULL at the source too (a DEFAULT
            # has its own test, test_add_column_default.py).
            c.execute("alter table items add column priority smallint")
        elif step == 90:
            c.execute("update items set priority = 1 where id in (select id from items order by id desc limit 20)")
        elif step == 120:
            c.execute("truncate pairs")
        elif choice < 0.35:
            c.execute("insert into items (title, body, qty, price, tags, meta) values (%s, %s, %s, %s, %s, %s)",
                      (f"item {step}", big_text(step) if step % 5 == 0 else f"body {step}", step, step / 7,
                       ["a", None, f"t{step}"], psycopg.types.json.Jsonb({"step": step, "k": [1, 2]})))
            c.execute("insert into pairs values (%s, %s, %s) on conflict do nothing",
                      (rnd.randint(1, 50), f"r{rnd.randint(1, 50)}", rnd.random()))
        elif choice < 0.65:
            c.execute("update items set qty = qty + 1, updated_at = now() "
                      "where id in (select id from items order by random() limit 3)")
        elif choice < 0.75:
            c.execute("update items set id = id + 1000000 where id = (select min(id) from items where id < 1000000)")
        elif choice < 0.85:
            c.execute("delete from items where id = (select max(id) from items where id < 1000000)")
        elif choice < 0.95:
            c.execute("update pairs set weight = weight + 1 where left_id = %s", (rnd.randint(1, 50),))
        else:
            c.execute("delete from pairs where left_id = %s", (rnd.randint(1, 50),))


def source_rows(dsn: str, table) -> dict[tuple, tuple]:
    """Every row as PostgreSQL's text output, keyed by primary key."""
    columns = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c)) for c in table.column_names)
    with source.connect(dsn) as connection:
        rows = connection.execute(sql.SQL("select {} from {}").format(
            columns, sql.Identifier(table.schema, table.table))).fetchall()
    keys = [i for i, c in enumerate(table.columns) if c.primary_key]
    return {tuple(row[i] for i in keys): tuple(row) for row in rows}


def target_rows(target, table) -> dict[tuple, tuple]:
    keys = [i for i, c in enumerate(table.columns) if c.primary_key]
    return {tuple(row[i] for i in keys): tuple(row) for row in target.current_rows_as_text(table)}


@pytest.fixture
def application(tmp_path, postgres_dsn, nats_url, clickhouse_url, snowflake_env, unique_name):
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        connection.execute(SCHEMA_DDL.format(schema=unique_name))
        connection.execute(sql.SQL("set search_path to {}").format(sql.Identifier(unique_name)))
        connection.execute("insert into items (title, body, qty, price, tags) select 'seed ' || g, "
                           "case when g % 50 = 0 then repeat(md5(g::text), 300) else 'b' || g end, g, g / 3.0, "
                           "array['x', null] from generate_series(1, 20000) g")
        connection.execute("insert into pairs select g % 50, 'r' || (g / 50), g from generate_series(1, 2000) g")
    config_path = tmp_path / "siphon.yaml"
    config_path.write_text(yaml.safe_dump({
        "application_identifier": unique_name,
        "source": {"dsn": postgres_dsn},
        "queue": {"url": nats_url},
        "producer": {"flush_interval_seconds": 0.3, "metrics_port": free_port(), "status_interval_seconds": 0.5},
        "tables": [{"name": f"{unique_name}.items", "blocks_per_partition": 64},
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
    }))
    return load_config(config_path), config_path


def test_stream_and_snapshots_under_a_live_workload_converge_in_every_target(application, tmp_path):
    config, config_path = application
    producer = start_process("siphon-producer", [sys.executable, "-m", "producer_service.cli", "run", "--config",
                                                 str(config_path)], tmp_path / "producer.log")
    workload = Workload(config.source.dsn, config.tables[0].schema_name)
    try:
        port = config.producer.metrics_port

        wait_until(lambda: producer_streaming(port), 60, "producer streaming")
        workload.thread.start()
        defs = build_definitions(config)
        resources = build_resources(config)
        specs = table_specs(config)
        with instance_for_test() as instance:
            # Snapshot every partition of every target, in random order, while the workload runs,
            # and apply the stream in between.
            work = []
            with source.connect(config.source.dsn) as connection:
                for spec in specs:
                    size = source.table_size(connection, spec.table)
                    keys = [r.key for r in ranges_for(size.blocks, spec.table.blocks_per_partition)]
                    instance.add_dynamic_partitions(spec.partitions_def_name, keys)
                    work += [(spec, target, key) for target in spec.targets for key in keys]
            random.Random(5).shuffle(work)
            for index, (spec, target, key) in enumerate(work):
                asset = defs.resolve_assets_def(spec.target_key(target))
                result = dg.materialize([asset], partition_key=key, instance=instance)
                assert result.success
                if index % 5 == 0:
                    run_stream_jobs(defs, specs, instance, max_batches=3)
            # Re-running partitions, later and under the same workload, is harmless.
            for spec, target, key in work[:3]:
                assert dg.materialize([defs.resolve_assets_def(spec.target_key(target))], partition_key=key,
                                      instance=instance).success
            time.sleep(2.0)  # let the workload pass its large transaction, added column and truncate
            workload.stop.set()
            workload.thread.join(timeout=30)
            assert not workload.errors, workload.errors
            assert workload.transactions > 120

            with psycopg.connect(config.source.dsn) as connection:
                end = naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])

            def caught_up() -> bool:
                with psycopg.connect(config.source.dsn) as connection:
                    row = connection.execute(
                        "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s",
                        (naming.slot_name(config.application_identifier),)).fetchone()
                return bool(row and row[0]) and naming.parse_lsn(row[0]) >= end

            wait_until(caught_up, 120, "producer caught up")
            run_stream_jobs(defs, specs, instance, drain=True)

        with source.connect(config.source.dsn) as connection:
            tables = {spec.qualified_name: source.table_schema(connection, spec.table) for spec in specs}
        assert "priority" in tables[f"{config.tables[0].schema_name}.items"].column_names
        problems = []
        for target_name, resource_key in (("clickhouse", "clickhouse_target"), ("snowflake", "snowflake_target")):
            target = resources[resource_key].open_target()
            try:
                for name, table in tables.items():
                    expected = source_rows(config.source.dsn, table)
                    actual = target_rows(target, table)
                    missing = expected.keys() - actual.keys()
                    extra = actual.keys() - expected.keys()
                    differing = [k for k in expected.keys() & actual.keys() if expected[k] != actual[k]]
                    if missing or extra or differing:
                        columns = sorted({table.columns[i].name for k in differing
                                          for i, (a, b) in enumerate(zip(expected[k], actual[k], strict=True))
                                          if a != b})
                        problems.append(f"{target_name} {name}: {len(missing)} missing (e.g. {sorted(missing)[:3]}), "
                                        f"{len(extra)} extra (e.g. {sorted(extra)[:3]}), {len(differing)} differ "
                                        f"(keys {sorted(differing)[:5]}, columns {columns})")
                    elif target.count_current(table) != len(expected):
                        problems.append(f"{target_name} {name}: count_current disagrees with the rows read")
            finally:
                target.close()
        assert not problems, "\n".join(problems)
    finally:
        workload.stop.set()
        stop_pid(producer.pid, timeout=30)


def run_stream_jobs(defs, specs, instance, max_batches: int | None = None, drain: bool = False) -> None:
    for spec in specs:
        for target in spec.targets:
            job = defs.resolve_job_def(spec.stream_job_name(target))
            op = f"apply_{target}_{spec.job_suffix}"
            config = {"stop_when_drained": True} if drain else {"max_batches": max_batches, "stop_when_drained": True}
            result = job.execute_in_process(run_config={"ops": {op: {"config": config}}}, instance=instance)
            assert result.success
