"""Streaming groups: configuration checks, the groups and job names built from them, and the
materialization rate limiter."""

import pytest

from siphon_core.config import ConfigError, parse_config
from siphon_dagster.specs import table_specs
from siphon_dagster.stream_groups import stream_groups, tables_hash
from siphon_dagster.streaming.materializations import MaterializationLimiter
from siphon_dagster.streaming.report import BatchReport
from tests.helpers.instance import instance_for_test

BASE = {
    "application_identifier": "shop",
    "source": {"dsn": "postgresql://siphon@127.0.0.1:5432/app"},
    "tables": [{"name": "public.notes"}, {"name": "public.events"}, {"name": "audit.log", "targets": ["clickhouse"]}],
    "targets": {"clickhouse": {"url": "http://127.0.0.1:8123"},
                "snowflake": {"account": "a", "user": "u"}},
}


def with_groups(groups):
    return parse_config({**BASE, "streaming": {"groups": groups}})


def test_without_groups_every_table_is_in_one_run_per_target():
    config = with_groups({})
    groups = {g.job_name: g.tables for g in stream_groups(config, table_specs(config))}
    assert groups == {"stream_clickhouse": ("audit.log", "public.events", "public.notes"),
                      "stream_snowflake": ("public.events", "public.notes")}


def test_a_named_group_takes_its_tables_out_of_the_default_run():
    config = with_groups({"hot": ["public.events"]})
    groups = {g.job_name: (g.op_name, g.tables) for g in stream_groups(config, table_specs(config))}
    assert groups == {
        "stream_clickhouse": ("apply_clickhouse", ("audit.log", "public.notes")),
        "stream_clickhouse__hot": ("apply_clickhouse__hot", ("public.events",)),
        "stream_snowflake": ("apply_snowflake", ("public.notes",)),
        "stream_snowflake__hot": ("apply_snowflake__hot", ("public.events",)),
    }


def test_a_group_naming_an_unconfigured_table_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"streaming.groups.hot: table 'public.orders' is not configured"):
        with_groups({"hot": ["public.orders"]})


def test_a_table_in_two_groups_is_refused_naming_both_groups():
    with pytest.raises(ConfigError, match=r"table 'public.notes' is in both group 'hot' and group 'cold'"):
        with_groups({"hot": ["public.notes"], "cold": ["public.events", "public.notes"]})


def test_a_table_listed_twice_in_one_group_is_refused_naming_the_group():
    with pytest.raises(ConfigError, match=r"streaming.groups.hot: table 'public.notes' is listed twice"):
        with_groups({"hot": ["public.notes", "public.events", "public.notes"]})


@pytest.mark.parametrize("name", ["default", "a-b", "x y"])
def test_a_group_name_must_be_a_word_other_than_default(name):
    with pytest.raises(ConfigError, match=f"streaming.groups: .*group '{name}'"):
        with_groups({name: ["public.notes"]})


def test_an_empty_group_is_refused():
    with pytest.raises(ConfigError, match="group 'hot': name at least one table"):
        with_groups({"hot": []})


def test_the_table_set_digest_ignores_order_and_changes_with_the_set():
    assert tables_hash(["b.t", "a.t"]) == tables_hash(["a.t", "b.t"]) != tables_hash(["a.t"])


def report(table="public.notes", events=1, lsn=10, warnings=(), schema_changed=False, sequence=1):
    return BatchReport(target="clickhouse", table=table, first_sequence=sequence, last_sequence=sequence, messages=1,
                       events=events, rows_by_operation={"insert": events}, rows_applied=events, applied_lsn=lsn,
                       latency_seconds=0.1, lag_oldest_seconds=2.0, lag_newest_seconds=1.0, pending=0,
                       warnings=tuple(warnings), schema_changed=schema_changed)


def test_the_first_batch_is_materialized_then_batches_aggregate_until_the_interval_passes():
    limiter = MaterializationLimiter(60)
    first = limiter.add(report(sequence=1), now=0)
    assert first is not None and first.batches == 1
    assert limiter.add(report(events=2, lsn=20, sequence=2), now=10) is None
    assert limiter.add(report(events=3, lsn=15, sequence=3), now=30) is None
    assert limiter.due(now=59) == []
    [due] = limiter.due(now=61)
    assert (due.batches, due.events, due.rows_by_operation, due.applied_lsn) == (2, 5, {"insert": 5}, 20)
    assert (due.first_sequence, due.last_sequence) == (2, 3)
    assert limiter.flush(now=62) == []


def test_tables_are_limited_independently():
    limiter = MaterializationLimiter(60)
    assert limiter.add(report("public.notes"), now=0) is not None
    assert limiter.add(report("public.events"), now=1) is not None
    assert limiter.add(report("public.notes"), now=2) is None


