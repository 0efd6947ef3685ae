"""`RecordedAssets`: which target assets have anything recorded, read a chunk of tables at a time
from a real (SQLite) Dagster instance."""

import dagster as dg

from siphon_dagster.snapshot_sensor import RecordedAssets


def test_each_asset_is_answered_from_its_chunk_read_as_the_tick_reaches_it() -> None:
    keys = [dg.AssetKey(["clickhouse", "public", f"t{i}"]) for i in range(RecordedAssets.CHUNK * 2 + 5)]
    with dg.instance_for_test() as instance:
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
