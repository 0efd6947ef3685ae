"""The sensors, one test per cursor scenario, on a test instance against real PostgreSQL and NATS."""

import asyncio
import functools
import json
import math
import subprocess
import sys
import time

import dagster as dg
import psycopg
import pytest
import yaml
from dagster._core.test_utils import create_run_for_test
from psycopg import sql

from siphon_core import naming
from siphon_core.config import TableConfig, parse_config
from siphon_dagster import sensors, source
from siphon_dagster.definitions import build_definitions, build_resources
from siphon_dagster.resync_requests import RESYNC_TAG, ResyncRequests, tables_resync_job_name
from siphon_dagster.run_liveness import (
    LAUNCHER_TAG,
    SNAPSHOT_RUN_TAG,
    WORKER_TAG,
    dead_run_reason,
    replaced_launcher,
    worker_identity,
)
from siphon_dagster.sensors import (
    CONSUMER_SWEEP_SECONDS,
    FAILURE_MEMORY_SECONDS,
    OBSERVED_KEY,
    SOURCE_OBSERVATION_SECONDS,
    VERIFIED_KEY,
    backoff_seconds,
    build_streaming_sensor,
)
from siphon_dagster.specs import group_name, table_specs
from siphon_dagster.stream_groups import ENDED_BY_INTERRUPT, ENDED_BY_TAG, stream_groups
from tests.helpers.instance import instance_for_test
from tests.helpers.processes import code_server_with_children


@pytest.fixture
def config(postgres_dsn, nats_url, unique_name):
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        connection.execute(sql.SQL("create table {} (id int primary key, body text)").format(
            sql.Identifier(unique_name, "grows")))
        connection.execute(sql.SQL("insert into {} select g, repeat('x', 200) from generate_series(1, 300) g")
                           .format(sql.Identifier(unique_name, "grows")))
    return parse_config(raw_config(postgres_dsn, nats_url, unique_name))


def raw_config(postgres_dsn, nats_url, unique_name):
    return {
        "application_identifier": unique_name,
        "source": {"dsn": postgres_dsn},
        "queue": {"url": nats_url},
        "tables": [{"name": f"{unique_name}.grows", "blocks_per_partition": 4}],
        "targets": {"clickhouse": {"url": "http://127.0.0.1:1"}},
    }


def sensor(defs, suffix):
    return next(s for s in defs.sensors if s.name.endswith(suffix))


def tick(defs, config, instance, name, cursor=None):
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=build_resources(config),
                                      definitions=defs)
    return sensor(defs, name)(context)


def partitions_tick(defs, config, instance, cursor=None):
    """A partitions tick: it adds the partitions it finds missing to the instance itself."""
    result = tick(defs, config, instance, "_partitions", cursor=cursor)
    assert not result.dynamic_partitions_requests  # nothing is left for the daemon to add
    return result


