"""The code location loads for awkward identifiers, and names its assets, jobs and groups as documented."""

import json

import dagster as dg
import pytest

from siphon_core.config import parse_config
from siphon_dagster.definitions import build_definitions

AWKWARD_TABLES = [
    {"name": 'public.we"ird'},
    {"name": "public.with space"},
    {"name": "Sales.OrderLines"},
    {"name": "public.ünïcødé"},
    {"name": "public.select"},
    {"name": "audit.events", "blocks_per_partition": 128},
]


def config(tables=AWKWARD_TABLES, snowflake=True, snapshots=None):
    targets = {"clickhouse": {"url": "http://127.0.0.1:8123"}}
    if snowflake:
        targets["snowflake"] = {"account": "a", "user": "u", "password": "p"}
    return parse_config({
        "application_identifier": "dev.main-1",
        "source": {"dsn": "postgresql://siphon@127.0.0.1:5432/app"},
        "tables": tables,
        "targets": targets,
        **({"snapshots": snapshots} if snapshots else {}),
    })


def test_definitions_load_for_awkward_identifiers():
    defs = build_definitions(config())
    graph = defs.resolve_asset_graph()
    keys = {key.to_user_string() for key in graph.get_all_asset_keys()}
    for table in AWKWARD_TABLES:
        schema, _, name = table["name"].partition(".")
        for system in ("postgres", "clickhouse", "snowflake"):
            assert dg.AssetKey([system, schema, name]).to_user_string() in keys
    node = graph.get(dg.AssetKey(["clickhouse", "Sales", "OrderLines"]))
    assert node.group_name == "siphon_dev_main_1"
    assert dg.AssetKey(["postgres", "Sales", "OrderLines"]) in node.parent_keys
    assert node.partitions_def is not None


def test_targets_follow_the_configuration():
    defs = build_definitions(config(tables=[{"name": "public.notes"}], snowflake=False))
    keys = {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()}
    # Besides each table's assets, the target's shared load runs (`snapshots.tables_per_load_run`).
    assert keys == {"postgres/public/notes", "clickhouse/public/notes", "siphon_loads/clickhouse"}
    alone = build_definitions(config(tables=[{"name": "public.notes"}], snowflake=False,
                                     snapshots={"tables_per_load_run": 1}))
    assert {key.to_user_string() for key in alone.resolve_asset_graph().get_all_asset_keys()} == \
        {"postgres/public/notes", "clickhouse/public/notes"}


def test_streaming_jobs_and_sensors_are_named_as_documented():
    defs = build_definitions(config())
    jobs = {job.name for job in defs.resolve_all_job_defs()}
    assert {"stream_clickhouse_audit__events", "stream_snowflake_audit__events", "stream_clickhouse_select",
            "stream_clickhouse_Sales__OrderLines", "stream_snowflake_with_space"} <= jobs
    sensors = {sensor.name for sensor in defs.sensors}
    assert sensors == {"siphon_dev_main_1_partitions", "siphon_dev_main_1_streaming", "siphon_dev_main_1_slot_gaps",
                       "siphon_dev_main_1_snapshots"}


def test_tables_that_collapse_to_one_job_name_are_refused():
    with pytest.raises(ValueError, match="would share the job names stream_<target>_a_b"):
        build_definitions(config(tables=[{"name": "public.a.b"}, {"name": "public.a_b"}]))


