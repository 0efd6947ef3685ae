"""`siphon-dagster repair --table T` without a keys file: row parity names the divergent keys and their
partitions at ClickHouse and at Snowflake (fakesnow), exactly those partitions are snapshotted again,
the extra keys tombstoned, and the table's checks pass afterwards. Real PostgreSQL, NATS, producer,
targets and Dagster instance (the checks' stack)."""

from __future__ import annotations

import dagster as dg
import psycopg

from siphon_dagster import cli, runs, source
from siphon_dagster.checks.definitions import checks_job_name
from siphon_dagster.specs import group_name
from siphon_dagster.targets import build_target
from tests.helpers.application import rows_as_text
from tests.integration.test_checks import (  # noqa: F401 (stack is a fixture)
    drain_once,
    hand_edit_clickhouse,
    hand_edit_snowflake,
    stack,
)

TARGETS = ("clickhouse", "snowflake")
NAMED = "00000000-00000015"  # the partition of items holding ids 3 and 5, which the hand edits change


def materialized_partitions(instance: dg.DagsterInstance, asset_key: dg.AssetKey, run_ids: set[str]) -> list[str]:
    records = instance.fetch_materializations(asset_key, limit=1000).records
    return sorted(r.asset_materialization.partition for r in records
                  if r.run_id in run_ids and r.asset_materialization is not None)


def test_repair_of_a_table_fixes_what_row_parity_names_and_snapshots_only_its_partitions(
        stack, capsys, monkeypatch):  # noqa: F811 (the fixture imported above)
    config, defs, specs, instance, config_path = stack
    schema = config.tables[0].schema_name
    items, pairs = (runs.find_spec(config, f"{schema}.{name}") for name in ("items", "pairs"))
    assert len(instance.get_dynamic_partitions(items.partitions_def_name)) > 1  # so "only" means something
    checks_job = checks_job_name(group_name(config.application_identifier))
    drain_once(defs, specs, instance)
    hand_edit_clickhouse(config, schema)  # id 3 deleted, id 5 changed, 900001 and 900002 inserted; pairs: one extra
    hand_edit_snowflake(config, schema)
    monkeypatch.setattr(dg.DagsterInstance, "get", staticmethod(lambda: instance))
    before = {run.run_id for run in instance.get_runs()}

    assert cli.main(["--config", str(config_path), "repair", "--table", items.qualified_name]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for target in TARGETS:
        assert (f"{items.qualified_name} at {target}: row parity found 4 divergent keys (2 extra at target, "
                f"1 missing at target, 1 values differ)") in out, out
        assert any(line.startswith(f"{items.qualified_name} at {target}, partitions {NAMED}...{NAMED}: "
                                   "re-snapshotted") for line in lines), out
        assert f"{items.qualified_name} at {target}: 2 keys, 0 at the source" in out and "2 tombstoned" in out, out
        for check in ("schema_parity", "row_count", "row_parity", "freshness"):
            assert any(line.startswith(f"PASS  {target}/{schema}/items  {check}") for line in lines), out

    # What ran: one snapshot run per target, of the named partition alone, then the checks.
    new_runs = [run for run in instance.get_runs() if run.run_id not in before]
    snapshot_runs = {run.run_id for run in new_runs if run.job_name != checks_job}
    assert len(snapshot_runs) == len(TARGETS)
    for target in TARGETS:
        assert materialized_partitions(instance, items.target_key(target), snapshot_runs) == [NAMED]
    assert all(run.status == dg.DagsterRunStatus.SUCCESS for run in new_runs)

    with psycopg.connect(config.source.dsn) as connection:
        table = source.table_schema(connection, items.table)
        pairs_table = source.table_schema(connection, pairs.table)
    expected = rows_as_text(config.source.dsn, table)
    for target in TARGETS:
        destination = build_target(target, config)
        try:
            assert destination.current_rows_as_text(table) == expected, target
        finally:
            destination.close()

    # A table whose only divergence is a key the source never had: a tombstone, no snapshot run.
    before = {run.run_id for run in instance.get_runs()}
    assert cli.main(["--config", str(config_path), "repair", "--table", pairs.qualified_name,
                     "--target", "clickhouse"]) == 0
    out = capsys.readouterr().out
    assert "row parity found 1 divergent keys (1 extra at target)" in out and "1 tombstoned" in out, out
    assert [run.job_name for run in instance.get_runs() if run.run_id not in before] == [checks_job]
    destination = build_target("clickhouse", config)
    try:
        assert destination.current_rows_as_text(pairs_table) == rows_as_text(config.source.dsn, pairs_table)
    finally:
        destination.close()

    # Bad input: exit 2 naming what the configuration has.
    assert cli.main(["--config", str(config_path), "repair", "--table", "public.nope"]) == 2
    assert "its tables are" in capsys.readouterr().err
