"""`resync_<table>` on the real stack: a table streaming under a live workload, damaged by hand at both
targets, rebuilt without readers of its view ever seeing it empty, and equal to the source after."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import psycopg
import pytest
import yaml
from psycopg import sql

from siphon_core import naming
from siphon_core.config import SiphonConfig, load_config
from siphon_dagster import cli, runs, source
from siphon_dagster.definitions import build_definitions
from siphon_dagster.resync import RESYNC_TAG, resync_lock_key
from siphon_dagster.resync_requests import tables_resync_job_name
from siphon_dagster.specs import group_name
from siphon_dagster.targets import build_target
from siphon_dagster.targets.base import TableSchema, Target
from siphon_stack.process import free_port, start_process, stop_pid
from tests.helpers.instance import write_instance_yaml
from tests.helpers.producer import drop_application, producer_streaming, wait_until
from tests.integration.test_end_to_end import run_stream_jobs, source_rows, target_rows
from tests.integration.test_targets_version_rule import target_settings

TARGETS = ("clickhouse", "snowflake")
HUGE_VERSION = (1 << 90)


class Workload:
    """Inserts, updates and deletes of `items`, one small transaction after another, until stopped."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.transactions = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rnd = random.Random(3)
        table = sql.Identifier(self.schema, "items")
        try:
            with psycopg.connect(self.dsn, autocommit=True) as connection:
                while not self.stop.is_set():
                    choice = rnd.random()
                    if choice < 0.4:
                        connection.execute(sql.SQL("insert into {} (title, qty) values (%s, %s)").format(table),
                                           (f"new {self.transactions}", self.transactions))
                    elif choice < 0.8:
                        connection.execute(sql.SQL("update {} set qty = qty + 1 where id = %s").format(table),
                                           (rnd.randint(1, 3000),))
                    else:
                        connection.execute(sql.SQL("delete from {} where id = %s").format(table),
                                           (rnd.randint(200, 3000),))
                    self.transactions += 1
                    time.sleep(0.01)
        except BaseException as error:  # surfaced by the test
            self.errors.append(error)


class ViewSampler:
    """Counts the current-rows view of each target over and over from a thread of its own."""

    def __init__(self, config: SiphonConfig, table: TableSchema) -> None:
        self.config, self.table = config, table
        self.counts: dict[str, list[int]] = {name: [] for name in TARGETS}
        self.errors: dict[str, list[str]] = {name: [] for name in TARGETS}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

        self.targets = {name: build_target(name, config) for name in TARGETS}
        for name, target in self.targets.items():  # connected here, before anything else runs
            self.counts[name].append(target.count_current(table))

    def _run(self) -> None:
        targets = self.targets
        try:
            while not self.stop.is_set():
                for name, target in targets.items():
                    try:
                        self.counts[name].append(target.count_current(self.table))
                    except Exception as error:
                        self.errors[name].append(str(error))
                        target.close()
                time.sleep(0.02)
        finally:
            for target in targets.values():
                target.close()


@pytest.fixture
def application(request, tmp_path, postgres_dsn, nats_url, clickhouse_url, snowflake_env, unique_name):
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        connection.execute(sql.SQL("create table {} (id bigserial primary key, title text not null, qty integer)")
                           .format(sql.Identifier(unique_name, "items")))
        connection.execute(sql.SQL("insert into {} (title, qty) select 'seed ' || g, g from generate_series(1, 3000) g")
                           .format(sql.Identifier(unique_name, "items")))
    config_path = tmp_path / "siphon.yaml"
    config_path.write_text(yaml.safe_dump({
        "application_identifier": unique_name,
        "source": {"dsn": postgres_dsn},
        "queue": {"url": nats_url},
        "producer": {"flush_interval_seconds": 0.3, "metrics_port": free_port(), "status_interval_seconds": 0.5},
        "tables": [{"name": f"{unique_name}.items", "blocks_per_partition": 4}],
        "targets": {name: target_settings(request, name, unique_name) for name in TARGETS},
        "streaming": {"batch_max_wait_seconds": 0.3, "shadow_lookup_seconds": 1},
    }))
    yield load_config(config_path), config_path
    drop_application(postgres_dsn, nats_url, unique_name)
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("drop schema {} cascade").format(sql.Identifier(unique_name)))


