"""`siphon-dagster snapshot` and `repair` for a table whose name `--select` cannot spell, against real
PostgreSQL and ClickHouse, with runs recorded by a Dagster instance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from siphon_core import naming
from siphon_core.config import load_config
from siphon_dagster import cli, runs
from siphon_dagster.repair import RepairError, repair_keys
from siphon_dagster.targets import build_target
from siphon_dagster.targets.base import TableSchema
from tests.helpers.application import Application
from tests.helpers.instance import write_instance_yaml
from tests.integration.test_targets_version_rule import target_settings

ODD = 'we"ird t.able'
REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture
def odd_table(request: pytest.FixtureRequest, app: Application, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Path:
    app.sql(f'create table {{schema}}."{ODD.replace(chr(34), chr(34) * 2)}" (id integer primary key, body text)')
    app.sql(f'insert into {{schema}}."{ODD.replace(chr(34), chr(34) * 2)}" '
            "select g, 'body ' || g from generate_series(1, 600) g")
    path = tmp_path / "siphon.yaml"
    path.write_text(yaml.safe_dump({
        "application_identifier": app.identifier,
        "source": {"dsn": app.dsn},
        "queue": {"url": app.nats_url},
        "tables": [{"name": app.qualified(ODD), "blocks_per_partition": 1}],
        "targets": {"clickhouse": target_settings(request, "clickhouse", app.identifier)},
        "streaming": {"shadow_lookup_seconds": 1},
    }))
    home = tmp_path / "dagster_home"
    home.mkdir()
    write_instance_yaml(home)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return path


def _dagster_job_execute(config_path: Path, job_name: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    """`dagster job execute -m siphon_dagster -j <job>`, Dagster's own CLI as an operator runs it, with
    the repository's dagster.yaml in DAGSTER_HOME."""
    home = Path(os.environ["DAGSTER_HOME"])
    (home / "dagster.yaml").write_text((REPOSITORY / "dagster.yaml").read_text())
    env = {**os.environ, "SIPHON_CONFIG": str(config_path)}
    env.pop("DAGSTER_MODULE_NAME", None)
    return subprocess.run([str(Path(sys.executable).parent / "dagster"), "job", "execute", "-m", "siphon_dagster",
                           "-j", job_name, *arguments], env=env, cwd=REPOSITORY, capture_output=True, text=True,
                          timeout=600)


def _source_sql(app: Application, statement: str) -> None:
    app.sql(statement.replace("TABLE", f'{{schema}}."{ODD.replace(chr(34), chr(34) * 2)}"'))


def test_snapshot_and_repair_of_a_table_named_with_a_quote_a_space_and_a_dot(
        app: Application, odd_table: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config(odd_table)
    table_name = app.qualified(ODD)
    assert cli.main(["--config", str(odd_table), "snapshot", "--table", table_name]) == 0
    out = capsys.readouterr().out
    assert "done" in out and "FAILED" not in out
    # One run held the table's partitions and read them two at a time (the pool has no limit here).
    instance = dg.DagsterInstance.get()
    (run,) = instance.get_runs()
    messages = [entry.user_message for entry in instance.all_logs(run.run_id)]
    assert any(" partitions 2 at a time" in message for message in messages), messages
    schema = app.table_schema(ODD)
    target = build_target("clickhouse", config)
    try:
        assert target.current_rows_as_text(schema) == app.rows_as_text(schema)

        # Bad input says what is wrong and exits 2.
        for arguments, said in ((["--table", "public.nope"], "its tables are"),
                                (["--table", table_name, "--target", "snowflake"], "its targets are: clickhouse"),
                                (["--table", table_name, "--partitions", "junk"], "not a block range"),
                                (["--table", table_name, "--partitions", "00099999-00099999"], "has no partition"),
                                (["--table", table_name, "--partitions", "00000003-00000003...00000001-00000001"],
                                 "ends before it starts")):
            assert cli.main(["--config", str(odd_table), "snapshot", *arguments]) == 2
            assert said in capsys.readouterr().err

        # Damage: a row lost, a row changed (same version), a row the source never had; and a row
        # deleted at the source that no stream told the target about.
        names = target._names(schema)  # noqa: SLF001 (the test writes to the target's own tables)
        client = target._connect()  # noqa: SLF001
        client.command(f"ALTER TABLE {names.live} DELETE WHERE id = 5", settings={"mutations_sync": 2})
        client.command(f"ALTER TABLE {names.live} UPDATE body = 'tampered' WHERE id = 300",
                       settings={"mutations_sync": 2})
        client.command(f"INSERT INTO {names.live} (id, body, _siphon_version, _siphon_deleted) "
                       "VALUES (100000, 'ghost', 5, 0)")
        _source_sql(app, "delete from TABLE where id = 20")
        assert target.current_rows_as_text(schema) != app.rows_as_text(schema)

        with pytest.raises(RepairError, match=r"key \('1', '2'\) has 2 values; the primary key is \['id'\]"):
            repair_keys(config, runs.find_spec(config, table_name), "clickhouse", [("1", "2")],
                        dg.DagsterInstance.get())

        keys_file = odd_table.parent / "keys.csv"
        keys_file.write_text("5\n300\n100000\n20\n")
        assert cli.main(["--config", str(odd_table), "repair", "--table", table_name, "--keys-file",
                         str(keys_file)]) == 0
        report = capsys.readouterr().out
        assert "4 keys, 2 at the source" in report and "2 tombstoned" in report, report
        assert target.current_rows_as_text(schema) == app.rows_as_text(schema)

        # The tombstone carries the exact version of the absence it read: a later insert wins.
        point = report.split("tombstoned as of ")[1].split()[0]
        version = client.query(f"SELECT toString(max(_siphon_version)) FROM {names.live} WHERE id = 100000"
                               ).result_rows[0][0]
        assert int(version) == naming.row_version(naming.parse_lsn(point), 0)
        _source_sql(app, "insert into TABLE values (100000, 'back')")
        summary = repair_keys(config, runs.find_spec(config, table_name), "clickhouse", [("100000",)],
                              dg.DagsterInstance.get())
        assert summary.found == 1 and summary.success
        assert target.current_rows_as_text(schema) == app.rows_as_text(schema)
        runs_recorded = dg.DagsterInstance.get().get_runs()
        assert len(runs_recorded) >= 3 and all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs_recorded)
    finally:
        target.close()