def test_partitions_first_tick_adds_every_range_and_observes_the_source(config):
    defs = build_definitions(config)
    spec = table_specs(config)[0]
    with instance_for_test() as instance:
        result = partitions_tick(defs, config, instance)
        keys = instance.get_dynamic_partitions(spec.partitions_def_name)
        with psycopg.connect(config.source.dsn) as connection:
            blocks = connection.execute("select pg_relation_size(%s) / 8192",
                                        (f'"{spec.schema}".grows',)).fetchone()[0]
        assert len(keys) == -(-blocks // 4) and keys[0] == "00000000-00000003"
        cursor = json.loads(result.cursor)
        assert cursor[spec.qualified_name] == blocks
        assert set(cursor[OBSERVED_KEY]) == {spec.qualified_name}
        observation = result.asset_events[0]
        assert observation.asset_key == spec.source_key
        assert observation.metadata["blocks"].value == blocks


def test_partitions_tick_with_nothing_new_requests_nothing(config):
    defs = build_definitions(config)
    spec = table_specs(config)[0]
    with instance_for_test() as instance:
        first = partitions_tick(defs, config, instance)
        keys = instance.get_dynamic_partitions(spec.partitions_def_name)
        second = partitions_tick(defs, config, instance, cursor=first.cursor)
        assert instance.get_dynamic_partitions(spec.partitions_def_name) == keys and keys
        assert second.cursor == first.cursor


def test_a_table_whose_size_did_not_change_has_its_partitions_looked_up_only_every_observation_interval(config):
    defs = build_definitions(config)
    spec = table_specs(config)[0]
    with instance_for_test() as instance:
        first = partitions_tick(defs, config, instance)
        keys = instance.get_dynamic_partitions(spec.partitions_def_name)
        instance.delete_dynamic_partition(spec.partitions_def_name, keys[-1])  # by hand, at the instance
        # Same block count as the cursor says, observed a moment ago: the instance is not read.
        partitions_tick(defs, config, instance, cursor=first.cursor)
        assert instance.get_dynamic_partitions(spec.partitions_def_name) == keys[:-1]
        # Once the interval has passed, the table's partitions are read again and the range comes back.
        cursor = json.loads(first.cursor)
        cursor[VERIFIED_KEY][spec.qualified_name] -= SOURCE_OBSERVATION_SECONDS + 1
        partitions_tick(defs, config, instance, cursor=json.dumps(cursor))
        assert instance.get_dynamic_partitions(spec.partitions_def_name) == keys


def test_a_table_that_grew_inside_its_last_range_has_its_partitions_looked_up_only_every_observation_interval(config):
    defs = build_definitions(config)
    spec = table_specs(config)[0]
    per = spec.table.blocks_per_partition
    relation = sql.Identifier(spec.schema, "grows")
    with instance_for_test() as instance, psycopg.connect(config.source.dsn, autocommit=True) as connection:
        first = partitions_tick(defs, config, instance)
        blocks = json.loads(first.cursor)[spec.qualified_name]
        if blocks % per == 0:  # the last range is full: one block more, so that the next one fits in it
            connection.execute(sql.SQL("insert into {} select g, repeat('z', 200) from generate_series(3001, 3040) g")
                               .format(relation))
            first = partitions_tick(defs, config, instance)
            blocks = json.loads(first.cursor)[spec.qualified_name]
        assert blocks % per != 0, blocks
        keys = instance.get_dynamic_partitions(spec.partitions_def_name)
        instance.delete_dynamic_partition(spec.partitions_def_name, keys[-1])  # by hand, at the instance
        start = 4001
        while source.table_size(connection, spec.table).blocks == blocks:  # one block more, at most
            connection.execute(sql.SQL("insert into {} select g, repeat('z', 200) from generate_series(%s::int, %s::int) g")
                               .format(relation), (start, start + 9))
            start += 10
        grown = partitions_tick(defs, config, instance, cursor=first.cursor)
        assert json.loads(grown.cursor)[spec.qualified_name] == blocks + 1
        # Still inside the ranges the last tick added: the instance is not read.
        assert instance.get_dynamic_partitions(spec.partitions_def_name) == keys[:-1]
        # Once the interval has passed, the table's partitions are read again and the range comes back.
        cursor = json.loads(grown.cursor)
        cursor[VERIFIED_KEY][spec.qualified_name] -= SOURCE_OBSERVATION_SECONDS + 1
        partitions_tick(defs, config, instance, cursor=json.dumps(cursor))
        assert instance.get_dynamic_partitions(spec.partitions_def_name) == keys


def test_a_source_table_is_observed_again_when_its_columns_change_or_its_observation_is_old(config):
    defs = build_definitions(config)
    spec = table_specs(config)[0]
    with instance_for_test() as instance:
        first = partitions_tick(defs, config, instance)
        assert [o.asset_key for o in first.asset_events] == [spec.source_key]
        again = tick(defs, config, instance, "_partitions", cursor=first.cursor)
        assert again.asset_events == []  # observed a moment ago, nothing changed
        with psycopg.connect(config.source.dsn, autocommit=True) as connection:
            connection.execute(sql.SQL("alter table {} add column observed_note text").format(
                sql.Identifier(spec.schema, "grows")))
        try:
            changed = tick(defs, config, instance, "_partitions", cursor=again.cursor)
            assert [o.asset_key for o in changed.asset_events] == [spec.source_key]
            columns = changed.asset_events[0].metadata["dagster/column_schema"].value.columns
            assert "observed_note" in [column.name for column in columns]
            # An observation older than the interval is made again, columns unchanged.
            cursor = json.loads(changed.cursor)
            cursor[OBSERVED_KEY][spec.qualified_name][0] -= SOURCE_OBSERVATION_SECONDS + 1
            aged = tick(defs, config, instance, "_partitions", cursor=json.dumps(cursor))
            assert [o.asset_key for o in aged.asset_events] == [spec.source_key]
            assert tick(defs, config, instance, "_partitions", cursor=aged.cursor).asset_events == []
        finally:
            with psycopg.connect(config.source.dsn, autocommit=True) as connection:
                connection.execute(sql.SQL("alter table {} drop column observed_note").format(
                    sql.Identifier(spec.schema, "grows")))


def three_tables(postgres_dsn, nats_url, unique_name):
    """A configuration of three tables of 100 rows, `a`, `b` and `c`, made in a schema of their own,
    at 4 blocks a partition."""
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        for name in ("a", "b", "c"):
            connection.execute(sql.SQL("create table {} (id int primary key, body text)").format(
                sql.Identifier(unique_name, name)))
            connection.execute(sql.SQL("insert into {} select g, repeat('x', 200) from generate_series(1, 100) g")
                               .format(sql.Identifier(unique_name, name)))
    raw = raw_config(postgres_dsn, nats_url, unique_name)
    raw["tables"] = [{"name": f"{unique_name}.{name}", "blocks_per_partition": 4} for name in ("a", "b", "c")]
    return parse_config(raw)


def test_a_tick_observes_enough_tables_to_keep_each_observed_every_interval() -> None:
    # 40 a tick up to 266 tables; beyond, half as many again as one tick a minute needs to observe
    # every table each SOURCE_OBSERVATION_SECONDS.
    assert [sensors.source_observations_per_tick(n) for n in (1, 200, 400, 500, 1000)] == [40, 40, 60, 75, 150]
    for tables in (500, 1000, 3000):
        ticks_a_round = math.ceil(tables / sensors.source_observations_per_tick(tables))
        assert ticks_a_round * 60 < SOURCE_OBSERVATION_SECONDS


def test_a_tick_observes_at_most_its_number_of_source_tables_and_the_rest_at_the_next(postgres_dsn, nats_url,
                                                                                    unique_name):
    """Three tables, one observation a tick: each tick observes the table unobserved longest, a
    table whose columns changed is observed at once beyond the limit, and a table not yet observed
    has its partitions read once, not at every tick until its observation."""
    config = three_tables(postgres_dsn, nats_url, unique_name)
    specs = table_specs(config)
    partitions = sensors.build_partitions_sensor(specs, "limited", observations_per_tick=1)

    def limited_tick(instance, cursor):
        context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=build_resources(config))
        result = partitions(context)
        assert not result.dynamic_partitions_requests  # the tick added its partitions itself
        return result

    with instance_for_test() as instance:
        first = limited_tick(instance, None)
        assert [o.asset_key for o in first.asset_events] == [specs[0].source_key]
        state = json.loads(first.cursor)
        assert set(state[OBSERVED_KEY]) == {specs[0].qualified_name}
        assert set(state[VERIFIED_KEY]) == {s.qualified_name for s in specs}  # every table's partitions read
        # A partition removed by hand from a table not yet observed: not looked up again until the interval.
        keys = instance.get_dynamic_partitions(specs[1].partitions_def_name)
        instance.delete_dynamic_partition(specs[1].partitions_def_name, keys[-1])
        second = limited_tick(instance, first.cursor)
        assert [o.asset_key for o in second.asset_events] == [specs[1].source_key]
        assert instance.get_dynamic_partitions(specs[1].partitions_def_name) == keys[:-1]
        with psycopg.connect(postgres_dsn, autocommit=True) as connection:
            connection.execute(sql.SQL("alter table {} add column extra text").format(sql.Identifier(unique_name, "a")))
        third = limited_tick(instance, second.cursor)
        # "a" changed columns: observed at once, besides "c", the one never observed.
        assert sorted(o.asset_key.to_user_string() for o in third.asset_events) == sorted(
            [specs[0].source_key.to_user_string(), specs[2].source_key.to_user_string()])
        assert limited_tick(instance, third.cursor).asset_events == []
        # The oldest observation goes first once several are due.
        state = json.loads(third.cursor)
        for offset, spec in ((3000, specs[1]), (2000, specs[2]), (1000, specs[0])):
            state[OBSERVED_KEY][spec.qualified_name][0] -= SOURCE_OBSERVATION_SECONDS + offset
        aged = limited_tick(instance, json.dumps(state))
        assert [o.asset_key for o in aged.asset_events] == [specs[1].source_key]


