"""A range survives a lost source connection; a snapshot that waits for older transactions names them,
and past its limit fails with that report and leaves no slot behind."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import dagster as dg
import psycopg
import pytest
import yaml
from psycopg import sql

from siphon_core.config import TableConfig, load_config, parse_config
from siphon_dagster import source
from siphon_dagster.definitions import build_definitions
from siphon_dagster.partitions import BlockRange
from siphon_dagster.snapshot.blockers import SnapshotWaitLimitError
from siphon_dagster.snapshot.load import (
    SnapshotSettings,
    TableNotPublishedError,
    ensure_target_table,
    is_connection_failure,
    load_ranges,
)
from siphon_dagster.snapshot.reader import (
    SnapshotProgress,
    TableRewrittenError,
    exported_snapshot,
    read_range,
)
from siphon_dagster.specs import table_specs
from siphon_dagster.targets import build_target
from siphon_stack.process import free_port, port_accepts, start_process, stop_pid
from tests.helpers.application import Application
from tests.helpers.instance import instance_for_test
from tests.helpers.producer import execute, wait_until
from tests.integration.test_targets_version_rule import target_settings

WHOLE_TABLE = BlockRange(0, (1 << 20) - 1)


def _no_snapshot_slots(dsn: str) -> bool:
    return not execute(dsn, "select slot_name from pg_replication_slots where slot_name like 'siphon_snap_%%'")


def test_a_range_whose_copy_is_terminated_is_read_again_and_applied_once(
        request: pytest.FixtureRequest, app: Application, tmp_path: Path) -> None:
    app.sql("create table {schema}.wide (id integer primary key, body text)")
    app.sql("insert into {schema}.wide select g, repeat(md5(g::text), 8) from generate_series(1, 300000) g")
    config = load_config(_write_config(tmp_path, app, request, "wide", "clickhouse"))
    destination = build_target("clickhouse", config)
    table = TableConfig(name=app.qualified("wide"))
    terminated: list[int] = []

    def terminate_the_copy() -> None:
        # A real outage of the range's source connection, from another connection: its COPY's
        # backend is ended as the server ends it on an administrator's command.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not terminated:
            rows = execute(app.dsn, "select pid from pg_stat_activity where application_name = 'siphon snapshot' "
                                    "and query like 'COPY%%' and state = 'active'")
            for (pid,) in rows:
                execute(app.dsn, "select pg_terminate_backend(%s)", (pid,))
                terminated.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=terminate_the_copy, daemon=True)
    warnings: list[str] = []
    try:
        killer.start()
        # A spool that runs 64 KiB ahead of the load at most keeps the COPY open while it loads.
        summary = load_ranges(SnapshotSettings(dsn=app.dsn, spool_max_bytes=64 << 10), table, [WHOLE_TABLE],
                              destination, ensure=ensure_target_table(destination, "clickhouse"),
                              on_warning=warnings.append)
        killer.join()
        assert terminated, "the COPY was never seen running"
        assert summary.retries == 1, warnings
        assert any("lost its connection" in w and "nothing of it was applied" in w for w in warnings), warnings
        assert summary.progress.rows == 300000
        assert len(summary.consistent_points) == 1
        schema = app.table_schema("wide")
        assert destination.count_current(schema) == 300000
        # Exactly once: the table holds one version of each row, all from the attempt that finished.
        client = destination._connect()  # noqa: SLF001 (reads the versioned table itself)
        stored = client.query(f"SELECT count(), uniqExact(_siphon_version) FROM `{app.identifier}`."
                              f"`{app.schema}__wide`").result_rows[0]
        assert stored == (300000, 1)
        assert _no_snapshot_slots(app.dsn)
    finally:
        destination.close()


def test_a_range_whose_target_goes_away_is_loaded_again_once_it_is_back(app: Application, tmp_path: Path) -> None:
    """A ClickHouse server of this test's own, killed mid-load and started again on its data."""
    app.sql("create table {schema}.wide (id integer primary key, body text)")
    app.sql("insert into {schema}.wide select g, repeat(md5(g::text), 8) from generate_series(1, 300000) g")
    port, data = free_port(), tmp_path / "clickhouse"

    def start() -> int:
        log = tmp_path / "clickhouse.log"
        process = start_process("siphon-clickhouse", [sys.executable, "-m", "siphon_stack.clickhouse_server",
                                                      "--data-dir", str(data), "--port", str(port)], log)
        wait_until(lambda: port_accepts(port), 90, "the ClickHouse server to listen")
        return process.pid

    pids = [start()]
    config = parse_config({"application_identifier": app.identifier, "source": {"dsn": app.dsn},
                           "tables": [{"name": app.qualified("wide")}],
                           "targets": {"clickhouse": {"url": f"http://127.0.0.1:{port}", "database": "resilience"}}})
    destination = build_target("clickhouse", config)
    outage: list[float] = []

    def kill_and_restart() -> None:
        wait_until(lambda: bool(execute(app.dsn, "select 1 from pg_stat_activity where application_name = "
                                                 "'siphon snapshot' and query like 'COPY%%' and state = 'active'")),
                   60, "the range's COPY")
        stop_pid(pids[0], sig=signal.SIGKILL)
        outage.append(time.monotonic())
        time.sleep(1.0)
        pids.append(start())
        outage.append(time.monotonic())

    restarter = threading.Thread(target=kill_and_restart, daemon=True)
    warnings: list[str] = []
    try:
        restarter.start()
        summary = load_ranges(SnapshotSettings(dsn=app.dsn, spool_max_bytes=64 << 10),
                              TableConfig(name=app.qualified("wide")), [WHOLE_TABLE], destination,
                              ensure=ensure_target_table(destination, "clickhouse"), on_warning=warnings.append)
        restarter.join(120)
        assert len(outage) == 2, "the server was not restarted"
        assert summary.retries >= 1, warnings
        assert summary.progress.rows == 300000
        stored = destination._connect().query(  # noqa: SLF001 (reads the versioned table itself)
            f"SELECT count(), uniqExact(_siphon_version) FROM resilience.`{app.schema}__wide`").result_rows[0]
        assert stored == (300000, 1)
        assert _no_snapshot_slots(app.dsn)
    finally:
        destination.close()
        for pid in pids:
            stop_pid(pid)