def damage(target: Target, table: TableSchema) -> None:
    """By hand, behind Siphon's back: rows lost, a row the source never had, a row changed with a
    version no stream change will ever beat."""
    names = target._names(table)  # noqa: SLF001 (the test writes to the target's own tables)
    if target.name == "clickhouse":
        client = target._connect()  # noqa: SLF001
        client.command(f"ALTER TABLE {names.live} DELETE WHERE id <= 100", settings={"mutations_sync": 2})
        client.command(f"INSERT INTO {names.live} (id, title, qty, _siphon_version, _siphon_deleted) "
                       f"VALUES (99999999, 'ghost', 1, {HUGE_VERSION}, 0), (150, 'tampered', -1, {HUGE_VERSION}, 0)")
    else:
        cursor = target._connect().cursor()  # noqa: SLF001
        cursor.execute(f"DELETE FROM {names.live} WHERE \"id\" <= 100")
        cursor.execute(f"INSERT INTO {names.live} (\"id\", \"title\", \"qty\", \"_siphon_version\", "
                       f"\"_siphon_deleted\", \"_siphon_synced_at\") VALUES "
                       f"(99999999, 'ghost', 1, {HUGE_VERSION}, FALSE, CURRENT_TIMESTAMP())")
        cursor.execute(f"UPDATE {names.live} SET \"title\" = 'tampered', \"_siphon_version\" = {HUGE_VERSION} "
                       "WHERE \"id\" = 150")


def differences(config: SiphonConfig, table: TableSchema) -> list[str]:
    problems = []
    expected = source_rows(config.source.dsn, table)
    for name in TARGETS:
        target = build_target(name, config)
        try:
            actual = target_rows(target, table)
        finally:
            target.close()
        missing, extra = expected.keys() - actual.keys(), actual.keys() - expected.keys()
        differing = [k for k in expected.keys() & actual.keys() if expected[k] != actual[k]]
        if missing or extra or differing:
            problems.append(f"{name}: {len(missing)} missing (e.g. {sorted(missing)[:3]}), {len(extra)} extra "
                            f"(e.g. {sorted(extra)[:3]}), {len(differing)} differ (e.g. {sorted(differing)[:3]})")
    return problems


