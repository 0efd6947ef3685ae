"""Data checks while block ranges are written into the table: which runs count as a load of the
asset, how the result reads, and that no status counts it as a failure; on a real (SQLite) instance."""

import uuid

import dagster as dg
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
)

from siphon_dagster.checks.command import status_line
from siphon_dagster.checks.outcome import loading, result
from siphon_dagster.status import TableStatus, problems
from siphon_dagster.table_state import latest_check_results, snapshot_runs_in_progress
from tests.helpers.instance import instance_for_test

ITEMS = dg.AssetKey(["clickhouse", "public", "items"])
OTHER = dg.AssetKey(["clickhouse", "public", "other"])


def add_run(instance: dg.DagsterInstance, status: dg.DagsterRunStatus, assets: set[dg.AssetKey] | None,
            tags: dict[str, str]) -> dg.DagsterRun:
    run = dg.DagsterRun(job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), status=status,
                        asset_selection=frozenset(assets) if assets is not None else None, tags=tags)
    return instance.add_run(run)


def test_only_in_progress_runs_writing_ranges_of_the_asset_count_as_its_load() -> None:
    with instance_for_test() as instance:
        partition = add_run(instance, dg.DagsterRunStatus.STARTED, {ITEMS}, {PARTITION_NAME_TAG: "00000000-00000015"})
        queued = add_run(instance, dg.DagsterRunStatus.NOT_STARTED, {ITEMS, OTHER},
                         {ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "b"})
        add_run(instance, dg.DagsterRunStatus.SUCCESS, {ITEMS}, {PARTITION_NAME_TAG: "x"})  # ended
        other = add_run(instance, dg.DagsterRunStatus.STARTED, {OTHER}, {PARTITION_NAME_TAG: "x"})  # another asset
        add_run(instance, dg.DagsterRunStatus.STARTED, {ITEMS}, {})  # not a partition's (a stream job's asset)
        add_run(instance, dg.DagsterRunStatus.STARTED, None, {PARTITION_NAME_TAG: "x"})  # an op job
        found = snapshot_runs_in_progress(instance, ITEMS)
        assert sorted(run.run_id for run in found) == sorted([partition.run_id, queued.run_id])
        assert sorted(run.run_id for run in snapshot_runs_in_progress(instance, OTHER)) == \
            sorted([queued.run_id, other.run_id])
        assert snapshot_runs_in_progress(instance, dg.AssetKey(["snowflake", "public", "items"])) == []

        outcome = loading(found)
        assert not outcome.passed and outcome.severity == dg.AssetCheckSeverity.WARN
        assert outcome.summary.startswith("not compared: the table is being loaded by 2 snapshot run(s)")
        assert f"{partition.run_id[:8]} (partition 00000000-00000015)" in outcome.summary
        assert f"{queued.run_id[:8]} (partitions a to b)" in outcome.summary

        # Recorded as the checks op records it: read back as "not compared", shown as SKIP, no failure.
        evaluation = result("row_count", ITEMS, outcome)
        instance.report_runless_asset_event(dg.AssetCheckEvaluation(
            asset_key=ITEMS, check_name="row_count", passed=False, severity=evaluation.severity,
            description=evaluation.description, metadata=evaluation.metadata))
        key = dg.AssetCheckKey(ITEMS, "row_count")
        assert latest_check_results(instance, [key]) == {key: "not compared (loading)"}
        line = status_line(dg.AssetCheckEvaluation(asset_key=ITEMS, check_name="row_count", passed=False,
                                                    severity=evaluation.severity, metadata=evaluation.metadata,
                                                    description=evaluation.description))
        assert line.startswith("SKIP  clickhouse/public/items  row_count  not compared: the table is being loaded")
        status = TableStatus("clickhouse", "public.items", "clickhouse/public/items", "running in abc",
                             serving_run="abc", checks={"row_count": "not compared (loading)", "schema_parity": "passed"})
        assert problems(status, 300.0, 0.0) == []
