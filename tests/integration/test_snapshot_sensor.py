"""The snapshot sensor, one test per cursor scenario, on a test instance against real PostgreSQL and
the embedded ClickHouse; the runs it asks for are executed for real."""

import json
import time

import dagster as dg
import psycopg
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from dagster._core.test_utils import create_run_for_test
from psycopg import sql

from siphon_core import naming
from siphon_core.config import parse_config
from siphon_dagster import shared_loads, snapshot_sensor, source
from siphon_dagster.assets import first_loads_key, snapshot_pool
from siphon_dagster.definitions import build_definitions, build_resources
from siphon_dagster.shared_loads import ALONE_KEY, BATCHED_KEY, MISSED_KEY
from siphon_dagster.snapshot_sensor import (
    AUTOLOAD_TAG,
    DROPPED_METADATA,
    LOAD_TAG,
    SENSOR_LOAD_TAG,
    build_snapshot_sensor,
    record_drop,
)
from siphon_dagster.specs import table_specs
from siphon_dagster.stream_groups import stream_groups
from siphon_dagster.targets.clickhouse import ClickHouseTarget
from tests.helpers.instance import instance_for_test


def make_config(postgres_dsn, nats_url, clickhouse_url, schema, **snapshots):
    return parse_config({
        "application_identifier": schema,
        "source": {"dsn": postgres_dsn},
        "queue": {"url": nats_url},
        "tables": [{"name": f"{schema}.items", "blocks_per_partition": 4}],
        "targets": {"clickhouse": {"url": clickhouse_url, "database": schema}},
        "snapshots": {"retry_delay_seconds": 0, **snapshots},
    })


@pytest.fixture
def config(postgres_dsn, nats_url, clickhouse_url, unique_name):
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        connection.execute(sql.SQL("create table {} (id int primary key, body text)").format(
            sql.Identifier(unique_name, "items")))
        connection.execute(sql.SQL("insert into {} select g, repeat('x', 200) from generate_series(1, 300) g")
                           .format(sql.Identifier(unique_name, "items")))
    return make_config(postgres_dsn, nats_url, clickhouse_url, unique_name)


CHECK = "row_count_matches"


class Harness:
    """One sensor on one instance: ticks carry the cursor on, as the daemon does."""

    def __init__(self, config, instance, source_dsn=None, **sensor_options):
        self.config = config
        self.instance = instance
        self.defs = build_definitions(config)
        self.spec = table_specs(config)[0]
        self.key = self.spec.target_key("clickhouse")
        self.check_key = dg.AssetCheckKey(self.key, CHECK)
        self.sensor = build_snapshot_sensor(table_specs(config), "test", config.snapshots,
                                            {self.key: [self.check_key]},
                                            **{"table_check_seconds": 0, **sensor_options})
        self.cursor = None
        # Runs that fail as they would while the source is down: same assets, a source that refuses.
        broken = config.model_copy(update={"source": config.source.model_copy(
            update={"dsn": "postgresql://siphon@127.0.0.1:1/none?connect_timeout=2", "snapshot_retry_seconds": 0})})
        self.broken_defs = build_definitions(broken)

    def tick(self):
        context = dg.build_sensor_context(instance=self.instance, cursor=self.cursor,
                                          resources=build_resources(self.config), definitions=self.defs)
        result = self.sensor(context)
        assert not result.dynamic_partitions_requests  # a tick adds the partitions it needs itself
        for event in result.asset_events:
            self.instance.report_runless_asset_event(event)
        self.cursor = result.cursor
        return result

    @property
    def keys(self):
        return self.keys_of(self.spec)

    def keys_of(self, spec):
        return self.instance.get_dynamic_partitions(spec.partitions_def_name)

    def run(self, request, broken=False):
        """A requested run, executed as the daemon would launch it."""
        defs = self.broken_defs if broken else self.defs
        return dg.materialize([defs.resolve_assets_def(request.asset_selection[0])], partition_key=request.partition_key,
                              instance=self.instance, tags=request.tags, raise_on_error=False)

    def entry(self):
        return json.loads(self.cursor)[f"clickhouse:{self.spec.qualified_name}"]

    def target(self):
        return ClickHouseTarget(self.config.targets.clickhouse)

    def load_everything(self):
        """Ticks, runs every load it asks for (each must succeed) and ticks again to see them done;
        returns the first tick."""
        first = self.tick()
        assert all(self.run(request).success for request in first.run_requests)
        self.tick()
        return first

    def drop_at_target(self):
        """The table dropped at ClickHouse behind Siphon's back (nothing recorded)."""
        target = self.target()
        try:
            target.drop_table(self.table())
        finally:
            target.close()

    def table(self):
        with source.connect(self.config.source.dsn) as connection:
            return source.table_schema(connection, self.spec.table)


def state(result):
    [observation] = result.asset_events
    return observation.metadata["siphon/state"].value