def test_connection_failures_are_told_from_other_errors(app: Application) -> None:
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect("postgresql://nobody@127.0.0.1:1/x", connect_timeout=2)
    assert is_connection_failure(refused.value)
    with pytest.raises(psycopg.errors.UndefinedTable) as missing, psycopg.connect(app.dsn) as connection:
        connection.execute("select * from no_such_table_here")
    assert not is_connection_failure(missing.value)


def _write_config(tmp_path: Path, app: Application, request: pytest.FixtureRequest, table: str, target: str,
                  **source: object) -> Path:
    path = tmp_path / "siphon.yaml"
    path.write_text(yaml.safe_dump({
        "application_identifier": app.identifier,
        "source": {"dsn": app.dsn, **source},
        "queue": {"url": app.nats_url},
        "tables": [{"name": app.qualified(table), "blocks_per_partition": 1 << 20}],
        "targets": {target: target_settings(request, target, app.identifier)},
    }))
    return path


def _observed_pids(instance: dg.DagsterInstance, key: dg.AssetKey) -> list[list[int]]:
    records = instance.fetch_observations(key, limit=50).records
    return [record.asset_observation.metadata["snapshot_wait"].value["blocking_pids"]
            for record in records if record.asset_observation and "snapshot_wait" in record.asset_observation.metadata]


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(gone)"


