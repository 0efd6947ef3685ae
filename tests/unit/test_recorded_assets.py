"""`RecordedAssets` and `LatestChecks`: what is recorded of the target assets and their checks'
latest results, read a chunk of tables at a time from a real (SQLite) Dagster instance."""

import dagster as dg

from siphon_dagster.snapshot_sensor import LatestChecks, RecordedAssets, materialized_assets, was_at_target
from tests.helpers.instance import instance_for_test


def test_each_asset_is_answered_from_its_chunk_read_as_the_tick_reaches_it() -> None:
    keys = [dg.AssetKey(["clickhouse", "public", f"t{i}"]) for i in range(RecordedAssets.CHUNK * 2 + 5)]
    with instance_for_test() as instance:
        instance.report_runless_asset_event(dg.AssetObservation(asset_key=keys[1]))
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=keys[RecordedAssets.CHUNK + 3]))
        recorded = RecordedAssets(instance, keys)
        assert recorded(keys[0]) is False and recorded(keys[1]) is True
        # Recorded after the first chunk was read: that chunk keeps its answer, a later one sees it.
        instance.report_runless_asset_event(dg.AssetObservation(asset_key=keys[2]))
        instance.report_runless_asset_event(dg.AssetObservation(asset_key=keys[-1]))
        assert recorded(keys[2]) is False
        assert recorded(keys[RecordedAssets.CHUNK + 3]) is True and recorded(keys[RecordedAssets.CHUNK]) is False
        assert recorded(keys[-1]) is True
        # A key the tick did not list is read on its own.
        assert recorded(dg.AssetKey(["snowflake", "public", "t1"])) is False
        assert [recorded(key) for key in keys].count(True) == 3


def test_each_assets_checks_are_answered_by_name_from_its_chunk() -> None:
    keys = [dg.AssetKey(["clickhouse", "public", f"t{i}"]) for i in range(LatestChecks.CHUNK + 3)]
    check_keys = {key: [dg.AssetCheckKey(key, "schema_parity"), dg.AssetCheckKey(key, "row_count")] for key in keys}
    check_keys[keys[4]] = []  # a table without checks
    last = keys[LatestChecks.CHUNK + 1]

    def evaluate(key: dg.AssetKey, name: str, passed: bool) -> None:
        instance.report_runless_asset_event(dg.AssetCheckEvaluation(
            asset_key=key, check_name=name, passed=passed, severity=dg.AssetCheckSeverity.WARN))

    with instance_for_test() as instance:
        evaluate(keys[0], "row_count", True)
        evaluate(keys[0], "row_count", False)  # the latest counts
        evaluate(keys[1], "schema_parity", True)
        evaluate(last, "schema_parity", False)
        latest = LatestChecks(instance, keys, check_keys)
        assert latest(keys[0]) == {"schema_parity": "never run", "row_count": "failed (warn)"}
        assert latest(keys[1]) == {"schema_parity": "passed", "row_count": "never run"}
        assert latest(keys[4]) == {}
        # Evaluated after the first chunk was read: that chunk keeps its answer, the next sees it.
        evaluate(keys[2], "row_count", True)
        evaluate(last, "row_count", True)
        assert latest(keys[2])["row_count"] == "never run"
        assert latest(last) == {"schema_parity": "failed (warn)", "row_count": "passed"}
        # An asset the tick did not list is read on its own, with the checks it is given.
        other = dg.AssetKey(["snowflake", "public", "t0"])
        assert LatestChecks(instance, [], {other: [dg.AssetCheckKey(other, "row_count")]})(other) == \
            {"row_count": "never run"}


def test_materialized_assets_answers_as_was_at_target_does_for_each() -> None:
    keys = [dg.AssetKey(["clickhouse", "public", f"t{i}"]) for i in range(6)]
    with instance_for_test() as instance:
        instance.report_runless_asset_event(dg.AssetObservation(asset_key=keys[0]))  # observed, never materialized
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=keys[1]))
        instance.report_runless_asset_event(dg.AssetObservation(asset_key=keys[2]))
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=keys[2], partition="p"))
        found = materialized_assets(instance, keys)
        assert found == {keys[1], keys[2]}
        assert found == {key for key in keys if was_at_target(instance, key)}
