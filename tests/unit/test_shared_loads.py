"""New small tables made into shared load runs: the chunks per target and what each table's entry keeps."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg

from siphon_core.config import parse_config
from siphon_dagster.assets import first_loads_key
from siphon_dagster.shared_loads import BATCHED_KEY, FIRST_LOADS_TAG, SharedLoads
from siphon_dagster.snapshot_sensor import SENSOR_LOAD_TAG
from siphon_dagster.specs import table_specs

CONFIG = parse_config({
    "application_identifier": "shop",
    "source": {"dsn": "postgresql://siphon@127.0.0.1:5432/app"},
    "tables": [{"name": f"public.t{i}"} for i in range(5)] + [{"name": "audit.Odd Name", "targets": ["clickhouse"]}],
    "targets": {"clickhouse": {"url": "http://127.0.0.1:8123"}, "snowflake": {"account": "a", "user": "u"}},
})


def _own_request(spec, target):
    return dg.RunRequest(run_key=f"{target}:{spec.qualified_name}", asset_selection=[spec.target_key(target)],
                         partition_key="00000000-00008191")


def _shared(tables_per_run, targets=("clickhouse", "snowflake")):
    shared = SharedLoads(tables_per_run, now=100.0)
    for spec in table_specs(CONFIG):
        for target in spec.targets:
            if target in targets:
                shared.add(spec, target, f"{target}:{spec.qualified_name}", _own_request(spec, target))
    cursor = {f"{target}:{spec.qualified_name}": {"load": {"at": 100.0}} for spec in table_specs(CONFIG)
              for target in spec.targets}
    lines: list[str] = []
    return shared, shared.requests(cursor, {"siphon/application": "shop"}, lines.append), cursor, lines


def test_tables_go_per_target_that_many_to_a_run_and_one_left_alone_keeps_its_own_run():
    _, requests, cursor, lines = _shared(4)
    clickhouse = [r for r in requests if r.asset_selection[0] in (first_loads_key("clickhouse"),)]
    snowflake = [r for r in requests if r.asset_selection[0] == first_loads_key("snowflake")]
    alone = [r for r in requests if r.partition_key is not None]
    # clickhouse: 6 tables, 4 + 2; snowflake: 5 tables, 4 + 1 left alone with its own run.
    assert [len(_config(r)["tables"]) for r in clickhouse] == [4, 2]
    assert [len(_config(r)["tables"]) for r in snowflake] == [4]
    assert [r.run_key for r in alone] == ["snowflake:public.t4"]
    assert "audit.Odd Name" in _config(clickhouse[1])["tables"]
    for request in clickhouse + snowflake:
        config = _config(request)
        assert config["partitions"] == ["00000000-00008191"] * len(config["tables"])
        assert request.tags["siphon/application"] == "shop" and request.asset_check_keys == []
        for table in config["tables"]:
            target = request.asset_selection[0].path[-1]
            entry = cursor[f"{target}:{table}"]
            assert entry["load"] == {"at": 100.0}, "the entry keeps what the tick put there"
            assert entry[BATCHED_KEY] == {"id": request.tags[FIRST_LOADS_TAG], "key": "00000000-00008191", "at": 100.0}
    assert BATCHED_KEY not in cursor["snowflake:public.t4"]
    assert len({r.run_key for r in requests}) == len(requests)
    assert len(lines) == 3 and all("new tables load in one run" in line for line in lines)


def test_one_table_a_run_is_every_table_on_its_own():
    shared, requests, cursor, _ = _shared(1)
    assert not shared.enabled
    assert all(r.partition_key is not None for r in requests) and len(requests) == 11
    assert not any(BATCHED_KEY in entry for entry in cursor.values())
    assert shared.targets == set()


def _config(request):
    return request.run_config["ops"][first_loads_key(request.asset_selection[0].path[-1]).to_python_identifier()]["config"]


def test_the_projects_instance_caps_the_sensors_load_runs_by_the_tag_it_puts_on_them(tmp_path):
    shutil.copy(Path(__file__).resolve().parents[2] / "dagster.yaml", tmp_path / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
    assert [limit["key"] for limit in limits] == [SENSOR_LOAD_TAG]
    assert limits[0]["limit"] >= 2  # at least one run per target of two at once