def test_a_snapshot_waiting_for_an_open_transaction_names_it_then_fails_at_its_limit(
        request: pytest.FixtureRequest, app: Application, tmp_path: Path) -> None:
    app.sql("create table {schema}.held (id integer primary key, body text)")
    app.sql("insert into {schema}.held select g, 'b' || g from generate_series(1, 100) g")
    key = WHOLE_TABLE.key
    with psycopg.connect(app.dsn) as blocker:
        # A transaction with a transaction id, open before the snapshot starts: its slot must wait.
        blocker.execute(f'insert into "{app.schema}".held values (1000, %s)', ("open",))
        blocker_pid = blocker.info.backend_pid

        config = load_config(_write_config(tmp_path, app, request, "held", "clickhouse"))
        defs = build_definitions(config)
        spec_key = dg.AssetKey(["clickhouse", app.schema, "held"])
        asset = defs.resolve_assets_def(spec_key)
        with instance_for_test() as instance:
            instance.add_dynamic_partitions(table_specs(config)[0].partitions_def_name, [key])
            results: list[dg.ExecuteInProcessResult] = []
            run = threading.Thread(target=lambda: results.append(
                dg.materialize([asset], partition_key=key, instance=instance, raise_on_error=False)), daemon=True)
            run.start()
            wait_until(lambda: any(blocker_pid in pids for pids in _observed_pids(instance, spec_key)), 30,
                       "a report naming the open transaction")
            assert run.is_alive() and not results
            blocker.commit()  # the wait ends with the transaction
            run.join(60)
            assert not run.is_alive(), f"the run did not end within 60 s; its thread is at:\n{_stack_of(run)}"
            assert results and results[0].success
            warnings = [e.user_message for e in instance.all_logs(results[0].run_id)
                        if e.level == logging.WARNING and "waited" in e.user_message]
            assert any(f"pid {blocker_pid}" in w for w in warnings), warnings
            # The slot's snapshot begins once the blocker has committed: its row is in it.
            target = build_target("clickhouse", config)
            try:
                assert target.count_current(app.table_schema("held")) == 101
            finally:
                target.close()

        # With a limit: the run fails with the report, and no slot is left behind.
        blocker.execute(f'insert into "{app.schema}".held values (1001, %s)', ("open again",))
        limited = load_config(_write_config(tmp_path, app, request, "held", "clickhouse",
                                            snapshot_wait_limit_seconds=6))
        asset = build_definitions(limited).resolve_assets_def(spec_key)
        with instance_for_test() as instance:
            instance.add_dynamic_partitions(table_specs(config)[0].partitions_def_name, [key])
            started = time.monotonic()
            result = dg.materialize([asset], partition_key=key, instance=instance, raise_on_error=False)
            assert not result.success
            assert time.monotonic() - started < 40
            failure = next(e for e in result.all_events if e.is_step_failure)
            message = failure.step_failure_data.error.to_string()
            assert f"pid {blocker_pid}" in message and "snapshot_wait_limit_seconds" in message, message
            assert "no slot was left behind" in message
        assert _no_snapshot_slots(app.dsn)
        blocker.rollback()


def test_a_table_the_publication_does_not_hold_yet_is_not_read(request: pytest.FixtureRequest, app: Application,
                                                                 tmp_path: Path) -> None:
    """The producer's publication exists without the table (the producer has not added it yet): no
    range is read, since the stream would miss its changes until then. Once it is added, the range
    loads; a partitioned table published through its partitions counts as published."""
    app.sql("create table {schema}.later (id integer primary key, body text)")
    app.sql("insert into {schema}.later select g, md5(g::text) from generate_series(1, 500) g")
    app.sql("create table {schema}.parted (id integer primary key, body text) partition by range (id)")
    app.sql("create table {schema}.parted_low partition of {schema}.parted for values from (0) to (1000)")
    app.sql("insert into {schema}.parted select g, md5(g::text) from generate_series(1, 50) g")
    app.sql("create table {schema}.other (id integer primary key)")
    app.sql(f"create publication {app.publication} for table {{schema}}.other")
    config = load_config(_write_config(tmp_path, app, request, "later", "clickhouse"))
    destination = build_target("clickhouse", config)
    settings = SnapshotSettings(dsn=app.dsn, publication=app.publication)
    later = TableConfig(name=app.qualified("later"))
    try:
        with pytest.raises(TableNotPublishedError, match=rf"{app.qualified('later')} is not in the publication "
                                                         rf"{app.publication} yet, so no range of it was read"):
            load_ranges(settings, later, [WHOLE_TABLE], destination, ensure=ensure_target_table(destination, "clickhouse"))
        assert _no_snapshot_slots(app.dsn)
        app.sql(f"alter publication {app.publication} add table {{schema}}.later, {{schema}}.parted_low")
        summary = load_ranges(settings, later, [WHOLE_TABLE], destination,
                              ensure=ensure_target_table(destination, "clickhouse"))
        assert summary.progress.rows == 500 and destination.count_current(app.table_schema("later")) == 500
        parted = TableConfig(name=app.qualified("parted"))
        summary = load_ranges(settings, parted, [WHOLE_TABLE], destination,
                              ensure=ensure_target_table(destination, "clickhouse"))
        assert summary.progress.rows == 50
        # Without a publication at all (no producer has run) nothing is checked.
        app.sql(f"drop publication {app.publication}")
        assert load_ranges(settings, later, [WHOLE_TABLE], destination,
                           ensure=ensure_target_table(destination, "clickhouse")).progress.rows == 500
    finally:
        destination.close()


@pytest.mark.parametrize("rewrite", ["alter table {schema}.moved alter column body type varchar(200)",
                                     "vacuum full {schema}.moved"])