def test_a_missing_configuration_is_explained(monkeypatch):
    from siphon_core.config import ConfigError
    from siphon_dagster.definitions import load_definitions

    monkeypatch.delenv("SIPHON_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="SIPHON_CONFIG is not set"):
        load_definitions()


def test_each_target_has_a_snapshot_pool_of_its_own():
    defs = build_definitions(config(tables=[{"name": "public.notes"}]))
    pools = {target: defs.resolve_assets_def(dg.AssetKey([target, "public", "notes"])).op.pool
             for target in ("clickhouse", "snowflake")}
    assert pools == {"clickhouse": "siphon_snapshot_clickhouse", "snowflake": "siphon_snapshot_snowflake"}


def test_a_table_goes_to_the_targets_it_names():
    defs = build_definitions(config(tables=[{"name": "public.notes"}, {"name": "public.events", "targets": ["snowflake"]}]))
    keys = {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {"postgres/public/notes", "clickhouse/public/notes", "snowflake/public/notes",
                    "postgres/public/events", "snowflake/public/events", "siphon_loads/clickhouse",
                    "siphon_loads/snowflake"}
    jobs = {job.name for job in defs.resolve_all_job_defs() if job.name.startswith("stream_")}
    assert jobs == {"stream_clickhouse_notes", "stream_snowflake_notes", "stream_snowflake_events",
                    "stream_clickhouse", "stream_snowflake"}
    groups = {job.name: json.loads(job.tags["siphon/stream-tables"]) for job in defs.resolve_all_job_defs()
              if "siphon/stream-group" in job.tags}
    assert groups == {"stream_clickhouse": ["public.notes"], "stream_snowflake": ["public.events", "public.notes"]}


def test_secrets_travel_as_references_and_never_reach_the_job_snapshots(monkeypatch) -> None:
    from dagster._serdes import serialize_value

    from siphon_core.config import parse_config
    from siphon_dagster.definitions import build_definitions, build_resources

    secret = "Qx9-canary-secret-value"
    monkeypatch.setenv("SF_PW", secret)
    monkeypatch.setenv("PG_PW", secret)
    monkeypatch.setenv("CH_PW", secret)
    config = parse_config({
        "application_identifier": "canary",
        "source": {"dsn": "postgresql://siphon:${PG_PW}@127.0.0.1:5432/app"},
        "queue": {"url": "nats://u:${CH_PW}@127.0.0.1:4222"},
        "tables": [{"name": "public.notes"}],
        "targets": {"clickhouse": {"url": "http://127.0.0.1:8123", "password": "${CH_PW}"},
                    "snowflake": {"account": "a", "user": "u", "password": "${SF_PW}"}},
    })
    assert config.targets.snowflake.password == secret  # the process that loaded it has the value
    resources = build_resources(config)
    assert resources["snowflake_target"].settings["password"] == "${SF_PW}"
    assert resources["source"].settings["dsn"] == "postgresql://siphon:${PG_PW}@127.0.0.1:5432/app"
    assert resources["source"].dsn.endswith(f":{secret}@127.0.0.1:5432/app")  # expanded where it is used
    assert resources["snowflake_target"].settings["database"] == "SIPHON"  # defaults come from the model
    defs = build_definitions(config)
    for job in defs.resolve_all_job_defs():
        snapshot = serialize_value(job.get_job_snapshot())
        assert secret not in snapshot, job.name
    assert secret not in json.dumps([r.settings for r in resources.values()])


def test_config_drift_names_added_and_removed_tables_and_quiets_once_the_file_is_back(tmp_path):
    import yaml

    from siphon_core.config import load_config
    from siphon_dagster.config_drift import ConfigDrift

    path = tmp_path / "siphon.yaml"
    raw = {"application_identifier": "app.one", "source": {"dsn": "postgresql://u@127.0.0.1:5432/db"},
           "queue": {"url": "nats://127.0.0.1:4222"}, "tables": [{"name": "public.a"}, {"name": "public.b"}],
           "targets": {"clickhouse": {"url": "http://127.0.0.1:8123"}}}
    path.write_text(yaml.safe_dump(raw))
    drift = ConfigDrift(path, load_config(path))
    assert drift.message() is None and drift.what_changed() is None

    path.write_text(yaml.safe_dump({**raw, "tables": [{"name": "public.a"}, {"name": "public.c"}]}))
    message = drift.message()
    assert message is not None and "tables added: public.c" in message and "tables removed: public.b" in message
    assert drift.what_changed() == "tables added: public.c; tables removed: public.b"  # a reload would serve it

    path.write_text(yaml.safe_dump({**raw, "tables": [{"name": "public.a"}, {"name": "public.b", "on_error": "retry"}]}))
    assert "table, group or target settings changed" in drift.message()

    path.write_text("tables: [\n")
    assert "does not load" in drift.message()
    assert drift.what_changed() is None  # a reload would fail: none is asked for

    path.write_text(yaml.safe_dump(raw) + "\n")  # the same content again, another size
    assert drift.message() is None


def test_resources_and_executor_take_no_run_configuration_and_stay_out_of_every_job_snapshot() -> None:
    from dagster._serdes import serialize_value

    from siphon_dagster.resources import ClickHouseResource

    defs = build_definitions(config(tables=[{"name": "public.notes"}]))
    job = defs.resolve_job_def("stream_clickhouse_notes")
    snapshot = serialize_value(job.get_job_snapshot())
    # The settings would travel as each resource's default run configuration, in every job.
    assert "127.0.0.1:8123" not in snapshot and "settings" not in snapshot
    assert "marker_to_close" not in snapshot  # the executor's settings are fixed too
    resources = job.run_config_schema.config_type.fields["resources"].config_type.fields
    assert set(resources) >= {"clickhouse_target", "queue", "source", "spark"}
    assert not any(field.is_required for field in resources.values())
    # What the ops are given is still the resource built from siphon.yaml.
    with dg.build_resources({"clickhouse_target": defs.resources["clickhouse_target"]}) as built:
        assert isinstance(built.clickhouse_target, ClickHouseResource)
        assert built.clickhouse_target.settings["url"] == "http://127.0.0.1:8123"


def test_the_code_location_finds_each_single_table_job_by_name_and_lists_none() -> None:
    from dagster._core.remote_representation.external_data import RepositorySnap

    from siphon_dagster.definitions import build_code_location

    tables = [{"name": "public.notes"}, {"name": "Sales.OrderLines"}]
    location = build_code_location(config(tables=tables))
    full = {job.name for job in build_definitions(config(tables=tables)).resolve_all_job_defs()}
    single = {"stream_clickhouse_notes", "stream_snowflake_notes", "stream_clickhouse_Sales__OrderLines",
              "stream_snowflake_Sales__OrderLines", "resync_notes", "resync_Sales__OrderLines"}
    listed = {job.name for job in location.get_all_jobs()}
    # What the UI and the daemon's snapshots hold: every job but the single-table ones.
    assert listed == full - single and single <= full
    assert listed == {"__ASSET_JOB", "stream_clickhouse", "stream_snowflake", "siphon_dev_main_1_resync",
                      "siphon_dev_main_1_checks_job"}
    snapshot = RepositorySnap.from_def(location, defer_snapshots=True)
    assert {ref.name for ref in snapshot.get_job_refs()} == listed
    # What `dagster job execute -j stream_<target>_<table>` looks up: the name, then the job.
    assert single <= set(location.job_names) and all(location.has_job(name) for name in single)
    job = location.get_job("stream_snowflake_Sales__OrderLines")
    assert job is location.get_job("stream_snowflake_Sales__OrderLines")  # built once
    assert [node.name for node in job.nodes] == ["apply_snowflake_Sales__OrderLines"]
    assert set(job.resource_defs) >= {"snowflake_target", "queue", "source", "spark"}
    assert job.executor_def.name == "in_process"
    # `dagster job execute -j resync_<table>`: the table's own resync job, which ends with its checks.
    resync = location.get_job("resync_Sales__OrderLines")
    assert [node.name for node in resync.nodes] == ["rebuild_Sales__OrderLines"]
    assert resync.tags["siphon/resync"] == "Sales.OrderLines"
    assert set(resync.resource_defs) >= {"clickhouse_target", "snowflake_target", "source"}
    assert not location.has_job("stream_clickhouse_nope")
    with pytest.raises(Exception, match="stream_clickhouse_nope"):
        location.get_job("stream_clickhouse_nope")
    # The rest is the definitions' own: the repository's name keys the sensors' state in Dagster.
    assert location.name == build_definitions(config(tables=tables)).get_repository_def().name
    assert {sensor.name for sensor in location.sensor_defs} == {
        "siphon_dev_main_1_partitions", "siphon_dev_main_1_streaming", "siphon_dev_main_1_slot_gaps",
        "siphon_dev_main_1_snapshots"}
    assert dg.AssetKey(["clickhouse", "Sales", "OrderLines"]) in location.assets_defs_by_key


def test_a_runs_worker_gets_its_stream_job_without_the_listing_and_the_same_job_as_listed(monkeypatch) -> None:
    import siphon_dagster.definitions as definitions

    listings = []

    def counted(*args, **kwargs):
        listings.append(args)
        return build_definitions(*args, **kwargs)

    monkeypatch.setattr(definitions, "build_definitions", counted)
    tables = [{"name": "public.notes"}, {"name": "Sales.OrderLines"}]
    location = definitions.build_code_location(config(tables=tables))
    # What a run's worker asks for: its group's job, or one table's by name.
    group_job = location.get_maybe_subset_job_def("stream_clickhouse")
    table_job = location.get_job("stream_snowflake_notes")
    assert location.has_job("stream_snowflake") and location.name == "__repository__"
    assert listings == []  # no table's assets, checks or resync job were built for them
    assert [node.name for node in group_job.nodes] == ["apply_clickhouse"]
    assert set(group_job.resource_defs) >= {"clickhouse_target", "queue", "source", "spark"}
    assert table_job.executor_def.name == "in_process"
    # The listing, built on the first need of it, holds the same job, and hands out its own after.
    listed = {job.name: job for job in location.get_all_jobs()}
    assert len(listings) == 1
    assert listed["stream_clickhouse"].get_job_snapshot_id() == group_job.get_job_snapshot_id()
    assert location.get_job("stream_clickhouse") is listed["stream_clickhouse"]
    assert "stream_snowflake_notes" not in listed and location.get_job("stream_snowflake_notes") is table_job
    assert location.sensor_defs and location.assets_defs_by_key
    assert len(listings) == 1


def test_a_stream_job_named_as_listed_that_the_listing_lacks_is_refused() -> None:
    from siphon_dagster.code_location import with_jobs_by_name

    listing = build_definitions(config(tables=[{"name": "public.notes"}]))
    location = with_jobs_by_name(lambda: listing, {"stream_nowhere": lambda: listing.resolve_job_def("stream_clickhouse")})
    with pytest.raises(ValueError, match="stream_nowhere"):
        location.get_all_jobs()
    clash = with_jobs_by_name(lambda: listing, {"stream_clickhouse": lambda: listing.resolve_job_def("stream_clickhouse")},
                              unlisted=["stream_clickhouse"])
    with pytest.raises(ValueError, match="both listed and built by name: \\['stream_clickhouse'\\]"):
        clash.get_all_jobs()