def test_a_tick_adds_partitions_within_its_budget_and_the_rest_at_the_next(postgres_dsn, nats_url, unique_name,
                                                                          monkeypatch):
    """Three new tables and no time to add partitions: a tick adds one table's and leaves the
    others unverified in its cursor, so the next ticks add theirs."""
    config = three_tables(postgres_dsn, nats_url, unique_name)
    specs = table_specs(config)
    partitions = sensors.build_partitions_sensor(specs, "budget")
    monkeypatch.setattr(sensors, "ADD_PARTITIONS_SECONDS", 0.0)

    def with_partitions(instance):
        return [spec.qualified_name for spec in specs if instance.get_dynamic_partitions(spec.partitions_def_name)]

    with instance_for_test() as instance:
        cursor = None
        for count in (1, 2, 3, 3):
            result = partitions(dg.build_sensor_context(instance=instance, cursor=cursor,
                                                        resources=build_resources(config)))
            cursor = result.cursor
            assert len(with_partitions(instance)) == count
            assert sorted(json.loads(cursor)[VERIFIED_KEY]) == sorted(with_partitions(instance))
        for spec in specs:  # every range of each table, added once
            keys = instance.get_dynamic_partitions(spec.partitions_def_name)
            assert len(keys) == len(set(keys)) and keys[0] == "00000000-00000003"


def test_partitions_tick_after_growth_adds_only_the_new_ranges(config):
    defs = build_definitions(config)
    spec = table_specs(config)[0]
    with instance_for_test() as instance:
        first = partitions_tick(defs, config, instance)
        before = set(instance.get_dynamic_partitions(spec.partitions_def_name))
        with psycopg.connect(config.source.dsn, autocommit=True) as connection:
            connection.execute(sql.SQL("insert into {} select g, repeat('y', 200) from generate_series(301, 3000) g")
                               .format(sql.Identifier(spec.schema, "grows")))
        grown = partitions_tick(defs, config, instance, cursor=first.cursor)
        after = instance.get_dynamic_partitions(spec.partitions_def_name)
        assert set(after) > before  # the new ranges added, the earlier ones kept
        assert json.loads(grown.cursor)[spec.qualified_name] > json.loads(first.cursor)[spec.qualified_name]


def streaming_job_name(config):
    """The group job the streaming sensor runs for the default group."""
    return "stream_clickhouse"


def group_run(instance, config, status=dg.DagsterRunStatus.STARTED, tags=None, job_name=None):
    """A run of the default group's job, tagged as a run of the current definitions would be."""
    defs = build_definitions(config)
    job = defs.resolve_job_def(job_name or streaming_job_name(config))
    return create_run_for_test(instance, job_name=job.name, status=status, tags={**job.tags, **(tags or {})})


def test_streaming_sensor_starts_a_run_when_none_is_alive(config):
    defs = build_definitions(config)
    with instance_for_test() as instance:
        result = tick(defs, config, instance, "_streaming")
        assert [r.job_name for r in result.run_requests] == [streaming_job_name(config)]
        state = json.loads(result.cursor)[streaming_job_name(config)]
        assert state["failures"] == 0


def test_streaming_sensor_does_not_start_a_duplicate(config):
    defs = build_definitions(config)
    with instance_for_test() as instance:
        group_run(instance, config)
        result = tick(defs, config, instance, "_streaming")
        assert result.run_requests == []


def gone_worker_identity() -> str:
    """The identity of a process that has exited, taken while it ran, as a run tags itself."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    identity = worker_identity(worker.pid)
    worker.kill()
    worker.wait()
    return identity


@pytest.fixture
def worker():
    """A process standing in for a run's worker: its identity to tag a run with, and `stop()`,
    which ends it as a worker ends with its run (a run recorded ended while its worker still runs
    holds its tables back, see test_lingering_workers)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    class Worker:
        identity = worker_identity(process.pid)

        @staticmethod
        def stop() -> None:
            process.kill()
            process.wait()

    yield Worker
    Worker.stop()


def test_streaming_sensor_replaces_a_run_whose_worker_process_is_gone(config):
    defs = build_definitions(config)
    gone = gone_worker_identity()
    with instance_for_test() as instance:
        dead = group_run(instance, config, tags={WORKER_TAG: gone})
        result = tick(defs, config, instance, "_streaming")
        assert [r.job_name for r in result.run_requests] == [streaming_job_name(config)]
        assert instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.FAILURE


def test_a_run_whose_worker_went_while_it_was_being_canceled_is_marked_canceled_not_failed(config):
    defs = build_definitions(config)
    gone = gone_worker_identity()
    with instance_for_test() as instance:
        canceling = group_run(instance, config, status=dg.DagsterRunStatus.CANCELING, tags={WORKER_TAG: gone})
        result = tick(defs, config, instance, "_streaming")
        assert [r.job_name for r in result.run_requests] == [streaming_job_name(config)]
        assert instance.get_run_by_id(canceling.run_id).status == dg.DagsterRunStatus.CANCELED
        assert json.loads(result.cursor)[streaming_job_name(config)]["failures"] == 0


def test_streaming_sensor_keeps_a_run_whose_worker_is_alive_or_on_another_host(config):
    defs = build_definitions(config)
    with instance_for_test() as instance:
        here = group_run(instance, config, tags={WORKER_TAG: worker_identity()})
        assert tick(defs, config, instance, "_streaming").run_requests == []
        instance.report_run_failed(here)
        group_run(instance, config, tags={WORKER_TAG: "another-host:1:123"})
        assert tick(defs, config, instance, "_streaming").run_requests == []


def test_an_untagged_run_counts_as_dead_only_long_after_it_started():
    run = dg.DagsterRun(job_name="stream_x", status=dg.DagsterRunStatus.STARTED)
    assert dead_run_reason(run, started_at=None, now=1e9) is None
    assert dead_run_reason(run, started_at=1e9 - 60, now=1e9) is None
    assert "never reported" in dead_run_reason(run, started_at=1e9 - 3600, now=1e9)


