"""A STORED generated column: PostgreSQL's change stream never carries it, so Siphon leaves it out
of snapshots as well. A snapshot and the stream then agree on the column list, and a streamed row is
never left without a value the snapshot would have copied."""

from __future__ import annotations

from collections.abc import Iterator

import dagster as dg
import pytest
from pyspark.sql import SparkSession

from siphon_core.config import TableConfig, parse_config
from siphon_dagster import source
from siphon_dagster.definitions import build_definitions
from siphon_dagster.partitions import ranges_for
from siphon_dagster.specs import table_specs
from siphon_dagster.streaming.report import BatchReport
from siphon_dagster.streaming.spark_session import get_spark_session
from tests.helpers.application import Application
from tests.helpers.instance import instance_for_test
from tests.integration.test_streaming_consumer import consumer, make_target


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    yield get_spark_session()


def test_a_generated_column_is_left_out_by_the_snapshot_and_the_stream_alike(
        request: pytest.FixtureRequest, app: Application, clickhouse_url: str, spark: SparkSession) -> None:
    app.sql("create table {schema}.lines (id integer primary key, qty integer, price numeric(12,2), "
            "total numeric(12,2) generated always as (qty * price) stored, note text)")
    app.sql("insert into {schema}.lines (id, qty, price, note) select g, g, 1.50, 'seed' from generate_series(1, 5) g")
    app.producer(["lines"])
    config = parse_config({
        "application_identifier": app.identifier, "source": {"dsn": app.dsn}, "queue": {"url": app.nats_url},
        "tables": [{"name": app.qualified("lines")}],
        "targets": {"clickhouse": {"url": clickhouse_url, "database": app.identifier}},
    })
    [spec] = table_specs(config)
    key = ranges_for(1, spec.table.blocks_per_partition)[0].key
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(spec.partitions_def_name, [key])
        assert dg.materialize([build_definitions(config).resolve_assets_def(spec.target_key("clickhouse"))],
                              partition_key=key, instance=instance).success

    app.sql("insert into {schema}.lines (id, qty, price, note) values (6, 6, 2.00, 'streamed')")
    app.sql("update {schema}.lines set qty = 100 where id = 1")
    app.sql("delete from {schema}.lines where id = 2")
    app.wait_for_events(3, "lines")

    table = app.table_schema("lines")
    assert table.column_names == ("id", "qty", "price", "note")
    target = make_target(request, "clickhouse", app.identifier)
    try:
        reports: list[BatchReport] = []
        consumer(app.nats_url, app.identifier, target, spark, table=app.qualified("lines")).run(
            stop_when_drained=True, on_batch=reports.append)
        assert [w for r in reports for w in r.warnings] == []
        assert "total" not in [c.name for c in target.describe_columns(table)]
        assert target.current_rows_as_text(table) == app.rows_as_text(table)
    finally:
        target.close()


def test_a_primary_key_on_a_generated_column_is_refused_with_the_reason(app: Application) -> None:
    app.sql("create table {schema}.codes (a integer, code text generated always as ('c' || a) stored primary key)")

    with source.connect(app.dsn) as connection, pytest.raises(source.SourceError) as refused:
        source.table_schema(connection, TableConfig(name=app.qualified("codes")))

    assert str(refused.value) == (f"table {app.qualified('codes')}: primary key column(s) ['code'] are generated "
                                  "columns, which PostgreSQL does not publish in its change stream")