def test_first_tick_requests_every_partition_of_a_new_table_even_when_the_stream_made_its_table(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        target = harness.target()
        try:
            # The streaming run creates the table at its first change: that is not a load.
            target.ensure_table(harness.table())
        finally:
            target.close()
        result = harness.tick()
        # The partitions sensor has not run yet: this tick adds them itself, and asks for each.
        added = harness.keys
        assert len(added) >= 2
        assert [r.partition_key for r in result.run_requests] == added
        for request in result.run_requests:
            assert request.asset_selection == [harness.key]
            assert request.tags[AUTOLOAD_TAG] == f"clickhouse:{harness.spec.qualified_name}"
        assert state(result) == f"snapshotting: 0 of {len(added)} partitions loaded"
        assert "load" in harness.entry()


def test_a_tick_that_requests_loads_gives_the_target_pool_its_default_limit_and_keeps_one_set_by_hand(config):
    """The run queue holds a pool's runs only once it knows the pool's limit: set before the
    first loads queue, they start two at a time instead of all at once."""
    pool = snapshot_pool("clickhouse")
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 2}}}) as instance:
        assert pool not in instance.event_log_storage.get_concurrency_keys()
        assert Harness(config, instance).tick().run_requests
        assert instance.event_log_storage.get_concurrency_info(pool).slot_count == 2
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 2}}}) as instance:
        instance.event_log_storage.set_concurrency_slots(pool, 5)
        assert Harness(config, instance).tick().run_requests
        assert instance.event_log_storage.get_concurrency_info(pool).slot_count == 5