def _tick_at(config, instance: dg.DagsterInstance, now: float, cursor: str | None = None) -> dg.SensorResult:
    """A tick of the streaming sensor as if the clock read `now`."""
    defs = build_definitions(config)
    groups = stream_groups(config, table_specs(config))
    jobs = {group.key: defs.resolve_job_def(group.job_name) for group in groups}
    sensor = build_streaming_sensor(groups, "later", jobs, failure_threshold=3, now=lambda: now)
    return sensor(dg.build_sensor_context(instance=instance, resources=build_resources(config), definitions=defs,
                                          cursor=cursor))


def _failed_runs(config, instance: dg.DagsterInstance, count: int, tags: dict[str, str] | None = None) -> str:
    job_name = streaming_job_name(config)
    for _ in range(count):
        create_run_for_test(instance, job_name=job_name, status=dg.DagsterRunStatus.FAILURE, tags=tags)
    return job_name


def test_streaming_sensor_backs_off_after_repeated_failures_and_resumes_later(config):
    with instance_for_test() as instance:
        job_name = _failed_runs(config, instance, 4)
        result = tick(build_definitions(config), config, instance, "_streaming")
        assert result.run_requests == []
        state = json.loads(result.cursor)[job_name]
        assert state["failures"] == 4 and state["backoff_until"] > 0
        # Once the backoff has passed, the sensor tries again.
        assert [r.job_name for r in _tick_at(config, instance, state["backoff_until"] + 1).run_requests] == [job_name]


def test_runs_stopped_by_their_operator_are_no_streak_of_failures(config):
    stopped = {ENDED_BY_TAG: ENDED_BY_INTERRUPT}
    with instance_for_test() as instance:
        # `dagster dev` stopped and started five times: a run starts at once.
        job_name = _failed_runs(config, instance, 5, stopped)
        result = tick(build_definitions(config), config, instance, "_streaming")
        assert [r.job_name for r in result.run_requests] == [job_name]
        assert json.loads(result.cursor)[job_name]["failures"] == 0
    with instance_for_test() as instance:
        # Failures on either side of a stopped run still make a streak.
        _failed_runs(config, instance, 2)
        _failed_runs(config, instance, 1, stopped)
        job_name = _failed_runs(config, instance, 2)
        result = tick(build_definitions(config), config, instance, "_streaming")
        assert result.run_requests == []
        assert json.loads(result.cursor)[job_name]["failures"] == 4


def test_failures_of_an_earlier_session_do_not_hold_back_a_fresh_start(config):
    with instance_for_test() as instance:
        job_name = _failed_runs(config, instance, 8)
        # Two hours later (the runs ended "now"), the streak is forgotten and a run starts at once.
        result = _tick_at(config, instance, time.time() + 2 * FAILURE_MEMORY_SECONDS)
        assert [r.job_name for r in result.run_requests] == [job_name]
        assert json.loads(result.cursor)[job_name]["failures"] == 0


def test_backoff_grows_and_is_capped():
    assert backoff_seconds(2, 3) == 0
    assert backoff_seconds(3, 3) == 30 < backoff_seconds(4, 3) == 60
    assert backoff_seconds(20, 3) == 600


def publish_with_consumers(config, schema, counts):
    """`counts[table]` messages on each table's subject, behind its ClickHouse consumer."""
    from siphon_core.queue import JetStreamQueue, StreamSettings

    async def publish():
        queue = JetStreamQueue(config.queue.url, StreamSettings(config.application_identifier))
        await queue.connect()
        try:
            await queue.ensure_stream()
            for table, count in counts.items():
                subject = naming.table_subject(config.application_identifier, schema, table)
                await queue.ensure_consumer(naming.consumer_name("clickhouse", schema, table), subject)
                for index in range(count):
                    await queue.publish(subject, b"x", message_id=f"{table}-{index}")
        finally:
            await queue.close()

    asyncio.run(publish())


def test_streaming_sensor_records_the_pending_count(config):
    spec = table_specs(config)[0]
    publish_with_consumers(config, spec.schema, {spec.name: 3})
    defs = build_definitions(config)
    with instance_for_test() as instance:
        result = tick(defs, config, instance, "_streaming")
        assert json.loads(result.cursor)[streaming_job_name(config)]["pending"] == 3


def test_streaming_sensor_sums_each_groups_pending_over_its_own_tables_consumers(postgres_dsn, nats_url, unique_name):
    """One listing of the stream's consumers: each group counts its tables' consumers only, not a
    consumer of a table no longer configured, and a group none of whose consumers exists yet has
    no count."""
    raw = raw_config(postgres_dsn, nats_url, unique_name)
    raw["tables"] = [{"name": f"{unique_name}.{name}"} for name in ("hot", "warm", "cold", "idle")]
    raw["streaming"] = {"groups": {"hot": [f"{unique_name}.hot"], "quiet": [f"{unique_name}.idle"]}}
    config = parse_config(raw)
    publish_with_consumers(config, unique_name, {"hot": 2, "warm": 3, "cold": 1, "gone": 5})  # gone: not configured
    defs = build_definitions(config)
    with instance_for_test() as instance:
        cursor = json.loads(tick(defs, config, instance, "_streaming").cursor)
    assert cursor["stream_clickhouse__hot"]["pending"] == 2
    assert cursor["stream_clickhouse"]["pending"] == 3 + 1
    assert "pending" not in cursor["stream_clickhouse__quiet"]


def test_partitions_sensor_fails_a_snapshot_run_whose_worker_is_gone_and_keeps_a_live_one(config):
    defs = build_definitions(config)
    gone = gone_worker_identity()
    with instance_for_test() as instance:
        dead = create_run_for_test(instance, job_name="__ASSET_JOB", status=dg.DagsterRunStatus.STARTED,
                                   tags={WORKER_TAG: gone, SNAPSHOT_RUN_TAG: "true"})
        live = create_run_for_test(instance, job_name="__ASSET_JOB", status=dg.DagsterRunStatus.STARTED,
                                   tags={WORKER_TAG: worker_identity(), SNAPSHOT_RUN_TAG: "true"})
        tick(defs, config, instance, "_partitions")
        assert instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.FAILURE
        assert instance.get_run_by_id(live.run_id).status == dg.DagsterRunStatus.STARTED


def test_a_snapshot_run_is_tagged_with_the_process_that_runs_it(config):
    defs = build_definitions(config)
    spec = table_specs(config)[0]
    with instance_for_test() as instance:
        partitions_tick(defs, config, instance)
        key = instance.get_dynamic_partitions(spec.partitions_def_name)[0]
        # The ClickHouse target here is unreachable: the run fails, after it tagged itself.
        result = dg.materialize([defs.resolve_assets_def(spec.target_key("clickhouse"))], partition_key=key,
                                instance=instance, raise_on_error=False)
        run = instance.get_run_by_id(result.run_id)
        assert run.tags[SNAPSHOT_RUN_TAG] == "true" and run.tags[WORKER_TAG] == worker_identity()