def test_a_schema_change_or_a_warning_is_materialized_at_once_with_what_came_before():
    limiter = MaterializationLimiter(60)
    limiter.add(report(sequence=1), now=0)
    assert limiter.add(report(sequence=2), now=1) is None
    changed = limiter.add(report(sequence=3, schema_changed=True), now=2)
    assert changed is not None and changed.schema_changed and changed.batches == 2
    warned = limiter.add(report(sequence=4, warnings=["resync needed"]), now=3)
    assert warned is not None and warned.warnings == ["resync needed"]


def test_flush_returns_what_is_left_when_the_run_ends():
    limiter = MaterializationLimiter(60)
    limiter.add(report(sequence=1), now=0)
    limiter.add(report(sequence=2), now=1)
    [left] = limiter.flush(now=2)
    assert left.last_sequence == 2


def test_batches_an_interrupt_left_unreported_join_their_tables_aggregates_for_the_flush():
    limiter = MaterializationLimiter(60)
    assert limiter.add(report(sequence=1), now=0) is not None
    limiter.absorb(report(sequence=2, lsn=20))  # not due for 60 s: the flush reports it
    limiter.absorb(report("public.events", sequence=3))
    left = {aggregate.table: aggregate for aggregate in limiter.flush(now=2)}
    assert (left["public.notes"].last_sequence, left["public.notes"].applied_lsn) == (2, 20)
    assert left["public.events"].batches == 1


def test_a_run_s_budget_holds_due_tables_back_and_serves_the_longest_unreported_first():
    limiter = MaterializationLimiter(60, max_per_second=1.0)  # up to 5 at once (BURST_SECONDS)
    tables = [f"public.t{i}" for i in range(8)]
    taken = [limiter.add(report(table), now=0) for table in tables]
    assert [a.table for a in taken if a is not None] == tables[:5]
    # Every table has a batch open; t5 - t7 never got their first materialization.
    for table in tables[:5]:
        assert limiter.add(report(table, sequence=2), now=1) is None  # within the interval
    assert [a.table for a in limiter.due(now=2)] == ["public.t5", "public.t6"]  # 2 s of budget
    # While t7 waits, a due table's batch does not go ahead of it.
    assert limiter.add(report("public.t0", sequence=3), now=61) is None
    assert [a.table for a in limiter.due(now=62)] == ["public.t7", "public.t0", "public.t1", "public.t2",
                                                        "public.t3"]
    assert [a.table for a in limiter.due(now=63)] == ["public.t4"]
    # Nothing waits now: a due batch goes at once when the budget has room.
    assert limiter.add(report("public.t5", sequence=4), now=125) is not None


def test_a_schema_change_goes_at_once_even_with_the_budget_spent():
    limiter = MaterializationLimiter(60, max_per_second=0.2)  # one at once
    assert limiter.add(report("public.notes"), now=0) is not None
    assert limiter.add(report("public.events"), now=0) is None
    changed = limiter.add(report("public.events", schema_changed=True, sequence=2), now=0.5)
    assert changed is not None and changed.batches == 2
    # The forced one was spent from the budget: the next table waits for it to refill.
    assert limiter.add(report("public.orders"), now=1) is None
    assert limiter.due(now=6) == []
    assert [a.table for a in limiter.due(now=11)] == ["public.orders"]


def test_many_schema_changes_at_once_hold_routine_materializations_back_one_burst_at_most():
    limiter = MaterializationLimiter(60, max_per_second=1.0)  # 5 at once
    for i in range(100):
        assert limiter.add(report(f"public.t{i}", schema_changed=True), now=0) is not None
    assert limiter.add(report("public.quiet"), now=0) is None
    assert limiter.due(now=5) == []  # the budget is 5 below nothing, not 95
    assert [a.table for a in limiter.due(now=11)] == ["public.quiet"]


def test_a_configured_budget_reaches_the_run_s_limiter():
    config = parse_config({**BASE, "streaming": {"max_materializations_per_second": 0.5}})
    assert config.streaming.max_materializations_per_second == 0.5
    assert parse_config(BASE).streaming.max_materializations_per_second == 2.0
    with pytest.raises(ConfigError, match="max_materializations_per_second"):
        parse_config({**BASE, "streaming": {"max_materializations_per_second": 0}})