def test_resync_rebuilds_every_target_under_a_live_stream_without_an_empty_view(application, tmp_path: Path) -> None:
    config, config_path = application
    spec = runs.find_spec(config, config.tables[0].name)
    defs = build_definitions(config)
    specs = [spec]
    producer = start_process("siphon-producer", [sys.executable, "-m", "producer_service.cli", "run", "--config",
                                                 str(config_path)], tmp_path / "producer.log")
    workload = Workload(config.source.dsn, spec.schema)
    sampler: ViewSampler | None = None
    try:
        wait_until(lambda: producer_streaming(config.producer.metrics_port), 60, "producer streaming")
        home = tmp_path / "dagster_home"
        home.mkdir()
        write_instance_yaml(home)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            # Converged and streaming: every partition snapshotted, the stream applied.
            runs.refresh_partitions(instance, config, specs)
            spans = runs.partition_spans(instance, spec, "all")
            for target in TARGETS:
                assert all(o.success for o in runs.snapshot(config, spec, target, spans, instance))
            workload.thread.start()
            run_stream_jobs(defs, specs, instance, max_batches=3)

            with psycopg.connect(config.source.dsn) as connection:
                table = source.table_schema(connection, spec.table)
            for name in TARGETS:
                target = build_target(name, config)
                try:
                    damage(target, table)
                finally:
                    target.close()
            assert len(differences(config, table)) == 2

            sampler = ViewSampler(config, table)
            sampler.thread.start()
            # The resync runs as `siphon-dagster resync` in a process of its own, recorded by the same
            # instance, while this process goes on applying the stream: its batches reach the shadow too.
            environment = {**os.environ, "DAGSTER_HOME": str(home)}
            resync = subprocess.Popen([sys.executable, "-m", "siphon_dagster.cli", "--config", str(config_path),
                                       "resync", "--table", spec.qualified_name],
                                      env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            started = time.monotonic()
            samples_before = {name: len(sampler.counts[name]) for name in TARGETS}
            batches = 0
            while resync.poll() is None and time.monotonic() - started < 600:
                run_stream_jobs(defs, specs, instance, max_batches=2)
                batches += 1
            output = resync.communicate(timeout=60)[0]
            assert resync.returncode == 0, output[-5000:]
            assert batches >= 1
            assert "resync of" in output and "done" in output
            run = instance.get_runs(dg.RunsFilter(job_name=spec.resync_job_name))[0]
            assert run.status == dg.DagsterRunStatus.SUCCESS and run.tags[RESYNC_TAG] == spec.qualified_name
            for name in TARGETS:
                records = instance.fetch_materializations(spec.target_key(name), limit=100).records
                metadata = next(r for r in records if r.run_id == run.run_id).asset_materialization.metadata
                assert metadata["resync"].value is True and metadata["dagster/row_count"].value > 2000

            time.sleep(1.0)
            workload.stop.set()
            workload.thread.join(30)
            assert not workload.errors, workload.errors
            sampler.stop.set()
            sampler.thread.join(30)
            for name in TARGETS:
                during = sampler.counts[name][samples_before[name]:]
                assert len(during) > 10, f"{name}: too few samples of the view during the resync"
                assert min(sampler.counts[name]) > 2000, f"{name}: the view looked empty or partial"
            assert not sampler.errors["clickhouse"], sampler.errors["clickhouse"][:3]

            drain(config, defs, specs, instance)
            assert not differences(config, table)

            # Running it again, with the stream at rest, changes nothing and leaves no resync table.
            assert runs.resync(config, spec, ["clickhouse"], instance).success
            assert not differences(config, table)

            # A resync already under way (a run this instance has started) is refused by name.
            job = defs.resolve_job_def(spec.resync_job_name)
            other = instance.create_run_for_job(job, run_config={}, status=dg.DagsterRunStatus.STARTED)
            refused = runs.resync(config, spec, None, instance)
            assert not refused.success
            failure = next(e for e in instance.all_logs(refused.run_id) if e.dagster_event and
                           e.dagster_event.is_step_failure)
            assert other.run_id in failure.dagster_event.step_failure_data.error.message

            # The listed `<group>_resync` job, as the UI and the sensors start it, rebuilds the
            # table its run config names, and is kept apart from the table's other resyncs too.
            tables_job = defs.resolve_job_def(tables_resync_job_name(group_name(config.application_identifier)))

            def tables_resync(table: str) -> tuple[bool, str]:
                result = tables_job.execute_in_process(run_config={"ops": {"rebuild": {"config": {"table": table}}}},
                                                       instance=instance, raise_on_error=False)
                failures = [e.step_failure_data.error.message for e in result.all_events if e.is_step_failure]
                assert result.success or failures
                return result.success, "\n".join(failures)

            succeeded, said = tables_resync(spec.qualified_name)
            assert not succeeded and other.run_id in said and "another resync of this table" in said
            instance.report_run_canceled(other)
            with source.connect(config.source.dsn, autocommit=True) as holder:
                holder.execute("select pg_advisory_lock(hashtextextended(%s, 0))", (resync_lock_key(spec),))
                succeeded, said = tables_resync(spec.qualified_name)
                assert not succeeded and "resync lock" in said
            succeeded, said = tables_resync(spec.qualified_name)
            assert succeeded, said
            run = instance.get_runs(dg.RunsFilter(job_name=tables_job.name, statuses=[dg.DagsterRunStatus.SUCCESS]))[0]
            assert run.tags[RESYNC_TAG] == spec.qualified_name
            assert not differences(config, table)
            succeeded, said = tables_resync("public.nope")
            assert not succeeded and "'public.nope' is not configured" in said and repr(spec.qualified_name) in said
    finally:
        workload.stop.set()
        if sampler is not None:
            sampler.stop.set()
        stop_pid(producer.pid, timeout=30)


def drain(config: SiphonConfig, defs: dg.Definitions, specs: list, instance: dg.DagsterInstance) -> None:
    with psycopg.connect(config.source.dsn) as connection:
        end = naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])

    def caught_up() -> bool:
        with psycopg.connect(config.source.dsn) as connection:
            row = connection.execute("select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s",
                                     (naming.slot_name(config.application_identifier),)).fetchone()
        return bool(row and row[0]) and naming.parse_lsn(row[0]) >= end

    wait_until(caught_up, 120, "producer caught up")
    run_stream_jobs(defs, specs, instance, drain=True)


def test_resync_of_an_unconfigured_table_lists_the_configured_ones(application, capsys) -> None:
    config, config_path = application
    with pytest.raises(runs.SelectionError, match=r"its tables are: '.*\.items'"):
        runs.find_spec(config, "public.nope")
    assert cli.main(["--config", str(config_path), "resync", "--table", "public.nope"]) == 2
    assert f"{config.tables[0].name}" in capsys.readouterr().err
    assert cli.main(["--config", str(config_path), "resync", "--table", config.tables[0].name,
                     "--target", "elsewhere"]) == 2
    assert "its targets are: clickhouse, snowflake" in capsys.readouterr().err