def test_a_table_without_a_primary_key_holds_back_no_other_table(config, postgres_dsn):
    schema = table_specs(config)[0].schema
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create table {} (a int, b text)").format(sql.Identifier(schema, "keyless")))
    both = parse_config({**config.model_dump(), "tables": [t.model_dump() for t in config.tables]
                         + [{"name": f"{schema}.keyless"}]})
    defs = build_definitions(both)
    with instance_for_test() as instance:
        result = partitions_tick(defs, both, instance)
        assert [o.asset_key for o in result.asset_events] == [table_specs(both)[0].source_key]
        # The keyless table is refused, as the producer refuses it: no partitions for it, the other's go on.
        kept, keyless = table_specs(both)
        assert instance.get_dynamic_partitions(kept.partitions_def_name)
        assert instance.get_dynamic_partitions(keyless.partitions_def_name) == []


def with_tables(config, names, groups=None):
    """`config` with these tables (created when missing) in its schema, and these streaming groups."""
    schema = table_specs(config)[0].schema
    with psycopg.connect(config.source.dsn, autocommit=True) as connection:
        for name in names:
            connection.execute(sql.SQL("create table if not exists {} (id int primary key, body text)").format(
                sql.Identifier(schema, name)))
    raw = config.model_dump(by_alias=True)
    raw["tables"] = [{"name": f"{schema}.{name}"} for name in names]
    raw["streaming"] = {**raw["streaming"], "groups": {g: [f"{schema}.{t}" for t in ts]
                                                        for g, ts in (groups or {}).items()}}
    return parse_config(raw)


def test_first_tick_starts_one_run_per_target_and_group(config):
    grouped = with_tables(config, ["grows", "events", "orders"], groups={"hot": ["events"]})
    defs = build_definitions(grouped)
    with instance_for_test() as instance:
        result = tick(defs, grouped, instance, "_streaming")
        assert sorted(r.job_name for r in result.run_requests) == ["stream_clickhouse", "stream_clickhouse__hot"]
        schema = table_specs(grouped)[0].schema
        tables = {name: defs.resolve_job_def(name).tags["siphon/stream-tables"]
                  for name in ("stream_clickhouse", "stream_clickhouse__hot")}
        assert tables == {"stream_clickhouse": json.dumps([f"{schema}.grows", f"{schema}.orders"]),
                          "stream_clickhouse__hot": json.dumps([f"{schema}.events"])}
        # Each request names its group's tables itself: a daemon holding an older copy of the job
        # (the code location just reloaded) still makes the run with the tables it applies.
        requested = {r.job_name: r.tags.get("siphon/stream-tables") for r in result.run_requests}
        assert requested == tables
        assert {r.tags.get("siphon/stream-tables-hash") for r in result.run_requests} == \
            {defs.resolve_job_def(name).tags["siphon/stream-tables-hash"] for name in tables}


def test_a_run_serving_an_older_table_set_is_terminated_and_replaced_only_once_it_is_gone(config, worker):
    before = with_tables(config, ["grows", "events"])
    after = with_tables(config, ["grows", "events", "orders"])
    with instance_for_test() as instance:
        old = group_run(instance, before, tags={WORKER_TAG: worker.identity})
        defs = build_definitions(after)
        first = tick(defs, after, instance, "_streaming")
        assert first.run_requests == []
        # Termination was requested: the run is CANCELING until its worker stops.
        assert instance.get_run_by_id(old.run_id).status == dg.DagsterRunStatus.CANCELING
        assert json.loads(first.cursor)["stream_clickhouse"]["waiting_for"] == [old.run_id]
        # Still alive: no second run beside it, and no second termination request.
        assert tick(defs, after, instance, "_streaming", cursor=first.cursor).run_requests == []
        worker.stop()
        instance.report_run_canceled(instance.get_run_by_id(old.run_id))
        third = tick(defs, after, instance, "_streaming", cursor=first.cursor)
        assert [r.job_name for r in third.run_requests] == ["stream_clickhouse"]
        assert "waiting_for" not in json.loads(third.cursor)["stream_clickhouse"]



def test_a_run_launched_by_a_code_server_a_reload_replaced_is_terminated_and_started_again_here(
        config, worker, monkeypatch):
    """Its worker serves the current table set (it loaded siphon.yaml after the change), but the
    code server that launched it lives on until it ends."""
    with code_server_with_children() as (server, (replaced, current)), instance_for_test() as instance:
        # The sensor is evaluated by the code server now serving.
        monkeypatch.setattr(sensors, "replaced_launcher",
                            functools.partial(replaced_launcher, this_pid=current, parent_pid=server))
        defs = build_definitions(config)
        run = group_run(instance, config, tags={WORKER_TAG: worker.identity, LAUNCHER_TAG: worker_identity(replaced)})
        first = tick(defs, config, instance, "_streaming")
        assert first.run_requests == []
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.CANCELING
        assert tick(defs, config, instance, "_streaming", cursor=first.cursor).run_requests == []
        worker.stop()
        instance.report_run_canceled(instance.get_run_by_id(run.run_id))
        third = tick(defs, config, instance, "_streaming", cursor=first.cursor)
        assert [r.job_name for r in third.run_requests] == [streaming_job_name(config)]


def test_a_run_launched_by_the_code_server_now_serving_is_kept(config, worker, monkeypatch):
    with code_server_with_children() as (server, (_, current)), instance_for_test() as instance:
        monkeypatch.setattr(sensors, "replaced_launcher",
                            functools.partial(replaced_launcher, this_pid=current, parent_pid=server))
        run = group_run(instance, config, tags={WORKER_TAG: worker.identity, LAUNCHER_TAG: worker_identity(current)})
        result = tick(build_definitions(config), config, instance, "_streaming")
        assert result.run_requests == []
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED

