"""ALTER TABLE ... ADD COLUMN with a DEFAULT at the source, through the whole stream: PostgreSQL ->
siphon-producer -> JetStream -> StreamConsumer -> ClickHouse and Snowflake.

PostgreSQL sends no change for the rows that exist when the column is added: a constant DEFAULT is
kept once in the catalog, a volatile one is written into every row by a table rewrite. The first
must reach the target with the rows; the second cannot, and must be reported, never passed over.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import dagster as dg
import psycopg
import pytest
from pyspark.sql import SparkSession

from siphon_core import naming
from siphon_core.config import parse_config
from siphon_dagster.definitions import build_definitions
from siphon_dagster.partitions import ranges_for
from siphon_dagster.specs import table_specs
from siphon_dagster.streaming.report import BatchReport
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.streaming.spark_session import get_spark_session
from siphon_dagster.targets.base import Target
from tests.helpers.application import Application
from tests.helpers.instance import instance_for_test
from tests.helpers.producer import wait_until
from tests.integration.test_streaming_consumer import consumer, make_target

# One ALTER, several types: each value must come out as a snapshot of the row would write it.
ADD_COLUMNS = """
alter table {schema}.items
    add column qty integer default 7,
    add column label text not null default 'it''s \\ "quoted"',
    add column flag boolean default true,
    add column raw bytea default '\\x0aff',
    add column at timestamptz default '2024-01-02 03:04:05+02',
    add column ratio double precision default 0.1,
    add column tags text[] default '{"a b",c}',
    add column code char(4) default 'ab',
    add column plain text
