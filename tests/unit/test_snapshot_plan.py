"""The snapshot sensor's decision for one (target, table), rule by rule."""

from siphon_dagster.snapshot_plan import (
    FAILED,
    IN_PROGRESS,
    MATERIALIZED,
    RUN_ACTIVE,
    RUN_ENDED,
    Partitions,
    exhausted,
    plan_table,
    retry_delay,
)
from siphon_dagster.snapshot_sensor import (
    SETTLED_LOOK_SECONDS,
    SETTLED_LOOKS_PER_SECOND,
    settled_look_interval,
)

KEYS = ["00000000-00000003", "00000004-00000007", "00000008-00000011"]
A, B, C = KEYS


def plan(status=None, entry=None, load_runs=None, missing=False, now=1000.0, keys=KEYS, **settings):
    load_runs = load_runs or {}
    asked = []

    def table_missing():
        asked.append(True)
        return missing

    result = plan_table(Partitions.of(keys, status or {}, load_runs), entry or {}, load_runs=load_runs,
                        table_missing=table_missing, now=now,
                        **{"auto_load": True, "max_attempts": 3, "first_retry_delay": 30.0, **settings})
    result.asked = bool(asked)
    return result


def test_a_new_table_is_loaded_whole_once():
    first = plan()
    assert first.load == KEYS and first.load_started and first.entry["load"] == {"at": 1000.0}
    # Its runs are queued: nothing is asked again.
    second = plan(entry=first.entry, load_runs=dict.fromkeys(KEYS, RUN_ACTIVE))
    assert second.load == [] and second.retries == [] and "load" in second.entry


def test_a_partition_added_during_a_load_is_part_of_it_and_the_load_ends_when_all_ran():
    entry = {"load": {"at": 1.0}}
    runs = dict.fromkeys(KEYS, RUN_ACTIVE)
    grown = plan(status={A: MATERIALIZED}, entry=entry, load_runs=runs, keys=[*KEYS, "00000012-00000015"])
    assert grown.load == ["00000012-00000015"]
    done = plan(status=dict.fromkeys(KEYS, MATERIALIZED), entry=entry, load_runs=dict.fromkeys(KEYS, RUN_ENDED))
    assert done.load == [] and "load" not in done.entry


def test_a_loaded_table_is_not_loaded_again_while_it_is_at_the_target():
    result = plan(status=dict.fromkeys(KEYS, MATERIALIZED))
    assert result.load == [] and result.asked
    # Its presence is asked again only after the check interval.
    later = plan(status=dict.fromkeys(KEYS, MATERIALIZED), entry=result.entry, now=1010.0, table_check_seconds=60)
    assert not later.asked and later.entry["checked_at"] == 1000.0


def test_a_table_missing_at_the_target_is_loaded_again():
    result = plan(status=dict.fromkeys(KEYS, MATERIALIZED), missing=True)
    assert result.load == KEYS and result.load_started


def test_nothing_is_requested_for_an_unreachable_target():
    result = plan(missing=None)
    assert result.load == [] and "load" not in result.entry
    failing = plan(status={A: FAILED}, entry={"failed": {A: {"attempts": 1, "since": 1.0, "retry_at": 2.0}}},
                   missing=None)
    assert failing.retries == [] and failing.entry["failed"][A]["attempts"] == 1


def test_a_failed_partition_waits_then_is_retried_until_the_limit():
    status = {A: FAILED, B: MATERIALIZED, C: MATERIALIZED}
    seen = plan(status=status)
    assert seen.retries == [] and seen.entry["failed"][A] == {"attempts": 1, "since": 1000.0, "retry_at": 1030.0}
    second = plan(status=status, entry=seen.entry, now=1030.0)
    assert [(r.key, r.attempt) for r in second.retries] == [(A, 2)]
    running = plan(status={**status, A: IN_PROGRESS}, entry=second.entry, now=1040.0)
    assert running.retries == [] and running.entry["failed"][A]["retry_at"] is None
    again = plan(status=status, entry=running.entry, now=1100.0)
    assert again.retries == [] and again.entry["failed"][A]["retry_at"] == 1100.0 + retry_delay(2, 30.0) == 1160.0
    third = plan(status=status, entry=again.entry, now=1160.0)
    assert [(r.key, r.attempt) for r in third.retries] == [(A, 3)]
    last = plan(status=status, entry=third.entry, now=1200.0)
    assert exhausted(last.entry, 3) == {A: 3}
    assert plan(status=status, entry=last.entry, now=99999.0).retries == []


def test_a_partition_materialized_after_failing_is_forgotten():
    entry = {"failed": {A: {"attempts": 3, "since": 1.0, "retry_at": 2.0}}}
    result = plan(status=dict.fromkeys(KEYS, MATERIALIZED), entry=entry)
    assert "failed" not in result.entry


def test_a_table_whose_every_partition_failed_is_retried_not_loaded_again():
    result = plan(status=dict.fromkeys(KEYS, FAILED), missing=True)
    assert result.load == [] and set(result.entry["failed"]) == set(KEYS)


def test_auto_load_off_loads_nothing_but_still_retries():
    assert plan(auto_load=False).load == []
    entry = {"failed": {A: {"attempts": 1, "since": 1.0, "retry_at": 2.0}}}
    assert [r.key for r in plan(status={A: FAILED}, entry=entry, auto_load=False).retries] == [A]


def test_retry_delay_doubles_and_is_capped():
    assert [retry_delay(n, 30.0) for n in (1, 2, 3)] == [30.0, 60.0, 120.0]
    assert retry_delay(12, 30.0) == 600.0


def test_partitions_a_drop_took_away_are_loaded_again_and_their_failures_forgotten():
    # A failed after an earlier success, B loaded, C running: A and B lost their rows.
    entry = {"failed": {A: {"attempts": 3, "since": 1.0, "retry_at": 2.0}}}
    result = plan(status={A: FAILED, B: MATERIALIZED, C: IN_PROGRESS}, entry=entry, lost={A, B, C})
    assert result.load == [A, B] and result.load_started and result.reload and result.retries == []
    assert "failed" not in result.entry
    unreachable = plan(status={B: MATERIALIZED}, lost={B}, missing=None)
    assert unreachable.load == [] and unreachable.drop_deferred


def test_nothing_is_loaded_again_when_the_drop_took_nothing_away():
    # Every partition was materialized after the drop (the table made again, then loaded), or none
    # ever was (a new table whose stream made it before its first load's runs): nothing is lost.
    loaded = plan(status=dict.fromkeys(KEYS, MATERIALIZED), lost=set())
    assert loaded.load == [] and not loaded.reload and not loaded.drop_deferred
    assert plan(lost=set()).load == list(KEYS)  # a new table loads as one, drop or not


def test_a_drop_during_a_load_adds_what_it_took_to_that_load():
    running = {B: RUN_ACTIVE, C: RUN_ACTIVE}
    result = plan(status={A: MATERIALIZED}, entry={"load": {"at": 1.0}}, load_runs=running, lost={A})
    assert result.load == [A] and result.reload and not result.load_started
    assert result.entry["load"] == {"at": 1.0}  # the load goes on: its runs are still counted


def test_settled_tables_are_looked_at_a_few_a_second_in_all_however_many_there_are():
    assert settled_look_interval(10) == SETTLED_LOOK_SECONDS
    assert settled_look_interval(500) == 500 / SETTLED_LOOKS_PER_SECOND > SETTLED_LOOK_SECONDS