def test_a_table_moved_to_another_group_waits_for_the_run_that_served_it(config):
    before = with_tables(config, ["grows", "events"])
    after = with_tables(config, ["grows", "events"], groups={"hot": ["events"]})
    with instance_for_test() as instance:
        old = group_run(instance, before, tags={WORKER_TAG: worker_identity()})
        result = tick(build_definitions(after), after, instance, "_streaming")
        # Both new groups hold a table the old run still applies.
        assert result.run_requests == []
        assert instance.get_run_by_id(old.run_id).status == dg.DagsterRunStatus.CANCELING
        state = json.loads(result.cursor)
        assert state["stream_clickhouse"]["waiting_for"] == state["stream_clickhouse__hot"]["waiting_for"] \
            == [old.run_id]


def test_a_run_of_a_group_no_longer_configured_is_terminated(config):
    before = with_tables(config, ["grows", "events"], groups={"hot": ["events"]})
    after = with_tables(config, ["grows", "events"])
    with instance_for_test() as instance:
        hot = group_run(instance, before, tags={WORKER_TAG: worker_identity()}, job_name="stream_clickhouse__hot")
        result = tick(build_definitions(after), after, instance, "_streaming")
        assert result.run_requests == []
        assert instance.get_run_by_id(hot.run_id).status == dg.DagsterRunStatus.CANCELING


def test_a_run_recorded_canceled_whose_worker_runs_on_holds_back_its_replacement(config, worker):
    """Run monitoring marks a run canceled once its cancellation times out, whether or not the
    worker stopped (a cancellation sent to a code server a reload replaced never reaches it): its
    tables' new run waits until that worker is gone."""
    defs = build_definitions(config)
    with instance_for_test() as instance:
        lingering = group_run(instance, config, tags={WORKER_TAG: worker.identity})
        instance.report_run_canceled(instance.get_run_by_id(lingering.run_id))
        result = tick(defs, config, instance, "_streaming")
        assert result.run_requests == []
        assert json.loads(result.cursor)[streaming_job_name(config)]["waiting_for"] == [lingering.run_id]
        worker.stop()
        assert [r.job_name for r in tick(defs, config, instance, "_streaming").run_requests] == \
            [streaming_job_name(config)]


def test_a_lingering_worker_is_interrupted_then_killed_over_the_sensor_s_ticks(config):
    """The sensor's cursor remembers when it interrupted a worker that outlived its run: a worker
    that ignores the interrupt is killed at a later tick, and its tables' new run starts."""
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == "ready"
        with instance_for_test() as instance:
            lingering = group_run(instance, config, tags={WORKER_TAG: worker_identity(stubborn.pid)})
            instance.report_run_canceled(instance.get_run_by_id(lingering.run_id))
            ended = time.time()
            interrupted_at = ended + sensors.LINGERING_AFTER_END_SECONDS + 1
            first = _tick_at(config, instance, interrupted_at)
            assert first.run_requests == []
            assert json.loads(first.cursor)[sensors.LINGERING_KEY] == {lingering.run_id: interrupted_at}
            time.sleep(0.5)
            assert stubborn.poll() is None  # interrupted, and it ignores that
            second = _tick_at(config, instance, interrupted_at + sensors.LINGERING_KILL_AFTER_SECONDS, cursor=first.cursor)
            assert stubborn.wait(10) == -9
            assert second.run_requests == []  # the worker was still there as the tick began
            third = _tick_at(config, instance, interrupted_at + sensors.LINGERING_KILL_AFTER_SECONDS + 15,
                             cursor=second.cursor)
            assert [r.job_name for r in third.run_requests] == [streaming_job_name(config)]
            assert sensors.LINGERING_KEY not in json.loads(third.cursor)
    finally:
        stubborn.kill()
        stubborn.wait()


def test_a_group_run_refuses_to_start_while_another_run_applies_its_tables(config):
    defs = build_definitions(config)
    with instance_for_test() as instance:
        live = group_run(instance, config, tags={WORKER_TAG: worker_identity()})
        job = defs.resolve_job_def(streaming_job_name(config))
        result = job.execute_in_process(instance=instance, raise_on_error=False,
                                        run_config={"ops": {job.graph.node_defs[0].name:
                                                            {"config": {"stop_when_drained": True}}}})
        assert not result.success
        message = result.failure_data_for_node(job.graph.node_defs[0].name).error.message
        assert live.run_id in message and table_specs(config)[0].qualified_name in message
        # It failed before it pulled anything: the live run's consumer is left alone.
        assert "siphon/worker" not in instance.get_run_by_id(result.run_id).tags


def test_a_single_table_run_by_hand_holds_back_the_group_run(config, worker):
    grouped = with_tables(config, ["grows", "events"])
    defs = build_definitions(grouped)
    spec = table_specs(grouped)[1]
    single = defs.resolve_job_def(spec.stream_job_name("clickhouse"))
    with instance_for_test() as instance:
        by_hand = create_run_for_test(instance, job_name=single.name, status=dg.DagsterRunStatus.STARTED,
                                      tags={**single.tags, WORKER_TAG: worker.identity})
        result = tick(defs, grouped, instance, "_streaming")
        assert result.run_requests == []
        assert json.loads(result.cursor)["stream_clickhouse"]["waiting_for"] == [by_hand.run_id]
        # The sensor never terminates a run started by hand; it waits for it to end.
        assert instance.get_run_by_id(by_hand.run_id).status == dg.DagsterRunStatus.STARTED
        worker.stop()
        instance.report_run_failed(instance.get_run_by_id(by_hand.run_id))
        assert [r.job_name for r in tick(defs, grouped, instance, "_streaming").run_requests] == ["stream_clickhouse"]


def test_a_single_table_run_refuses_to_start_while_a_group_run_serves_its_table(config):
    defs = build_definitions(config)
    spec = table_specs(config)[0]
    with instance_for_test() as instance:
        live = group_run(instance, config, tags={WORKER_TAG: worker_identity()})
        job = defs.resolve_job_def(spec.stream_job_name("clickhouse"))
        result = job.execute_in_process(instance=instance, raise_on_error=False,
                                        run_config={"ops": {f"apply_clickhouse_{spec.job_suffix}":
                                                            {"config": {"stop_when_drained": True}}}})
        assert not result.success
        failure = result.failure_data_for_node(f"apply_clickhouse_{spec.job_suffix}")
        message = failure.error.message
        assert live.run_id in message and "stream_clickhouse" in message and spec.qualified_name in message


