"""A partitioned source table replicates as one table: its changes are published as the
partitioned table's (whichever partition they were made in, rows moving between partitions
included), and a snapshot partition's block range is read from every leaf."""

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
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.streaming.spark_session import get_spark_session
from tests.helpers.application import Application
from tests.helpers.instance import instance_for_test
from tests.helpers.producer import current_lsn, execute, slot_confirmed_lsn, wait_until
from tests.integration.test_streaming_consumer import consumer, make_target

BLOCKS_PER_PARTITION = 8
PARTITIONED = """
create table {schema}.readings (
    device integer not null,
    seq bigint not null,
    reading text,
    primary key (device, seq)
) partition by range (device);
create table {schema}.readings_low partition of {schema}.readings for values from (0) to (100);
create table {schema}.readings_high partition of {schema}.readings for values from (100) to (200);
create table {schema}.readings_rest partition of {schema}.readings default;
"""


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    yield get_spark_session()


def leaf_blocks(app: Application) -> dict[str, int]:
    rows = execute(app.dsn, "select relname, pg_relation_size(oid) / current_setting('block_size')::int from pg_class "
                            "where relnamespace = %s::regnamespace and relname like 'readings\\_%%' and relkind = 'r'",
                   (app.schema,))
    return dict(rows)


@pytest.mark.parametrize("target_name", ["clickhouse"])
def test_a_partitioned_table_converges_through_snapshots_and_the_stream(
        request: pytest.FixtureRequest, app: Application, clickhouse_url: str, spark: SparkSession,
        target_name: str) -> None:
    app.sql(PARTITIONED)
    # Leaves of different sizes: the table's block ranges must cover the largest.
    app.sql("insert into {schema}.readings select 5, g, repeat('low ', 20) || g from generate_series(1, 3000) g")
    app.sql("insert into {schema}.readings select 150, g, repeat('high ', 20) || g from generate_series(1, 600) g")
    app.sql("insert into {schema}.readings select 500, g, 'rest ' || g from generate_series(1, 50) g")
    table_config = TableConfig(name=app.qualified("readings"), blocks_per_partition=BLOCKS_PER_PARTITION)
    with source.connect(app.dsn) as connection:
        size = source.table_size(connection, table_config)
    blocks = leaf_blocks(app)
    assert size.blocks == max(blocks.values()) > 2 * BLOCKS_PER_PARTITION
    assert size.row_estimate >= 0 and size.bytes == sum(blocks.values()) * size.block_size

    producer = app.producer([{"name": "readings"}])
    # Changes in every leaf, rows moving between leaves, and a primary-key update within one.
    app.sql("update {schema}.readings set reading = 'changed' where device = 5 and seq % 10 = 0")
    app.sql("update {schema}.readings set device = 150, seq = seq + 100000 where device = 5 and seq % 7 = 0")
    app.sql("update {schema}.readings set device = 700 where device = 150 and seq between 1 and 40")
    app.sql("delete from {schema}.readings where device = 500 and seq <= 10")
    app.sql("insert into {schema}.readings select 42, g, 'late ' || g from generate_series(1, 200) g")
    app.sql("update {schema}.readings set seq = -seq where device = 42 and seq <= 5")
    # A restart must find the publication as it left it (a partitioned table listed as itself).
    assert producer.stop() == 0
    producer = app.producer([{"name": "readings"}])

    config = parse_config({
        "application_identifier": app.identifier, "source": {"dsn": app.dsn}, "queue": {"url": app.nats_url},
        "tables": [{"name": app.qualified("readings"), "blocks_per_partition": BLOCKS_PER_PARTITION}],
        "targets": {"clickhouse": {"url": clickhouse_url, "database": app.identifier}},
    })
    defs = build_definitions(config)
    [spec] = table_specs(config)
    keys = [block_range.key for block_range in ranges_for(size.blocks, BLOCKS_PER_PARTITION)]
    assert len(keys) >= 3
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(spec.partitions_def_name, keys)
        for key in keys:
            assert dg.materialize([defs.resolve_assets_def(spec.target_key(target_name))], partition_key=key,
                                  instance=instance).success

    app.sql("update {schema}.readings set reading = 'after the snapshot' where device = 700")
    # Rows older than a column added with a constant default hold it in every leaf, without a change.
    app.sql("alter table {schema}.readings add column unit text default 'celsius'")
    app.sql("update {schema}.readings set unit = 'kelvin' where device = 42 and seq > 190")
    app.sql("delete from {schema}.readings where device = 150 and seq > 100000 and seq % 2 = 0")
    end = current_lsn(app.dsn)
    wait_until(lambda: slot_confirmed_lsn(app.dsn, app.slot) >= end, 60, "the producer caught up")
    table = app.table_schema("readings")
    target = make_target(request, target_name, app.identifier)
    reader = SourceRowReader(app.dsn)
    try:
        expected = app.rows_as_text(table)
        consumer(app.nats_url, app.identifier, target, spark, table=app.qualified("readings"),
                 source=reader).run(stop_when_drained=True)
        assert sorted(target.current_rows_as_text(table)) == sorted(expected)
        subjects = {event.table for event in app.events()}
        assert subjects == {app.qualified("readings")}, "every change is published as the partitioned table's"
    finally:
        reader.close()
        target.close()
        producer.stop()


def test_a_publication_made_without_publish_via_partition_root_is_altered(app: Application) -> None:
    app.sql(PARTITIONED)
    app.sql(f'create publication "{app.publication}" for table {{schema}}.readings')
    producer = app.producer([{"name": "readings"}])
    app.sql("insert into {schema}.readings values (1, 1, 'low'), (150, 1, 'high'), (900, 1, 'rest')")

    events = app.wait_for_events(3, "readings")

    assert sorted(int(e.new_row()["device"]) for e in events) == [1, 150, 900]
    assert execute(app.dsn, "select pubviaroot from pg_publication where pubname = %s", (app.publication,)) == [(True,)]
    assert producer.stop() == 0