"""
DEFAULTS = ("7", 'it\'s \\ "quoted"', "t", "\\x0aff", "2024-01-02 01:04:05+00", "0.1", '{"a b",c}', "ab  ", None)


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    yield get_spark_session()


def drain(app: Application, target: Target, spark: SparkSession, table: str,
          reader: SourceRowReader) -> list[BatchReport]:
    reports: list[BatchReport] = []
    consumer(app.nats_url, app.identifier, target, spark, table=app.qualified(table), source=reader).run(
        stop_when_drained=True, on_batch=reports.append)
    return reports


def test_rows_that_predate_an_added_column_hold_its_default_in_every_target(
        request: pytest.FixtureRequest, app: Application, spark: SparkSession) -> None:
    app.sql("create table {schema}.items (id integer primary key, body text)")
    app.producer(["items"])
    app.sql("insert into {schema}.items select g, 'row ' || g from generate_series(1, 4) g")
    app.wait_for_events(4, "items")
    reader = SourceRowReader(app.dsn)
    targets = [make_target(request, name, app.identifier) for name in ("clickhouse", "snowflake")]
    try:
        for target in targets:
            drain(app, target, spark, "items", reader)  # the rows land before the column exists

        app.sql(ADD_COLUMNS)
        app.sql("update {schema}.items set body = 'touched' where id = 2")
        app.sql("update {schema}.items set qty = 70, flag = false, plain = 'set' where id = 3")
        app.sql("insert into {schema}.items (id, body, qty, raw, tags) values (5, 'nulls', null, null, null)")
        app.sql("insert into {schema}.items (id, body) values (6, 'defaults')")
        app.wait_for_events(8, "items")

        table = app.table_schema("items")
        expected = app.rows_as_text(table)
        assert expected[0] == ("1", "row 1", *DEFAULTS)  # the source's own view of an untouched row
        assert expected[4][:3] == ("5", "nulls", None) and expected[4][5] is None
        for target in targets:
            reports = drain(app, target, spark, "items", reader)
            assert [w for r in reports for w in r.warnings] == [], target.name
            assert target.current_rows_as_text(table) == expected, target.name
    finally:
        reader.close()
        for target in targets:
            target.close()


def test_a_volatile_default_is_reported_in_the_run_log_and_the_materialization(
        request: pytest.FixtureRequest, app: Application, clickhouse_url: str, spark: SparkSession) -> None:
    app.sql("create table {schema}.events (id integer primary key, body text)")
    app.producer(["events"])
    app.sql("insert into {schema}.events select g, 'row ' || g from generate_series(1, 3) g")
    app.wait_for_events(3, "events")
    config = parse_config({
        "application_identifier": app.identifier, "source": {"dsn": app.dsn}, "queue": {"url": app.nats_url},
        "tables": [{"name": app.qualified("events")}],
        "targets": {"clickhouse": {"url": clickhouse_url, "database": app.identifier}},
        "streaming": {"batch_max_wait_seconds": 0.3},
    })
    job = build_definitions(config).resolve_job_def(naming.stream_job_name("clickhouse", app.schema, "events"))
    op = f"apply_clickhouse_{naming.job_suffix(app.schema, 'events')}"
    run_config = {"ops": {op: {"config": {"stop_when_drained": True}}}}
    with instance_for_test() as instance:
        assert job.execute_in_process(run_config=run_config, instance=instance).success

        # clock_timestamp() is volatile: PostgreSQL rewrites the table to write it into every row.
        app.sql("alter table {schema}.events add column seen_at timestamptz default clock_timestamp()")
        app.sql("insert into {schema}.events (id, body) values (4, 'after')")
        app.wait_for_events(4, "events")
        result = job.execute_in_process(run_config=run_config, instance=instance)
        assert result.success
        materializations = [entry.asset_materialization for entry in
                            instance.all_logs(result.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)]
        [materialization] = [m for m in materializations if "warnings" in m.metadata]
        [warning] = [entry.user_message for entry in instance.all_logs(result.run_id)
                     if entry.level == logging.WARNING and "seen_at" in entry.user_message]
    for text in (warning, materialization.metadata["warnings"].value):
        assert f"table {app.qualified('events')}: column 'seen_at' was added at the source" in text
        assert "DEFAULT clock_timestamp()" in text
        assert f"materialize every partition of asset clickhouse/{app.schema}/events" in text

    # As the warning says: the older rows read NULL until snapshotted again; the new row holds its value.
    table = app.table_schema("events")
    target = make_target(request, "clickhouse", app.identifier)
    try:
        rows, expected = target.current_rows_as_text(table), app.rows_as_text(table)
    finally:
        target.close()
    assert [row[2] for row in rows[:3]] == [None, None, None] and None not in (row[2] for row in expected)
    assert rows[3] == expected[3]


@pytest.mark.parametrize("target_name", ["clickhouse", "snowflake"])
def test_a_snapshot_reads_the_columns_the_table_has_when_its_range_is_read(
        request: pytest.FixtureRequest, app: Application, clickhouse_url: str, snowflake_env: dict[str, str],
        target_name: str) -> None:
    """A column added after a snapshot run started, and filled before its range is read, is copied
    with the rest: the column list comes from the catalog once the table is locked for the COPY."""
    app.sql("create table {schema}.invoices (id integer primary key, body text)")
    app.sql("insert into {schema}.invoices select g, 'row ' || g from generate_series(1, 4) g")
    config = parse_config({
        "application_identifier": app.identifier, "source": {"dsn": app.dsn}, "queue": {"url": app.nats_url},
        "tables": [{"name": app.qualified("invoices")}],
        "targets": {
            "clickhouse": {"url": clickhouse_url, "database": app.identifier},
            "snowflake": {"account": snowflake_env["SIPHON_SNOWFLAKE_ACCOUNT"], "user": snowflake_env["SIPHON_SNOWFLAKE_USER"],
                          "password": snowflake_env["SIPHON_SNOWFLAKE_PASSWORD"], "database": "SIPHON",
                          "schema": app.identifier, "host": "127.0.0.1",
                          "port": int(snowflake_env["SIPHON_SNOWFLAKE_PORT"]), "protocol": "http"},
        },
    })
    defs = build_definitions(config)
    [spec] = table_specs(config)
    key = ranges_for(1, spec.table.blocks_per_partition)[0].key
    # An open transaction holding an xid keeps the run's slot from being created, so the run has
    # started (and the old column list was current) before the ALTER and the UPDATE commit.
    blocker = psycopg.connect(app.dsn)
    blocker.execute("select pg_current_xact_id()")  # an xid, and no lock the ALTER would wait for
    with instance_for_test() as instance, ThreadPoolExecutor(1) as pool:
        instance.add_dynamic_partitions(spec.partitions_def_name, [key])
        try:
            run = pool.submit(dg.materialize, [defs.resolve_assets_def(spec.target_key(target_name))],
                              partition_key=key, instance=instance)
            wait_until(lambda: run.done() or app.sql(
                "select count(*) from pg_stat_activity where backend_type = 'walsender' "
                "and query like 'CREATE_REPLICATION_SLOT%%' and application_name = 'siphon snapshot'", ())[0][0] > 0,
                60, "the run waiting for its slot")
            assert not run.done(), run.result()
            app.sql("alter table {schema}.invoices add column currency varchar(3) default 'EUR'")
            app.sql("update {schema}.invoices set currency = 'USD' where id = 2")
        finally:
            blocker.rollback()
            blocker.close()
        assert run.result(timeout=300).success

    table = app.table_schema("invoices")
    expected = app.rows_as_text(table)
    assert [row[2] for row in expected] == ["EUR", "USD", "EUR", "EUR"]
    target = make_target(request, target_name, app.identifier)
    try:
        assert target.current_rows_as_text(table) == expected
    finally:
        target.close()