def test_the_resync_job_runs_from_dagsters_own_cli_for_an_odd_name(
        app: Application, odd_table: Path, tmp_path: Path) -> None:
    """`dagster job execute -j resync_<table>`: the job's name is a word even when the table's is not.
    The job ends by running the table's checks, which need the producer to confirm the source's reads."""
    app.producer([ODD])
    config = load_config(odd_table)
    spec = runs.find_spec(config, app.qualified(ODD))
    done = _dagster_job_execute(odd_table, spec.resync_job_name)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    schema = app.table_schema(ODD)
    target = build_target("clickhouse", config)
    try:
        assert target.current_rows_as_text(schema) == app.rows_as_text(schema)
        assert not target.describe_columns(TableSchema(schema.schema, f"{ODD}__resync", ()))
    finally:
        target.close()
    runs_recorded = dg.DagsterInstance.get().get_runs(dg.RunsFilter(job_name=spec.resync_job_name))
    assert [r.status for r in runs_recorded] == [dg.DagsterRunStatus.SUCCESS]



def test_a_single_table_stream_job_drains_from_dagsters_own_cli(
        app: Application, odd_table: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dagster job execute -j stream_<target>_<table>` with `stop_when_drained`: the code location
    lists no single-table stream job, and finds this one by its name."""
    from siphon_dagster.jobs import stream_op_name

    config = load_config(odd_table)
    table_name = app.qualified(ODD)
    spec = runs.find_spec(config, table_name)
    app.producer([ODD])
    assert cli.main(["--config", str(odd_table), "snapshot", "--table", table_name]) == 0
    capsys.readouterr()
    _source_sql(app, "insert into TABLE select g, 'later ' || g from generate_series(601, 650) g")
    _source_sql(app, "update TABLE set body = body || ' changed' where id <= 10")
    _source_sql(app, "delete from TABLE where id between 20 and 24")
    app.wait_for_events(50 + 10 + 5, ODD)
    drain = tmp_path / "drain.yaml"
    drain.write_text(yaml.safe_dump({"ops": {stream_op_name(spec, "clickhouse"): {"config": {"stop_when_drained": True}}}}))
    job_name = spec.stream_job_name("clickhouse")
    done = _dagster_job_execute(odd_table, job_name, "-c", str(drain))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    schema = app.table_schema(ODD)
    target = build_target("clickhouse", config)
    try:
        assert target.current_rows_as_text(schema) == app.rows_as_text(schema)
        assert target.count_current(schema) == 600 + 50 - 5
    finally:
        target.close()
    runs_recorded = dg.DagsterInstance.get().get_runs(dg.RunsFilter(job_name=job_name))
    assert [r.status for r in runs_recorded] == [dg.DagsterRunStatus.SUCCESS]
    # A name the code location does not have is refused by name, the single-table jobs not listed.
    wrong = _dagster_job_execute(odd_table, job_name + "_nope")
    assert wrong.returncode != 0 and f"{job_name}_nope" in wrong.stderr + wrong.stdout