def test_a_table_rewritten_between_the_snapshot_and_its_lock_is_not_read_under_that_snapshot(
        app: Application, rewrite: str) -> None:
    """A rewriting ALTER TABLE makes a table look empty to an older snapshot, and VACUUM FULL moves its
    rows to other blocks: a range read then would load nothing, or other rows than its blocks held."""
    app.sql("create table {schema}.moved (id integer primary key, body text)")
    app.sql("insert into {schema}.moved select g, md5(g::text) from generate_series(1, 2000) g")
    with source.connect(app.dsn) as connection:
        table = source.table_schema(connection, TableConfig(name=app.qualified("moved")))
    with exported_snapshot(app.dsn) as slot:
        app.sql(rewrite)
        with pytest.raises(TableRewrittenError, match=rf"{app.qualified('moved')} was rewritten"):
            b"".join(read_range(app.dsn, slot.snapshot_name or "", table, WHOLE_TABLE, SnapshotProgress()))
    with exported_snapshot(app.dsn) as slot:  # a snapshot after the rewrite reads every row
        text = b"".join(read_range(app.dsn, slot.snapshot_name or "", table, WHOLE_TABLE, SnapshotProgress()))
    assert text.count(b"\n") == 2000


def test_ranges_read_before_the_table_was_rewritten_are_read_again(
        request: pytest.FixtureRequest, app: Application, tmp_path: Path) -> None:
    """VACUUM FULL between two ranges packs the rows of the second range's blocks into the first's:
    without a second read of the first range those rows would be in neither read."""
    app.sql("create table {schema}.packed (id integer primary key, body text)")
    app.sql("insert into {schema}.packed select g, repeat(md5(g::text), 4) from generate_series(1, 4000) g")
    app.sql("delete from {schema}.packed where id % 4 <> 0")  # three quarters of every block freed
    blocks = app.sql("select pg_relation_size('{schema}.packed') / current_setting('block_size')::int")[0][0]
    half = blocks // 2
    ranges = [BlockRange(0, half - 1), BlockRange(half, (1 << 20) - 1)]
    config = load_config(_write_config(tmp_path, app, request, "packed", "clickhouse"))
    destination = build_target("clickhouse", config)
    warnings: list[str] = []
    started: list[threading.Thread] = []

    def vacuum_once(message: str) -> None:
        # Started while the first range holds its lock: VACUUM FULL waits for it, and the second
        # range's slot waits for VACUUM FULL, so the rewrite comes between the two ranges.
        if not started:
            started.append(threading.Thread(target=app.sql, args=("vacuum full {schema}.packed",), daemon=True))
            started[0].start()

    try:
        summary = load_ranges(SnapshotSettings(dsn=app.dsn), TableConfig(name=app.qualified("packed")), ranges,
                              destination, ensure=ensure_target_table(destination, "clickhouse"),
                              on_info=vacuum_once, on_warning=warnings.append)
        started[0].join(60)
        assert any("was rewritten while it loaded" in w and "reading 1 range(s)" in w for w in warnings), warnings
        assert len(summary.consistent_points) == 3  # the first range read twice
        schema = app.table_schema("packed")
        assert destination.count_current(schema) == 1000
        assert destination.current_rows_as_text(schema) == app.rows_as_text(schema)
    finally:
        destination.close()


def test_a_wait_watch_that_cannot_connect_for_a_while_still_ends_the_wait_at_its_limit(
        app: Application, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch's own connection is refused twice (a source at max_connections): it tries again at
    its next checks, and the slot's wait still ends at its limit with the report."""
    from siphon_dagster.snapshot import blockers

    app.sql("create table {schema}.held (id integer primary key)")
    refused: list[int] = []

    def refusing_twice(dsn: str, **options: object) -> psycopg.Connection:
        if len(refused) < 2:
            refused.append(1)
            raise psycopg.OperationalError("sorry, too many clients already")
        return blockers_connect(dsn, **options)

    blockers_connect = blockers.connect
    monkeypatch.setattr(blockers, "connect", refusing_twice)
    with psycopg.connect(app.dsn) as blocker:
        blocker.execute(sql.SQL("insert into {} values (1)").format(sql.Identifier(app.schema, "held")))
        started = time.monotonic()
        with pytest.raises(SnapshotWaitLimitError, match=rf"pid {blocker.info.backend_pid}"), \
                exported_snapshot(app.dsn, table=app.qualified("held"), wait_limit_seconds=2.5, check_seconds=0.5,
                                  on_blocked=lambda report: None):
            pass
        assert len(refused) == 2 and time.monotonic() - started < 20
        blocker.rollback()
    assert _no_snapshot_slots(app.dsn)