def test_streaming_sensor_says_when_the_file_lists_tables_the_location_does_not_serve(
        config, tmp_path, postgres_dsn, nats_url, unique_name):
    path = tmp_path / "siphon.yaml"
    raw = raw_config(postgres_dsn, nats_url, unique_name)
    path.write_text(yaml.safe_dump(raw))
    defs = build_definitions(config, str(path))
    with instance_for_test() as instance:
        quiet = tick(defs, config, instance, "_streaming")
        assert "siphon.yaml" not in json.loads(quiet.cursor)

        raw["tables"].append({"name": f"{config.tables[0].schema_name}.newcomer"})
        path.write_text(yaml.safe_dump(raw))
        result = tick(defs, config, instance, "_streaming", cursor=quiet.cursor)

        stale = json.loads(result.cursor)["siphon.yaml"]
        assert f"tables added: {config.tables[0].schema_name}.newcomer" in stale and "reload or restart it" in stale
        # The run of the tables it was loaded with is still requested.
        assert [r.job_name for r in result.run_requests] == [streaming_job_name(config)]


def _sweep_tick(config, instance: dg.DagsterInstance, now: float, cursor: str | None) -> dg.SensorResult:
    """A tick of the streaming sensor, with its cursor, as if the clock read `now`."""
    defs = build_definitions(config)
    groups = stream_groups(config, table_specs(config))
    jobs = {group.key: defs.resolve_job_def(group.job_name) for group in groups}
    resyncs = ResyncRequests.of(defs.resolve_job_def(tables_resync_job_name(group_name(config.application_identifier))),
                                table_specs(config))
    sensor = build_streaming_sensor(groups, "later", jobs, failure_threshold=3, now=lambda: now, resyncs=resyncs)
    return sensor(dg.build_sensor_context(instance=instance, resources=build_resources(config), definitions=defs,
                                          cursor=cursor))


def _consumer_names(config) -> set[str]:
    async def names() -> set[str]:
        queue = build_resources(config)["queue"].queue()
        await queue.connect()
        try:
            await queue.ensure_stream()
            return {info.name for info in await queue.consumers()}
        finally:
            await queue.close()

    return asyncio.run(names())


def _make_consumers(config, tables: list[str]) -> None:
    async def make() -> None:
        queue = build_resources(config)["queue"].queue()
        await queue.connect()
        try:
            await queue.ensure_stream()
            for table in tables:
                schema, name = table.split(".")
                await queue.ensure_consumer(naming.consumer_name("clickhouse", schema, name),
                                            naming.table_subject(config.application_identifier, schema, name))
        finally:
            await queue.close()

    asyncio.run(make())


def test_a_removed_tables_consumer_is_recorded_then_deleted_once_idle_and_the_table_added_again_is_rebuilt(config):
    both = with_tables(config, ["kept", "Gone Ü-1"])
    schema = table_specs(both)[0].schema
    kept, gone = f"{schema}.kept", f"{schema}.Gone Ü-1"
    _make_consumers(both, [kept, gone])  # as the runs of both tables made them
    gone_consumer = naming.consumer_name("clickhouse", schema, "Gone Ü-1")
    gone_key = dg.AssetKey(naming.asset_key_path("clickhouse", schema, "Gone Ü-1"))
    only_kept = with_tables(config, ["kept"])
    start = time.time()
    with instance_for_test() as instance:
        # A run of the old table set still serves the removed table: nothing is recorded yet.
        old_run = group_run(instance, both)
        first = _sweep_tick(only_kept, instance, start, None)
        assert instance.fetch_observations(gone_key, limit=5).records == []
        instance.report_run_canceled(old_run)
        # Swept again 5 minutes on: the removal is recorded on the table's asset; the consumer,
        # active a moment ago, stays for now.
        second = _sweep_tick(only_kept, instance, start + CONSUMER_SWEEP_SECONDS, first.cursor)
        records = instance.fetch_observations(gone_key, limit=5).records
        assert len(records) == 1 and "no longer replicated" in records[0].asset_observation.description
        assert gone_consumer in _consumer_names(both)
        # Idle for 10 minutes: deleted. The configured table's consumer is never touched, nor
        # is the removal recorded twice.
        third = _sweep_tick(only_kept, instance, start + 3 * CONSUMER_SWEEP_SECONDS, second.cursor)
        names = _consumer_names(both)
        assert gone_consumer not in names and naming.consumer_name("clickhouse", schema, "kept") in names
        assert len(instance.fetch_observations(gone_key, limit=5).records) == 1
        assert [r for r in third.run_requests if RESYNC_TAG in r.tags] == []
        # The table is configured again: it missed every change made meanwhile, so it is rebuilt,
        # at the first tick that knows the new table list, not at the next 5-minute sweep.
        again = _sweep_tick(both, instance, start + 3 * CONSUMER_SWEEP_SECONDS + 15, third.cursor)
        resync = [r for r in again.run_requests if r.tags.get(RESYNC_TAG) == f"{schema}.Gone Ü-1"]
        assert len(resync) == 1 and resync[0].run_key
        assert resync[0].job_name == tables_resync_job_name(group_name(both.application_identifier))
        assert resync[0].run_config == {"ops": {"rebuild": {"config": {"table": f"{schema}.Gone Ü-1"}}}}
        latest = instance.fetch_observations(gone_key, limit=1).records[0].asset_observation
        assert "again" in latest.description and "resync" in latest.description
        # Requested once: the next sweep has nothing more to say about it, nor does one whose
        # cursor was reset (the asset records that the table came back).
        later = _sweep_tick(both, instance, start + 5 * CONSUMER_SWEEP_SECONDS, again.cursor)
        assert [r for r in later.run_requests if RESYNC_TAG in r.tags] == []
        group_run(instance, both)  # streaming: the reset cursor's tick below starts nothing, so it reads the records
        reset = _sweep_tick(both, instance, start + 6 * CONSUMER_SWEEP_SECONDS, None)
        assert reset.run_requests == [] and json.loads(reset.cursor).get("_removals_read") is True


def _one_of_two_removed(config, kept: str, removed: str):
    """Two tables with queue consumers, the configuration of both, its schema, and the
    configuration without `removed`."""
    both = with_tables(config, [kept, removed])
    schema = table_specs(both)[0].schema
    _make_consumers(both, [f"{schema}.{kept}", f"{schema}.{removed}"])
    return both, schema, with_tables(config, [kept])


