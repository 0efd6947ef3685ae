"""`siphon-dagster`'s commands against real services."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from siphon_dagster import cli
from siphon_dagster.snapshot_sensor import DROPPED_METADATA
from siphon_dagster.targets.base import SourceColumn, TableSchema
from tests.helpers.application import Application
from tests.helpers.processes import alive
from tests.helpers.producer import execute, wait_until
from tests.integration.test_targets_version_rule import make_target, target_settings

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target_name", ["clickhouse", "snowflake"])
def test_target_drop_removes_the_table_and_its_view_and_nothing_else(
        request: pytest.FixtureRequest, tmp_path: Path, unique_name: str, target_name: str,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # the drop is recorded on this instance
    target = make_target(request, target_name, unique_name)
    columns = (SourceColumn("id", 23, "integer", -1, False, True, "N"), SourceColumn("body", 25, "text", -1, True, False, "S"))
    dropped, kept = TableSchema("public", "dropped", columns), TableSchema("public", "kept", columns)
    config = tmp_path / "siphon.yaml"
    try:
        for table in (dropped, kept):
            target.ensure_table(table)
        config.write_text(yaml.safe_dump({
            "application_identifier": unique_name, "source": {"dsn": "postgresql://unused@127.0.0.1/unused"},
            "tables": [{"name": "public.dropped"}, {"name": "public.kept"}],
            "targets": {target_name: target_settings(request, target_name, unique_name)},
        }))

        assert cli.main(["--config", str(config), "target", "drop", "--target", target_name,
                         "--table", "public.dropped"]) == 0

        assert f"the snapshot sensor loads every partition of asset {target_name}/public/dropped again" \
            in capsys.readouterr().out
        with dg.DagsterInstance.get() as instance:
            [drop] = instance.fetch_observations(dg.AssetKey([target_name, "public", "dropped"]), limit=5).records
            assert drop.asset_observation.metadata[DROPPED_METADATA].value is True
        assert target.describe_columns(dropped) == []
        assert [c.name for c in target.describe_columns(kept)][:2] == ["id", "body"]
        assert cli.main(["--config", str(config), "target", "drop", "--target", "elsewhere",
                         "--table", "public.dropped"]) == 2
        assert "public.dropped is not replicated to target elsewhere" in capsys.readouterr().err
    finally:
        target.close()



def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def test_a_snapshot_ends_with_its_cli_process_when_that_is_killed(
        request: pytest.FixtureRequest, app: Application, tmp_path: Path) -> None:
    """kill -9 of `dagster asset materialize` must leave nothing reading behind it (a step in a
    process of its own would go on beside the snapshot that gets the run's pool slot next): steps run
    in the run's own process, and the range's temporary slot goes with its connection."""
    app.sql("create table {schema}.slow (id integer primary key, body text)")
    app.sql("insert into {schema}.slow select g, repeat(md5(g::text), 4) from generate_series(1, 200000) g")
    config = tmp_path / "siphon.yaml"
    config.write_text(yaml.safe_dump({
        "application_identifier": app.identifier, "source": {"dsn": app.dsn}, "queue": {"url": app.nats_url},
        "tables": [{"name": app.qualified("slow"), "blocks_per_partition": 1 << 20}],
        # The local Snowflake takes minutes for these rows: the step is mid-load when its parent dies.
        "targets": {"snowflake": target_settings(request, "snowflake", app.identifier)},
    }))
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPOSITORY / "dagster.yaml").read_text())
    env = {**os.environ, "SIPHON_CONFIG": str(config), "DAGSTER_HOME": str(home)}
    env.pop("DAGSTER_MODULE_NAME", None)
    bin_dir = Path(sys.executable).parent
    subprocess.run([str(bin_dir / "siphon-dagster"), "partitions", "refresh"], env=env, check=True,
                   capture_output=True, cwd=REPOSITORY)
    log = (tmp_path / "materialize.log").open("w")
    materialize = subprocess.Popen(
        [str(bin_dir / "dagster"), "asset", "materialize", "-m", "siphon_dagster", "--select",
         f"snowflake/{app.schema}/slow", "--partition", f"00000000-{(1 << 20) - 1:08d}"],
        env=env, cwd=REPOSITORY, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output = tmp_path / "materialize.log"
        wait_until(lambda: "reading blocks" in output.read_text() or materialize.poll() is not None, 120,
                   "the snapshot under way")
        assert materialize.poll() is None, output.read_text()[-3000:]
        children = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _children(materialize.pid)}
        assert not [pid for pid, line in children.items() if b"multiprocessing-fork" in line], children

        os.kill(materialize.pid, signal.SIGKILL)
        materialize.wait()

        wait_until(lambda: not any(alive(child) for child in children), 30, "the run's helpers to end")
        wait_until(lambda: not execute(app.dsn, "select 1 from pg_replication_slots "
                                                "where slot_name like 'siphon_snap_%%'"), 30, "the range's slot to go")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(materialize.pid, signal.SIGKILL)
        log.close()


def test_partitions_refresh_answers_a_bad_table_or_an_unreachable_source_in_one_line(
        tmp_path: Path, postgres_dsn: str, unique_name: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    execute(postgres_dsn, f'create table "{unique_name}_nokey" (id int, body text)')

    def refresh(dsn: str, table: str) -> tuple[int, str]:
        config = tmp_path / "siphon.yaml"
        config.write_text(yaml.safe_dump({
            "application_identifier": unique_name, "source": {"dsn": dsn}, "tables": [{"name": table}],
            "targets": {"clickhouse": {"url": "http://127.0.0.1:1"}}}))
        code = cli.main(["--config", str(config), "partitions", "refresh"])
        return code, capsys.readouterr().err

    code, err = refresh(postgres_dsn, f"public.{unique_name}_missing")
    assert code == 2 and err.count("\n") == 1 and "not found in the source database" in err
    code, err = refresh(postgres_dsn, f"public.{unique_name}_nokey")
    assert code == 2 and err.count("\n") == 1 and "has no primary key" in err
    with dg.DagsterInstance.get() as instance:
        from siphon_dagster.partitions import partitions_def_name
        assert instance.get_dynamic_partitions(partitions_def_name(unique_name, "public", f"{unique_name}_nokey")) == []
    code, err = refresh("postgresql://siphon:Secret-canary-9@127.0.0.1:1/app", f"public.{unique_name}_nokey")
    assert code == 1 and err.count("\n") == 1 and "cannot reach the source at host=127.0.0.1 port=1" in err
    assert "Secret-canary-9" not in err and "Traceback" not in err