def test_the_daemon_accepts_requests_for_partitions_the_tick_added(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        repository = harness.defs.get_repository_def()
        # As the daemon's code server builds it: from the instance's ref, so that partition keys
        # are checked against the instance and this tick's own additions.
        with dg.SensorEvaluationContext(
                instance_ref=instance.get_ref(), last_tick_completion_time=None, last_run_key=None, cursor=None,
                log_key=None, repository_name=repository.name, repository_def=repository,
                sensor_name=harness.sensor.name, resources=build_resources(config)) as context:
            data = harness.sensor.evaluate_tick(context)
        keys = harness.keys
        assert keys and not data.dynamic_partitions_requests
        assert [r.partition_key for r in data.run_requests] == keys
        assert all(r.tags["dagster/partition"] == r.partition_key for r in data.run_requests)


def test_runs_of_the_load_in_progress_are_not_requested_twice(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        first = harness.tick()
        for request in first.run_requests:  # submitted by the daemon, not started yet
            create_run_for_test(instance, job_name="__ASSET_JOB", status=dg.DagsterRunStatus.NOT_STARTED,
                                tags={**request.tags, "dagster/partition": request.partition_key})
        second = harness.tick()
        assert second.run_requests == []
        assert "load" in harness.entry()


def test_a_new_table_loads_by_itself_equal_to_the_source_and_then_nothing_is_requested(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        first = harness.tick()
        assert first.run_requests
        assert all(harness.run(request).success for request in first.run_requests)
        loaded = harness.tick()
        assert loaded.run_requests == [] and state(loaded) == "loaded"
        assert "load" not in harness.entry()
        target = harness.target()
        try:
            table = harness.table()
            assert sorted(target.current_rows_as_text(table)) == sorted(
                tuple(str(v) for v in row) for row in source_rows(config.source.dsn, table))
        finally:
            target.close()
        # Nothing new: nothing requested, and no observation, since the state did not change.
        quiet = harness.tick()
        assert quiet.run_requests == [] and quiet.asset_events == []


def source_rows(dsn, table):
    with psycopg.connect(dsn) as connection:
        return connection.execute(sql.SQL("select id::text, body from {}").format(
            sql.Identifier(table.schema, table.table))).fetchall()


def test_a_table_loaded_by_hand_is_not_reloaded(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        with psycopg.connect(config.source.dsn) as connection:
            blocks = source.table_size(connection, harness.spec.table).blocks
        from siphon_dagster.partitions import ranges_for
        keys = [r.key for r in ranges_for(blocks, 4)]
        instance.add_dynamic_partitions(harness.spec.partitions_def_name, keys)
        # A CLI backfill of every partition, one run for the range.
        result = dg.materialize([harness.defs.resolve_assets_def(harness.key)], instance=instance,
                                tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]})
        assert result.success
        tick = harness.tick()
        assert tick.run_requests == [] and state(tick) == "loaded"
        assert tick.asset_events[0].metadata["siphon/partitions_loaded"].value == len(keys)


def test_a_failed_range_is_retried_per_partition_up_to_the_limit_then_shown_failed(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        harness.tick()  # adds the partitions and asks for the load
        keys = harness.keys
        # The measured case: the source restarts during a CLI backfill, and the whole range fails.
        broken = harness.broken_defs.resolve_assets_def(harness.key)
        failed = dg.materialize([broken], instance=instance, raise_on_error=False,
                                tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]})
        assert not failed.success
        for attempt in (2, 3):
            tick = harness.tick()
            assert sorted(r.partition_key for r in tick.run_requests) == sorted(keys)
            assert {r.tags["siphon/attempt"] for r in tick.run_requests} == {str(attempt)}
            assert not any(harness.run(request, broken=True).success for request in tick.run_requests)
        given_up = harness.tick()
        assert given_up.run_requests == []
        text = state(given_up)
        assert text.startswith(f"{len(keys)} partitions failed after 3 attempts: {keys[0]}")
        assert given_up.asset_events[0].metadata["siphon/partitions_failed"].value == dict.fromkeys(keys, 3)
        assert harness.tick().run_requests == []
        # An operator runs one again once the source is back: it is loaded and forgotten.
        assert dg.materialize([harness.defs.resolve_assets_def(harness.key)], partition_key=keys[0],
                              instance=instance).success
        harness.tick()
        assert set(harness.entry()["failed"]) == set(keys[1:])


def test_a_partition_that_succeeds_on_retry_completes_the_load(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        first = harness.tick()
        outcomes = [harness.run(request, broken=index == 0) for index, request in enumerate(first.run_requests)]
        assert [o.success for o in outcomes] == [False] + [True] * (len(outcomes) - 1)
        retry = harness.tick()
        assert [r.partition_key for r in retry.run_requests] == [first.run_requests[0].partition_key]
        assert harness.run(retry.run_requests[0]).success
        assert state(harness.tick()) == "loaded"


def test_a_table_missing_at_the_target_is_loaded_again(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        first = harness.load_everything()
        harness.drop_at_target()
        again = harness.tick()
        assert sorted(r.partition_key for r in again.run_requests) == sorted(harness.keys)
        assert {r.tags[LOAD_TAG] for r in again.run_requests} != {r.tags[LOAD_TAG] for r in first.run_requests}


def test_a_table_dropped_by_the_operator_is_loaded_again_even_if_the_stream_made_it_anew(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        harness.load_everything()
        target = harness.target()
        try:
            target.drop_table(harness.table())
            record_drop(instance, harness.key, "the table")
            target.ensure_table(harness.table())  # the stream's next batch creates it, empty
        finally:
            target.close()
        again = harness.tick()
        assert sorted(r.partition_key for r in again.run_requests) == sorted(harness.keys)
        assert all(harness.run(request).success for request in again.run_requests)
        assert state(harness.tick()) == "loaded"
        assert harness.tick().run_requests == []


def test_a_drop_loads_again_the_ranges_filled_after_the_load_too(config):
    """A range the table grew into after its load holds rows only the stream wrote: a drop took them too."""
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        harness.load_everything()
        loaded = set(harness.keys)
        with psycopg.connect(config.source.dsn, autocommit=True) as connection:
            connection.execute(sql.SQL("insert into {} select g, repeat('y', 200) from generate_series(301, 900) g")
                               .format(sql.Identifier(harness.spec.schema, "items")))
        with source.connect(config.source.dsn) as connection:
            requests, _ = snapshot_sensor.partition_requests(instance, connection, [harness.spec])
        for request in requests:  # what the partitions sensor adds; the stream fills those ranges
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        grown = set(harness.keys) - loaded
        assert grown
        harness.drop_at_target()
        record_drop(instance, harness.key, "the table")
        again = harness.tick()
        assert sorted(r.partition_key for r in again.run_requests) == sorted(harness.keys)


def test_a_settled_table_is_looked_at_again_after_its_interval_or_at_once_when_an_event_wakes_it(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance, settled_look_seconds=2.0)
        first = harness.tick()
        assert "settled_at" not in harness.entry()  # a load is asked for: looked at every tick
        assert all(harness.run(request).success for request in first.run_requests)
        assert state(harness.tick()) == "loaded"
        settled_at = harness.entry()["settled_at"]
        # Gone from the target with nothing recorded: only a look finds it, after the interval.
        harness.drop_at_target()
        quiet = harness.tick()
        assert quiet.run_requests == [] and quiet.asset_events == []
        assert harness.entry()["settled_at"] == settled_at
        time.sleep(2.1)
        again = harness.tick()
        assert sorted(r.partition_key for r in again.run_requests) == sorted(harness.keys)
        assert "settled_at" not in harness.entry()
        assert all(harness.run(request).success for request in again.run_requests)
        assert state(harness.tick()) == "loaded"
        settled_at = harness.entry()["settled_at"]

        # A recorded drop wakes it for the next tick, within the interval.
        record_drop(instance, harness.key, "the table")
        woken = harness.tick()
        assert sorted(r.partition_key for r in woken.run_requests) == sorted(harness.keys)
        assert all(harness.run(request).success for request in woken.run_requests)
        assert state(harness.tick()) == "loaded"

        # So does a run of one of its partitions that failed (an operator's, say): retried at once.
        key = harness.keys[0]
        assert not harness.run(dg.RunRequest(asset_selection=[harness.key], partition_key=key), broken=True).success
        retried = harness.tick()
        assert [r.partition_key for r in retried.run_requests] == [key]
        assert harness.entry()["failed"][key]["attempts"] == 2

        # Events of other assets wake nothing.
        assert all(harness.run(request).success for request in retried.run_requests)
        assert state(harness.tick()) == "loaded"
        settled_at = harness.entry()["settled_at"]
        instance.report_runless_asset_event(dg.AssetObservation(
            asset_key=dg.AssetKey(["elsewhere"]), metadata={DROPPED_METADATA: True}))
        harness.drop_at_target()
        assert harness.tick().run_requests == []
        assert harness.entry()["settled_at"] == settled_at


def test_more_events_than_a_tick_reads_wake_every_settled_table(config, monkeypatch):
    with instance_for_test() as instance:
        harness = Harness(config, instance, settled_look_seconds=600.0)
        harness.load_everything()
        settled_at = harness.entry()["settled_at"]
        monkeypatch.setattr(snapshot_sensor.WakeUps, "PAGE", 1)
        monkeypatch.setattr(snapshot_sensor.WakeUps, "MAX_PAGES", 2)
        for name in ("a", "b", "c"):  # drops of other assets, more than the tick reads
            instance.report_runless_asset_event(dg.AssetObservation(
                asset_key=dg.AssetKey(["elsewhere", name]), metadata={DROPPED_METADATA: True}))
        harness.drop_at_target()
        woken = harness.tick()  # looked at: the table missing at its target is loaded again
        assert sorted(r.partition_key for r in woken.run_requests) == sorted(harness.keys)
        assert harness.entry().get("settled_at") != settled_at


def with_a_second_table(config, postgres_dsn):
    """The configuration with a second table, `other`, made at the source: (config, specs, definitions)."""
    schema = config.application_identifier
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create table {} (id int primary key)").format(sql.Identifier(schema, "other")))
    both = parse_config({**config.model_dump(by_alias=True),
                         "tables": [t.model_dump() for t in config.tables] + [{"name": f"{schema}.other"}]})
    return both, table_specs(both), build_definitions(both)


def test_new_tables_whose_partitions_a_tick_had_no_time_to_add_are_loaded_from_the_next(config, postgres_dsn,
                                                                                       monkeypatch):
    both, specs, defs = with_a_second_table(config, postgres_dsn)
    monkeypatch.setattr(snapshot_sensor, "ADD_PARTITIONS_SECONDS", 0.0)
    sensor = build_snapshot_sensor(specs, "test", both.snapshots)
    with instance_for_test() as instance:
        def tick(cursor):
            return sensor(dg.build_sensor_context(instance=instance, cursor=cursor, resources=build_resources(both),
                                                  definitions=defs))

        def loads(result):
            return {r.tags[AUTOLOAD_TAG] for r in result.run_requests}

        first = tick(None)
        # One table's partitions added, and its loads asked for; the other has none yet and waits.
        assert [bool(instance.get_dynamic_partitions(spec.partitions_def_name)) for spec in specs] == [True, False]
        assert loads(first) == {f"clickhouse:{specs[0].qualified_name}"}
        second = tick(first.cursor)
        assert all(instance.get_dynamic_partitions(spec.partitions_def_name) for spec in specs)
        assert f"clickhouse:{specs[1].qualified_name}" in loads(second)


def test_a_tick_out_of_time_leaves_the_next_tables_to_the_next_tick(config, postgres_dsn, monkeypatch):
    both, specs, defs = with_a_second_table(config, postgres_dsn)
    sensor = build_snapshot_sensor(specs, "test", both.snapshots, tick_budget_seconds=0)
    with instance_for_test() as instance:
        read_partitions = instance.get_dynamic_partitions
        partitions_read: list[str] = []

        def counted(name: str) -> list[str]:
            partitions_read.append(name)
            return read_partitions(name)

        monkeypatch.setattr(instance, "get_dynamic_partitions", counted)
        cursor, asked, read = None, [], []
        for _ in range(3):
            partitions_read.clear()
            result = sensor(dg.build_sensor_context(instance=instance, cursor=cursor, resources=build_resources(both),
                                                    definitions=defs))
            cursor = result.cursor
            asked.append({r.tags[AUTOLOAD_TAG] for r in result.run_requests})
            read.append(set(partitions_read))
        # One table a tick, each in its turn; a load asked for stays asked (its runs are never made here).
        assert asked[0] == {f"clickhouse:{specs[0].qualified_name}"}
        assert asked[1] == {f"clickhouse:{specs[1].qualified_name}"}
        # A tick reads the partitions of the tables it looks at, none of the others.
        assert read[:2] == [{specs[0].partitions_def_name}, {specs[1].partitions_def_name}]
        assert json.loads(cursor)["_resume"] == f"clickhouse:{specs[1].qualified_name}"


def test_a_first_start_looks_at_new_tables_within_the_budget_and_adds_every_partition(config, postgres_dsn,
                                                                                       monkeypatch):
    both, specs, defs = with_a_second_table(config, postgres_dsn)
    looked_at = snapshot_sensor._tick_table

    def slow_look(*args, **kwargs):  # each look outlasts the budget
        time.sleep(0.3)
        return looked_at(*args, **kwargs)

    monkeypatch.setattr(snapshot_sensor, "_tick_table", slow_look)
    sensor = build_snapshot_sensor(specs, "test", both.snapshots, tick_budget_seconds=0.2)
    with instance_for_test() as instance:
        first = sensor(dg.build_sensor_context(instance=instance, resources=build_resources(both), definitions=defs))
        # Both tables are new: the first is looked at (a load asked for), the second waits, and
        # both get their partitions now.
        assert {r.tags[AUTOLOAD_TAG] for r in first.run_requests} == {f"clickhouse:{specs[0].qualified_name}"}
        assert all(instance.get_dynamic_partitions(spec.partitions_def_name) for spec in specs)
        assert json.loads(first.cursor)["_resume"] == f"clickhouse:{specs[1].qualified_name}"
        second = sensor(dg.build_sensor_context(instance=instance, cursor=first.cursor, resources=build_resources(both),
                                                definitions=defs))
        assert f"clickhouse:{specs[1].qualified_name}" in {r.tags[AUTOLOAD_TAG] for r in second.run_requests}


def test_an_unreachable_target_requests_nothing_and_fails_no_tick(config, postgres_dsn, nats_url):
    unreachable = make_config(postgres_dsn, nats_url, "http://127.0.0.1:1", config.application_identifier)
    with instance_for_test() as instance:
        harness = Harness(unreachable, instance)
        result = harness.tick()
        assert result.run_requests == [] and state(result) == "not loaded"
        assert harness.keys  # the partitions still come


def test_the_state_shows_streaming_lag_and_check_results(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        harness.tick()
        instance.report_runless_asset_event(dg.AssetMaterialization(
            asset_key=harness.key, metadata={"applied_lsn": "0/16B3748", "lag_seconds": 1.5}))
        instance.report_runless_asset_event(dg.AssetCheckEvaluation(
            asset_key=harness.key, check_name=CHECK, passed=False, severity=dg.AssetCheckSeverity.ERROR))
        group = next(g for g in stream_groups(config, table_specs(config)) if g.target == "clickhouse")
        create_run_for_test(instance, job_name=group.job_name, status=dg.DagsterRunStatus.STARTED, tags=group.tags)
        metadata = harness.tick().asset_events[0].metadata
        assert metadata["siphon/checks"].value == {CHECK: "failed (error)"}
        assert metadata["siphon/streaming"].value == "running"
        assert metadata["siphon/applied_lsn"].value == "0/16B3748"
        assert metadata["siphon/lag_seconds"].value == 1.5
        # The lag moves with every batch: that alone records nothing.
        instance.report_runless_asset_event(dg.AssetMaterialization(
            asset_key=harness.key, metadata={"applied_lsn": "0/16B4000", "lag_seconds": 0.7}))
        assert harness.tick().asset_events == []


def test_a_run_starting_records_no_state_until_it_runs(config):
    with instance_for_test() as instance:
        harness = Harness(config, instance)
        assert harness.tick().asset_events[0].metadata["siphon/streaming"].value == "not running"
        group = next(g for g in stream_groups(config, table_specs(config)) if g.target == "clickhouse")
        run = create_run_for_test(instance, job_name=group.job_name, status=dg.DagsterRunStatus.NOT_STARTED,
                                  tags=group.tags)
        # Starting: a state of seconds, not recorded, and the table not set aside as settled.
        assert harness.tick().asset_events == []
        assert "settled_at" not in harness.entry()
        instance.handle_run_event(run.run_id, dg.DagsterEvent(
            event_type_value=dg.DagsterEventType.RUN_START.value, job_name=group.job_name))
        [event] = harness.tick().asset_events
        assert event.metadata["siphon/streaming"].value == "running"


def test_a_tick_records_at_most_its_number_of_states_and_the_rest_at_the_next(config, postgres_dsn):
    both, specs, defs = with_a_second_table(config, postgres_dsn)
    sensor = build_snapshot_sensor(specs, "test", both.snapshots, state_events_per_tick=1)
    names = [f"clickhouse:{spec.qualified_name}" for spec in specs]
    with instance_for_test() as instance:
        def tick(cursor):
            return sensor(dg.build_sensor_context(instance=instance, cursor=cursor, resources=build_resources(both),
                                                  definitions=defs))

        first = tick(None)
        assert [e.asset_key for e in first.asset_events] == [specs[0].target_key("clickhouse")]
        entries = json.loads(first.cursor)
        assert "state" in entries[names[0]] and "state" not in entries[names[1]]
        assert "settled_at" not in entries[names[1]]  # looked at again next tick
        second = tick(first.cursor)
        assert [e.asset_key for e in second.asset_events] == [specs[1].target_key("clickhouse")]
        assert tick(second.cursor).asset_events == []


def stream_job_of(config, runner, schema):
    """The job that streams `items` (the group run's, or the single-table drain's) and its op."""
    if runner == "group run":
        [group] = stream_groups(config, table_specs(config))
        job_name, op = group.job_name, group.op_name
    else:
        job_name = naming.stream_job_name("clickhouse", schema, "items")
        op = f"apply_clickhouse_{naming.job_suffix(schema, 'items')}"
    return build_definitions(config).resolve_job_def(job_name), op


@pytest.mark.parametrize("runner", ["group run", "single-table drain"])
def test_a_table_new_at_its_target_made_by_the_stream_wakes_no_sensor(app, clickhouse_url, runner):
    """Nothing of the table was ever materialized: the stream's first batch makes it as a new
    table, with no signal to load it again (the sensor loads a new table on its own, or not at all
    with loads off), and the run's log says it is new."""
    app.sql("create table {schema}.items (id int primary key, body text)")
    app.producer(["items"])
    config = make_config(app.dsn, app.nats_url, clickhouse_url, app.schema)
    job, op = stream_job_of(config, runner, app.schema)
    app.sql("insert into {schema}.items values (1, 'first')")
    app.wait_for_events(1, "items")
    with instance_for_test() as instance:
        result = job.execute_in_process(run_config={"ops": {op: {"config": {"stop_when_drained": True}}}},
                                        instance=instance)
        assert result.success
        observations = instance.all_logs(result.run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION)
        assert observations == []
        lines = [entry.user_message for entry in instance.all_logs(result.run_id)]
        assert [line for line in lines if "new at clickhouse" in line and f"{app.schema}.items" in line], "\n".join(lines)
        assert not [line for line in lines if "no table at clickhouse" in line], lines
        target = ClickHouseTarget(config.targets.clickhouse)
        try:
            with source.connect(config.source.dsn) as connection:
                table = source.table_schema(connection, table_specs(config)[0].table)
            assert target.current_rows_as_text(table) == [("1", "first")]
        finally:
            target.close()


@pytest.mark.parametrize("runner", ["group run", "single-table drain"])
def test_a_table_the_target_lost_is_loaded_again_when_the_stream_makes_it_anew(app, clickhouse_url, runner):
    """No drop recorded: the table vanished at the target (dropped by hand, a database replaced)
    and the stream's next batch made it again, empty, before the sensor looked for it there."""
    app.sql("create table {schema}.items (id int primary key, body text)")
    app.sql("insert into {schema}.items select g, repeat('x', 200) from generate_series(1, 300) g")
    app.producer(["items"])
    config = make_config(app.dsn, app.nats_url, clickhouse_url, app.schema)
    job, op = stream_job_of(config, runner, app.schema)

    made_lines: list[str] = []

    def drain(instance):
        result = job.execute_in_process(run_config={"ops": {op: {"config": {"stop_when_drained": True}}}},
                                        instance=instance)
        assert result.success
        made_lines.extend(entry.user_message for entry in instance.all_logs(result.run_id)
                          if "no table at clickhouse" in entry.user_message)
        # The run writes its events to the event log and keeps none for its end (op_events).
        return [entry.dagster_event.event_specific_data.asset_observation
                for entry in instance.all_logs(result.run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION)]

    with instance_for_test() as instance:
        # The presence check is minutes away, and a settled table is looked at every tick here.
        harness = Harness(config, instance, table_check_seconds=600, settled_look_seconds=0)
        harness.load_everything()
        app.sql("update {schema}.items set body = 'changed' where id = 1")
        app.wait_for_events(1, "items")
        assert drain(instance) == []  # the table was there: nothing to say

        harness.drop_at_target()
        app.sql("insert into {schema}.items values (301, 'after the loss')")
        app.wait_for_events(2, "items")
        [observation] = drain(instance)
        assert observation.metadata[DROPPED_METADATA].value is True
        assert "the stream made it" in observation.description
        # The run's log says so once, naming the table (a group run names every table it made in one line).
        [line] = made_lines
        assert f"{app.schema}.items" in line, line

        again = harness.tick()
        assert sorted(r.partition_key for r in again.run_requests) == sorted(harness.keys)
        assert all(harness.run(request).success for request in again.run_requests)
        assert state(harness.tick()) == "loaded"
        table = harness.table()
        target = harness.target()
        try:
            assert target.current_rows_as_text(table) == app.rows_as_text(table)
            assert len(target.current_rows_as_text(table)) == 301
        finally:
            target.close()


@pytest.fixture
def small_tables(postgres_dsn, nats_url, clickhouse_url, unique_name):
    """Three small tables (one partition each, one of them under an odd name), shared loads of two
    tables a run."""
    names = ["alpha", "Beta Table", "gamma"]
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        for position, name in enumerate(names):
            connection.execute(sql.SQL("create table {} (id int primary key, body text, n numeric)").format(
                sql.Identifier(unique_name, name)))
            connection.execute(sql.SQL("insert into {} select g, md5(g::text), g * 1.5 from generate_series(1, {}) g")
                               .format(sql.Identifier(unique_name, name), sql.Literal(40 + position)))
    config = parse_config({
        "application_identifier": unique_name,
        "source": {"dsn": postgres_dsn},
        "queue": {"url": nats_url},
        "tables": [{"name": f"{unique_name}.{name}"} for name in names],
        "targets": {"clickhouse": {"url": clickhouse_url, "database": unique_name}},
        "snapshots": {"retry_delay_seconds": 0, "tables_per_load_run": 2},
    })
    return config


class SharedHarness(Harness):
    """The harness over several tables; a shared run is executed as the daemon would launch it."""

    def run(self, request, broken=False):
        if request.partition_key is not None:
            return super().run(request, broken)
        defs = self.broken_defs if broken else self.defs
        return dg.materialize([defs.resolve_assets_def(request.asset_selection[0])], instance=self.instance,
                              run_config=request.run_config, tags=request.tags, raise_on_error=False)

    def entries(self):
        return {name: entry for name, entry in json.loads(self.cursor).items() if not name.startswith("_")}

    def materialized(self, spec):
        return self.instance.get_materialized_partitions(spec.target_key("clickhouse"))


def _shared_tables(request):
    return sorted(request.run_config["ops"][first_loads_key("clickhouse").to_python_identifier()]["config"]["tables"])


def _source_and_target_rows(config, spec):
    with source.connect(config.source.dsn) as connection:
        table = source.table_schema(connection, spec.table)
    target = ClickHouseTarget(config.targets.clickhouse)
    try:
        with psycopg.connect(config.source.dsn) as connection:
            rows = connection.execute(sql.SQL("select id::text, body, n::text from {}").format(
                sql.Identifier(table.schema, table.table))).fetchall()
        return sorted(rows), sorted(target.current_rows_as_text(table))
    finally:
        target.close()


def test_new_small_tables_load_two_to_a_run_each_recorded_on_its_own_asset(small_tables):
    specs = table_specs(small_tables)
    with instance_for_test() as instance:
        harness = SharedHarness(small_tables, instance)
        first = harness.tick()
        shared = [r for r in first.run_requests if r.partition_key is None]
        own = [r for r in first.run_requests if r.partition_key is not None]
        # Two tables share a run of the target's loads asset; the third, alone in its chunk, has its own.
        assert len(shared) == 1 and len(own) == 1
        [request] = shared
        assert request.asset_selection == [first_loads_key("clickhouse")]
        assert _shared_tables(request) == sorted(spec.qualified_name for spec in specs[:2])
        assert own[0].asset_selection == [specs[2].target_key("clickhouse")]
        # Both count against the machine's cap on the sensor's load runs (dagster.yaml).
        assert all(r.tags[SENSOR_LOAD_TAG] == "true" for r in first.run_requests)
        # While the shared run is asked for, its tables' loads are in progress: not asked again (the
        # third's run is asked again under its key, which the daemon runs once).
        assert [r.run_key for r in harness.tick().run_requests] == [own[0].run_key]
        assert all(harness.run(r).success for r in first.run_requests)
        done = harness.tick()
        assert done.run_requests == []
        for spec in specs:
            [key] = harness.keys_of(spec)
            assert harness.materialized(spec) == {key}, spec.qualified_name
            source_side, target_side = _source_and_target_rows(small_tables, spec)
            assert source_side == target_side and len(source_side) >= 40, spec.qualified_name
        assert all("load" not in e and BATCHED_KEY not in e and ALONE_KEY not in e for e in harness.entries().values())


def test_tables_a_shared_run_did_not_load_go_into_a_shared_run_again_then_into_runs_of_their_own(small_tables):
    specs = table_specs(small_tables)
    names = {f"clickhouse:{spec.qualified_name}" for spec in specs[:2]}
    with instance_for_test() as instance:
        harness = SharedHarness(small_tables, instance)
        [request] = [r for r in harness.tick().run_requests if r.partition_key is None]
        result = harness.run(request, broken=True)  # the source refuses: neither table loads
        assert not result.success
        errors = [entry.user_message for entry in instance.all_logs(result.run_id) if "not loaded" in entry.user_message]
        for spec in specs[:2]:  # each table named in its own line
            assert [line for line in errors if line.startswith(f"{spec.qualified_name}: partition ")], errors
        harness.tick()  # the shared run ended without them
        assert all(harness.entries()[name].get(MISSED_KEY) == 1 for name in names)
        # A second shared run of both (a kill -9 takes every table of the runs in flight: not their fault).
        [second] = [r for r in harness.tick().run_requests if r.partition_key is None]
        assert second.run_key != request.run_key
        assert _shared_tables(second) == sorted(spec.qualified_name for spec in specs[:2])
        assert not any(harness.entries()[name].get(ALONE_KEY) for name in names)
        assert not harness.run(second, broken=True).success
        harness.tick()  # the second ended without them too: runs of their own from now on
        again = harness.tick()
        assert all(harness.entries()[name].get(ALONE_KEY) for name in names)
        assert [r for r in again.run_requests if r.partition_key is None] == []
        retried = [r for r in again.run_requests if r.tags.get(AUTOLOAD_TAG) in names]
        assert sorted(r.asset_selection[0] for r in retried) == sorted(spec.target_key("clickhouse") for spec in specs[:2])
        assert all(harness.run(r).success for r in retried)
        harness.tick()
        for spec in specs[:2]:
            source_side, target_side = _source_and_target_rows(small_tables, spec)
            assert source_side == target_side, spec.qualified_name
            entry = harness.entries()[f"clickhouse:{spec.qualified_name}"]
            assert ALONE_KEY not in entry and MISSED_KEY not in entry


def test_tables_of_a_killed_shared_run_load_in_the_next_shared_run(small_tables):
    specs = table_specs(small_tables)
    with instance_for_test() as instance:
        harness = SharedHarness(small_tables, instance)
        [request] = [r for r in harness.tick().run_requests if r.partition_key is None]
        # The daemon starts the run; while it runs, its tables are not asked for again.
        run = create_run_for_test(instance, job_name="__ASSET_JOB", status=dg.DagsterRunStatus.STARTED,
                                  tags=request.tags)
        assert all(r.partition_key is not None for r in harness.tick().run_requests)
        # Its process is killed before it loads anything: the run monitor marks such a run failed.
        instance.report_run_failed(run)
        harness.tick()
        [second] = [r for r in harness.tick().run_requests if r.partition_key is None]
        assert _shared_tables(second) == sorted(spec.qualified_name for spec in specs[:2])
        assert harness.run(second).success
        harness.tick()
        for spec in specs[:2]:
            assert harness.materialized(spec) == set(harness.keys_of(spec)), spec.qualified_name
            source_side, target_side = _source_and_target_rows(small_tables, spec)
            assert source_side == target_side, spec.qualified_name
            entry = harness.entries()[f"clickhouse:{spec.qualified_name}"]
            assert ALONE_KEY not in entry and MISSED_KEY not in entry and BATCHED_KEY not in entry


def test_a_shared_run_the_daemon_never_made_counts_as_ended_after_its_grace(small_tables, monkeypatch):
    with instance_for_test() as instance:
        harness = SharedHarness(small_tables, instance)
        assert [r for r in harness.tick().run_requests if r.partition_key is None]
        # Within the grace the shared run is on its way: its tables are not asked for again.
        assert all(r.partition_key is None or r.tags[AUTOLOAD_TAG].endswith(".gamma") for r in harness.tick().run_requests)
        monkeypatch.setattr(shared_loads, "GRACE_SECONDS", 0.0)
        harness.tick()  # ended without loading: the tables go into a shared run again
        [second] = [r for r in harness.tick().run_requests if r.partition_key is None]
        assert len(_shared_tables(second)) == 2
        harness.tick()  # never made either: the tables load alone
        again = harness.tick()
        alone = [r for r in again.run_requests if not r.tags[AUTOLOAD_TAG].endswith(".gamma")]
        assert len(alone) == 2 and all(r.partition_key is not None for r in again.run_requests)


def test_a_table_taken_out_of_the_configuration_before_its_shared_run_is_skipped_and_the_rest_load(small_tables):
    specs = table_specs(small_tables)
    with instance_for_test() as instance:
        harness = SharedHarness(small_tables, instance)
        [request] = [r for r in harness.tick().run_requests if r.partition_key is None]
        # The run starts after a reload without the first table.
        fewer = small_tables.model_copy(update={"tables": small_tables.tables[1:]})
        defs = build_definitions(fewer)
        result = dg.materialize([defs.resolve_assets_def(request.asset_selection[0])], instance=instance,
                                run_config=request.run_config, tags=request.tags, raise_on_error=False)
        assert result.success
        warnings = [entry.user_message for entry in instance.all_logs(result.run_id) if "so not loaded" in entry.user_message]
        assert warnings and specs[0].qualified_name in warnings[0]
        assert harness.materialized(specs[0]) == set()
        assert harness.materialized(specs[1]) == set(harness.keys_of(specs[1]))
