import textwrap

import pytest

from siphon_core.config import ConfigError, load_config, parse_config

VALID = {
    "application_identifier": "dev.main.1",
    "source": {"dsn": "postgresql://siphon@127.0.0.1:5432/app"},
    "tables": [{"name": "public.notes", "exclude_columns": ["note_html"]}, {"name": "public.issues"}],
    "targets": {"clickhouse": {"url": "http://127.0.0.1:8123"}},
}


def test_the_documented_example_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("SNOWFLAKE_ACCOUNT", "acme")
    monkeypatch.setenv("SNOWFLAKE_USER", "loader")
    monkeypatch.setenv("SNOWFLAKE_PASSWORD", "s3cret")
    path = tmp_path / "siphon.yaml"
    path.write_text(textwrap.dedent("""
        application_identifier: dev.main.1
        source:
          dsn: postgresql://siphon@127.0.0.1:5432/app
          snapshot_dsn: null
        queue:
          url: nats://127.0.0.1:4222
        producer:
          flush_interval_seconds: 3
          max_package_events: 10000
          max_package_bytes: 800000
          metrics_port: 9187
        tables:
          - name: public.notes
            exclude_columns: [note_html]
            blocks_per_partition: 8192
          - name: public.issues
            targets: [clickhouse]
        targets:
          clickhouse:
            url: http://127.0.0.1:8123
            database: siphon
          snowflake:
            account: ${SNOWFLAKE_ACCOUNT}
            user: ${SNOWFLAKE_USER}
            password: ${SNOWFLAKE_PASSWORD}
            database: SIPHON
            schema: PUBLIC
    """))
    config = load_config(path)
    assert config.application_identifier == "dev.main.1"
    assert config.table("public.notes").exclude_columns == ["note_html"]
    assert config.table("public.issues").blocks_per_partition == 8192
    assert config.table("public.issues").targets == ["clickhouse"] and config.table("public.notes").targets is None
    assert config.targets.snowflake.password == "s3cret"
    assert config.targets.snowflake.schema_ == "PUBLIC"
    assert config.targets.configured() == ["clickhouse", "snowflake"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"application_identifier": "dev main"}, "application_identifier: Value error, 'dev main' may contain only"),
        ({"application_identifier": "dev.main.1\n"}, "application_identifier: Value error, 'dev.main.1\n' may contain"),
        ({"tables": [{"name": "notes"}]}, "tables[0] (notes).name: Value error, 'notes' must be schema-qualified"),
        ({"tables": [{"name": "public.a"}, {"name": "public.b", "blocks_per_partition": 0}]},
         "tables[1] (public.b).blocks_per_partition: Input should be greater than or equal to 1"),
        ({"tables": [{"name": "public.a", "on_error": "ignore"}]}, "tables[0] (public.a).on_error"),
        ({"source": {}}, "source.dsn: Field required"),
        ({"tables": [{"name": "public.a"}, {"name": "public.a"}]}, "'public.a' is listed twice"),
        ({"tables": [{"name": "public.a", "on_eror": "stop"}]},
         "tables[0] (public.a).on_eror: unknown key (misspelt, or not a setting of this section)"),
        ({"streaming": {"batch_max_mesages": 10}}, "streaming.batch_max_mesages: unknown key"),
        ({"snapshots": {"max_attempts": 0}}, "snapshots.max_attempts: Input should be greater than or equal to 1"),
        ({"snapshots": {"tables_per_load_run": 0}},
         "snapshots.tables_per_load_run: Input should be greater than or equal to 1"),
        ({"snapshots": {"autoload": False}}, "snapshots.autoload: unknown key"),
        ({"tables": [{"name": "public.a", "targets": ["clickhous"]}]},
         "tables[0] (public.a).targets: Value error, ['clickhous'] are not targets"),
        ({"tables": [{"name": "public.a", "targets": ["snowflake"]}]},
         "tables: 'public.a' names target(s) ['snowflake'], which are not configured under targets:"),
        ({"targets": {"snowflake": {"account": "a", "user": "u", "stage_min_rows": -1}}},
         "targets.snowflake.stage_min_rows: Input should be greater than or equal to 0"),
        ({"streaming": {"apply_threads": 0}}, "streaming.apply_threads: Input should be greater than or equal to 1"),
        ({"queue": {"max_consumers": 2}, "tables": [{"name": "public.a"}, {"name": "public.b"}, {"name": "public.c"}]},
         "queue.max_consumers: 2 is below the 3 consumers the tables need (one per table and target)"),
    ],
)
def test_errors_name_the_file_the_table_and_the_key(change, expected):
    with pytest.raises(ConfigError) as error:
        parse_config({**VALID, **change}, "app.yaml")
    assert str(error.value).startswith("app.yaml: ")
    assert expected in str(error.value)


def test_a_missing_environment_variable_is_named(monkeypatch):
    monkeypatch.delenv("NOPE_PASSWORD", raising=False)
    raw = {**VALID, "targets": {"snowflake": {"account": "a", "user": "u", "password": "${NOPE_PASSWORD}"}}}
    with pytest.raises(ConfigError, match=r"app.yaml.targets.snowflake.password: environment variable NOPE_PASSWORD"):
        parse_config(raw, "app.yaml")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="configuration file not found"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tables: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_a_runs_apply_threads_are_the_targets_own_unless_set():
    # ClickHouse inserts cost the server CPU, Snowflake statements wait on the warehouse.
    default = parse_config(VALID).streaming
    assert (default.apply_threads_for("clickhouse"), default.apply_threads_for("snowflake")) == (8, 16)
    chosen = parse_config({**VALID, "streaming": {"apply_threads": 24}}).streaming
    assert (chosen.apply_threads_for("clickhouse"), chosen.apply_threads_for("snowflake")) == (24, 24)


@pytest.mark.parametrize(("first", "second", "shared", "roles"), [
    ("public.orders", "public.orders__resync", "public__orders__resync", "the resync table of 'public.orders'"),
    ("public.prices", "public.prices_current", "public__prices_current", "the current view of 'public.prices'"),
    ("a__b.c", "a.b__c", "a__b__c", "the table of 'a__b.c'"),
])
def test_two_tables_whose_target_objects_would_share_a_name_are_refused(first, second, shared, roles):
    with pytest.raises(ConfigError, match=rf"'{second}' and '{first}' would both use {shared} at target clickhouse "
                                          rf"\(the .* of '{second}', {roles}\)"):
        parse_config({**VALID, "tables": [{"name": first}, {"name": second}]})
    # At different targets they do not meet.
    parse_config({**VALID, "targets": {"clickhouse": {"url": "http://127.0.0.1:8123"},
                                      "snowflake": {"account": "a", "user": "u"}},
                  "tables": [{"name": first, "targets": ["clickhouse"]}, {"name": second, "targets": ["snowflake"]}]})