def test_the_tables_streaming_are_read_off_the_group_runs_and_single_table_drains():
    import dagster as dg
    from dagster._core.test_utils import create_run_for_test

    from siphon_dagster.jobs import stream_tag_value
    from siphon_dagster.stream_groups import STREAM_TAG
    from siphon_dagster.table_state import streaming_states

    config = with_groups({"hot": ["public.events"]})
    specs = table_specs(config)
    groups = {g.job_name: g for g in stream_groups(config, specs)}
    notes = next(spec for spec in specs if spec.qualified_name == "public.notes")
    with instance_for_test() as instance:
        for job, status in (("stream_clickhouse", dg.DagsterRunStatus.STARTED),
                            ("stream_snowflake__hot", dg.DagsterRunStatus.STARTING),
                            ("stream_snowflake", dg.DagsterRunStatus.SUCCESS)):  # ended: serves nothing
            create_run_for_test(instance, job_name=job, status=status, tags=groups[job].tags)
        create_run_for_test(instance, job_name=notes.stream_job_name("snowflake"), status=dg.DagsterRunStatus.NOT_STARTED,
                            tags={STREAM_TAG: stream_tag_value(notes, "snowflake"), **notes.tags})
        other = parse_config({**BASE, "application_identifier": "other"})
        create_run_for_test(instance, job_name="stream_clickhouse", status=dg.DagsterRunStatus.STARTED,
                            tags=stream_groups(other, table_specs(other))[0].tags)  # another application's

        states = streaming_states(instance, notes.tags["siphon/application"])

    assert states == {("clickhouse", "audit.log"): "running", ("clickhouse", "public.notes"): "running",
                      ("snowflake", "public.events"): "starting", ("snowflake", "public.notes"): "starting"}


def test_a_table_whose_name_holds_a_comma_is_one_table_in_its_run_s_tags():
    import dagster as dg

    config = parse_config({**BASE, "tables": [{"name": "public.a,b"}, {"name": "public.a"}],
                           "targets": {"clickhouse": {"url": "http://127.0.0.1:8123"}}})
    from siphon_dagster.stream_groups import served_tables

    group = stream_groups(config, table_specs(config))[0]
    run = dg.DagsterRun(job_name=group.job_name, tags=group.tags)
    assert served_tables(run) == ("clickhouse", "default", {"public.a,b", "public.a"})
    # A run tagged by an earlier version (names joined with commas) is still read.
    legacy = dg.DagsterRun(job_name=group.job_name, tags={**group.tags, "siphon/stream-tables": "public.x,public.y"})
    assert served_tables(legacy) == ("clickhouse", "default", {"public.x", "public.y"})


def test_a_streaming_run_behind_a_page_of_newer_queued_runs_is_still_found(monkeypatch):
    """A backfill queues a run per partition: the streaming run started before them is found all the
    same, and a second run of its tables refuses to start beside it."""
    import time

    import dagster as dg
    from dagster._core.test_utils import create_run_for_test

    from siphon_dagster import run_liveness
    from siphon_dagster.stream_groups import live_streaming_runs, runs_applying

    monkeypatch.setattr(run_liveness, "RUN_RECORDS_PAGE", 3)
    config = with_groups({})
    specs = table_specs(config)
    group = next(g for g in stream_groups(config, specs) if g.target == "clickhouse")
    application = specs[0].tags["siphon/application"]
    with instance_for_test() as instance:
        streaming = create_run_for_test(instance, job_name=group.job_name, status=dg.DagsterRunStatus.STARTED,
                                        tags=group.tags)
        for _ in range(8):  # snapshot runs of the same application made after it, not started yet
            create_run_for_test(instance, job_name="__ASSET_JOB", status=dg.DagsterRunStatus.NOT_STARTED,
                                tags=specs[0].tags)
        found = [run.run_id for run, _ in live_streaming_runs(instance, application, time.time())]
        assert found == [streaming.run_id]
        applying = runs_applying(instance, application, "clickhouse", ["public.notes", "public.other"], time.time())
        assert [(run.run_id, tables) for run, tables in applying] == [(streaming.run_id, ["public.notes"])]
        assert runs_applying(instance, application, "snowflake", ["public.notes"], time.time()) == []
        assert runs_applying(instance, application, "clickhouse", ["public.notes"], time.time(),
                             exclude_run_id=streaming.run_id) == []


def test_a_table_s_backoff_doubles_while_it_keeps_failing_and_starts_over_once_it_streamed():
    from siphon_dagster.streaming.group_run import FailureStreaks

    streaks = FailureStreaks(15.0, 600.0)
    assert [streaks.failed("public.bad") for _ in range(7)] == [15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 600.0]
    assert streaks.count("public.bad") == 7 and streaks.failed("public.other") == 15.0
    streaks.applied("public.bad")  # it streamed again
    assert streaks.count("public.bad") == 0 and streaks.failed("public.bad") == 15.0
    assert streaks.failed("public.other") == 30.0  # another table's streak is its own
