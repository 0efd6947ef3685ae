"""Unchanged TOASTed values through the whole path: a primary-key update and later updates of other
columns keep the value, whether or not the row's snapshot landed before the stream."""

import sys

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
from tests.integration.test_end_to_end import run_stream_jobs, source_rows, target_rows


@pytest.mark.parametrize("order", ["snapshot-first", "stream-only", "snapshot-between"])
def test_toasted_values_survive_key_updates(order, tmp_path, postgres_dsn, nats_url, clickhouse_url,
                                            snowflake_env, unique_name):
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        connection.execute(sql.SQL("create table {} (id bigint primary key, qty int, body text)").format(
            sql.Identifier(unique_name, "docs")))
        connection.execute(sql.SQL("alter table {} alter column body set storage external").format(
            sql.Identifier(unique_name, "docs")))
        connection.execute(sql.SQL("insert into {} select g, g, repeat(md5(g::text), 300) "
                                   "from generate_series(1, 200) g").format(sql.Identifier(unique_name, "docs")))
    config_path = tmp_path / "siphon.yaml"
    config_path.write_text(yaml.safe_dump({
        "application_identifier": unique_name,
        "source": {"dsn": postgres_dsn},
        "queue": {"url": nats_url},
        "producer": {"flush_interval_seconds": 0.2, "metrics_port": free_port(), "status_interval_seconds": 0.5},
        "tables": [{"name": f"{unique_name}.docs"}],
        "targets": {
            "clickhouse": {"url": clickhouse_url, "database": unique_name},
            "snowflake": {"account": "fakesnow", "user": "siphon", "password": "siphon",
                          "database": unique_name.upper(), "schema": "PUBLIC", "host": "127.0.0.1",
                          "port": int(snowflake_env["SIPHON_SNOWFLAKE_PORT"]), "protocol": "http"},
        },
    }))
    config = load_config(config_path)
    defs, resources, specs = build_definitions(config), build_resources(config), table_specs(config)
    spec = specs[0]
    producer = start_process("siphon-producer", [sys.executable, "-m", "producer_service.cli", "run", "--config",
                                                 str(config_path)], tmp_path / "producer.log")
    try:
        wait_until(lambda: producer_streaming(config.producer.metrics_port), 60, "producer streaming")
        with instance_for_test() as instance:
            with source.connect(config.source.dsn) as connection:
                keys = [r.key for r in ranges_for(source.table_size(connection, spec.table).blocks, 8192)]
            instance.add_dynamic_partitions(spec.partitions_def_name, keys)
            def snapshot() -> None:
                for target in spec.targets:
                    asset = defs.resolve_assets_def(spec.target_key(target))
                    assert dg.materialize([asset], partition_key=keys[0], instance=instance).success

            def caught_up() -> bool:
                with psycopg.connect(postgres_dsn) as connection:
                    row = connection.execute(
                        "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s",
                        (naming.slot_name(unique_name),)).fetchone()
                return bool(row and row[0]) and naming.parse_lsn(row[0]) >= end

            if order == "snapshot-first":
                snapshot()
            table = sql.Identifier(unique_name, "docs")
            with psycopg.connect(postgres_dsn, autocommit=True) as connection:
                connection.execute(sql.SQL("update {} set id = id + 1000 where id in (10, 20)").format(table))
                connection.execute(sql.SQL("update {} set qty = qty + 1 where id in (1010, 30)").format(table))
                end = naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])
            if order == "snapshot-between":
                wait_until(caught_up, 60, "producer caught up")
                run_stream_jobs(defs, specs, instance, drain=True)
                snapshot()
            with psycopg.connect(postgres_dsn, autocommit=True) as connection:
                connection.execute(sql.SQL("update {} set id = 2010 where id = 1010").format(table))
                connection.execute(sql.SQL("update {} set qty = qty + 1 where id in (1020, 2010)").format(table))
                end = naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])

            wait_until(caught_up, 60, "producer caught up")
            run_stream_jobs(defs, specs, instance, drain=True)
        with source.connect(postgres_dsn) as connection:
            schema = source.table_schema(connection, spec.table)
        expected = source_rows(postgres_dsn, schema)
        for key in ("clickhouse_target", "snowflake_target"):
            target = resources[key].open_target()
            try:
                actual = target_rows(target, schema)
            finally:
                target.close()
            changed = [("1020",), ("2010",), ("30",)]
            for row_key in changed:
                assert actual.get(row_key) == expected[row_key], f"{key} {row_key}"
            if order != "stream-only":
                assert actual == expected, key
    finally:
        stop_pid(producer.pid, timeout=30)