def test_a_table_added_again_is_rebuilt_even_when_the_sensors_cursor_was_reset_meanwhile(config):
    both, schema, only_kept = _one_of_two_removed(config, "kept", "back")
    start = time.time()
    with instance_for_test() as instance:
        _sweep_tick(only_kept, instance, start, None)  # the removal is recorded on the asset
        key = dg.AssetKey(naming.asset_key_path("clickhouse", schema, "back"))
        assert "no longer replicated" in instance.fetch_observations(key, limit=1).records[0].asset_observation.description
        # The table comes back under a sensor that lost its cursor (renamed, reset by hand). A tick
        # that starts the streaming run leaves the read of every table's records to a later one.
        starting = _sweep_tick(both, instance, start + 60, None)
        assert [r.job_name for r in starting.run_requests] == [streaming_job_name(both)]
        group_run(instance, both)
        again = _sweep_tick(both, instance, start + 75, starting.cursor)
        assert [r.tags[RESYNC_TAG] for r in again.run_requests] == [f"{schema}.back"]
        assert _sweep_tick(both, instance, start + 90, again.cursor).run_requests == []


def test_a_reset_cursor_reads_the_tables_removal_records_a_few_tables_a_tick(config, monkeypatch):
    monkeypatch.setattr(sensors, "REMOVAL_READS_PER_TICK", 1)
    both, schema, only_early = _one_of_two_removed(config, "early", "late")
    start = time.time()
    with instance_for_test() as instance:
        _sweep_tick(only_early, instance, start, None)  # the removal of `late` is recorded on its asset
        group_run(instance, both)
        # A lost cursor: each quiet tick reads one table's records, in the order of their ids.
        first = _sweep_tick(both, instance, start + 60, None)
        assert first.run_requests == []
        assert json.loads(first.cursor)["_removals_read"] == f"clickhouse:{schema}.late"
        second = _sweep_tick(both, instance, start + 75, first.cursor)
        assert [r.tags[RESYNC_TAG] for r in second.run_requests] == [f"{schema}.late"]
        assert json.loads(second.cursor)["_removals_read"] is True
        assert _sweep_tick(both, instance, start + 90, second.cursor).run_requests == []


def test_tables_are_read_in_one_query_each_and_a_bad_table_holds_back_no_other(postgres_dsn, unique_name):
    """Sensors read every table's columns and size at once: a missing table, one without a primary
    key and one whose exclude_columns names no column are reported by name, the others are read,
    a partitioned table is sized by its largest leaf, and odd names are matched exactly."""
    def ident(*names):
        return sql.Identifier(unique_name, *names) if names else sql.Identifier(unique_name)

    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(ident()))
        connection.execute(sql.SQL('create table {} ("Id" bigint primary key, "a b" text, n numeric(9, 2))')
                           .format(ident("Odd Table")))
        connection.execute(sql.SQL("insert into {} select g, repeat('x', 300), g from generate_series(1, 500) g")
                           .format(ident("Odd Table")))
        connection.execute(sql.SQL("create table {} (id int primary key, note text)").format(ident("odd table")))
        connection.execute(sql.SQL("create table {} (id int, v text)").format(ident("keyless")))
        connection.execute(sql.SQL("create table {} (id int primary key)").format(ident("excluded")))
        connection.execute(sql.SQL("create table {} (id int, k int, primary key (id, k)) partition by range (k)")
                           .format(ident("parted")))
        connection.execute(sql.SQL("create table {} partition of {} for values from (0) to (10)")
                           .format(ident("parted_small"), ident("parted")))
        connection.execute(sql.SQL("create table {} partition of {} for values from (10) to (100)")
                           .format(ident("parted_large"), ident("parted")))
        connection.execute(sql.SQL("insert into {} select g, 10 + g % 90 from generate_series(1, 3000) g")
                           .format(ident("parted")))
        connection.execute(sql.SQL("analyze {}").format(ident("parted")))
        large_blocks = connection.execute("select pg_relation_size(%s::regclass) / 8192",
                                          (f'{unique_name}.parted_large',)).fetchone()[0]

        tables = {
            "odd": TableConfig(name=f"{unique_name}.Odd Table"),
            "lower": TableConfig(name=f"{unique_name}.odd table", exclude_columns=["note"]),
            "missing": TableConfig(name=f"{unique_name}.nowhere"),
            "keyless": TableConfig(name=f"{unique_name}.keyless"),
            "excluded": TableConfig(name=f"{unique_name}.excluded", exclude_columns=["no such"]),
            "parted": TableConfig(name=f"{unique_name}.parted"),
        }
        schemas = source.table_schemas(connection, list(tables.values()))
        sizes = source.table_sizes(connection, list(tables.values()))

    odd = schemas[tables["odd"].name]
    assert [c.name for c in odd.columns] == ["Id", "a b", "n"] and odd.columns[0].primary_key
    assert sizes[tables["odd"].name].blocks >= 1 and sizes[tables["odd"].name].bytes > 0
    assert [c.name for c in schemas[tables["lower"].name].columns] == ["id"]  # "note" excluded
    assert "not found in the source database" in str(schemas[tables["missing"].name])
    assert "not found in the source database" in str(sizes[tables["missing"].name])
    assert "has no primary key" in str(schemas[tables["keyless"].name])
    assert "exclude_columns names columns that do not exist: ['no such']" in str(schemas[tables["excluded"].name])
    parted = sizes[tables["parted"].name]
    assert parted.blocks == large_blocks and parted.row_estimate == 3000
    assert [c.name for c in schemas[tables["parted"].name].columns] == ["id", "k"]

    # The sensors' read: the good tables read, each bad one reported once, by name.
    specs = _specs_of(tables.values())
    errors: list[str] = []
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        read = sensors.read_tables(connection, specs, on_error=lambda error: errors.append(str(error)))
    assert sorted(read) == sorted(s.qualified_name for s in specs
                                  if s.table.name in (tables["odd"].name, tables["lower"].name, tables["parted"].name))
    assert len(errors) == 3 and all(unique_name in e for e in errors)
    with psycopg.connect(postgres_dsn, autocommit=True) as connection, \
            pytest.raises(source.SourceError, match="not found in the source database"):
        sensors.read_tables(connection, specs)


def _specs_of(tables):
    config = parse_config({
        "application_identifier": "reads",
        "source": {"dsn": "postgresql://127.0.0.1:1/x"},
        "queue": {"url": "nats://127.0.0.1:1"},
        "tables": [{"name": t.name, "exclude_columns": list(t.exclude_columns)} for t in tables],
        "targets": {"clickhouse": {"url": "http://127.0.0.1:1"}},
    })
    return table_specs(config)
