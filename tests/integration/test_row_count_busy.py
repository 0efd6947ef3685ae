"""row_count on a busy table (a live writer, the stream applying it): it passes when the target is
healthy, and fails within its settle timeout when a few rows were deleted by hand at the target, at
ClickHouse and at Snowflake (fakesnow), although every row the writer changes widens the in-flight
band. Real PostgreSQL, NATS, producer, targets and Dagster instance (the checks' stack)."""

from __future__ import annotations

import time

import dagster as dg

from siphon_dagster.checks.command import run_checks, selected_keys
from siphon_dagster.specs import group_name
from siphon_dagster.targets.base import TableSchema
from siphon_dagster.targets.clickhouse import ClickHouseTarget
from siphon_dagster.targets.snowflake import SnowflakeTarget
from tests.integration.test_checks import (  # noqa: F401 (stack is a fixture)
    Streaming,
    Workload,
    drain_once,
    stack,
    wait_until,
)

DELETED_BY_HAND = (3, 4, 7)  # among the ids the workload never touches


def delete_by_hand(config, schema: str) -> None:
    ids = ", ".join(str(i) for i in DELETED_BY_HAND)
    clickhouse = ClickHouseTarget(config.targets.clickhouse)
    try:
        clickhouse._connect().command(  # noqa: SLF001 (behind Siphon's back)
            f"ALTER TABLE `{schema}`.`{schema}__items` DELETE WHERE id IN ({ids}) SETTINGS mutations_sync = 1")
    finally:
        clickhouse.close()
    snowflake = SnowflakeTarget(config.targets.snowflake)
    try:
        snowflake._connect().cursor().execute(  # noqa: SLF001
            f'DELETE FROM "{snowflake.database}"."{snowflake.schema}"."{schema}__items" WHERE id IN ({ids})')
    finally:
        snowflake.close()


def test_row_count_on_a_busy_table_passes_when_healthy_and_fails_on_rows_deleted_by_hand(stack):  # noqa: F811
    config, defs, specs, instance, config_path = stack
    schema = config.tables[0].schema_name
    keys = [k for k in selected_keys(config, f"{schema}.items", None) if k.name == "row_count"]
    group = group_name(config.application_identifier)
    workload = Workload(config.source.dsn, schema)
    streaming = Streaming(config_path)
    drain_once(defs, specs, instance)
    items = TableSchema(schema, "items", ())
    targets = {"clickhouse": ClickHouseTarget(config.targets.clickhouse),
               "snowflake": SnowflakeTarget(config.targets.snowflake)}
    loaded = {name: target.max_version(items) for name, target in targets.items()}
    workload.thread.start()
    streaming.start()
    try:
        # The streaming process applies the workload at both targets (its start is slow on a busy machine).
        wait_until(lambda: all(t.max_version(items) > loaded[n] for n, t in targets.items()), 240,
                   "the workload streamed to both targets")
        healthy = {e.asset_key.to_user_string(): e for e in run_checks(defs, group, keys, instance)}
        assert len(healthy) == 2
        for name, evaluation in healthy.items():
            assert evaluation.passed, f"{name}: {evaluation.description}"
            # Busy indeed: keys changed after the source's read were compared at the read.
            assert evaluation.metadata["keys_changed_after_read"].value > 0, (name, evaluation.description)

        delete_by_hand(config, schema)
        started = time.monotonic()
        damaged = {e.asset_key.to_user_string(): e for e in run_checks(defs, group, keys, instance)}
        seconds = time.monotonic() - started
    finally:
        workload.stop.set()
        workload.thread.join(timeout=30)
        streaming.halt()
        for target in targets.values():
            target.close()
    assert not workload.errors, workload.errors
    assert seconds < config.checks.settle_timeout_seconds
    for name, evaluation in damaged.items():
        assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR, name
        assert evaluation.description.startswith(
            f"drift: {len(DELETED_BY_HAND)} rows missing at the target among keys unchanged since the source's "
            "read"), (name, evaluation.description)
        assert evaluation.metadata["difference"].value == -len(DELETED_BY_HAND)
