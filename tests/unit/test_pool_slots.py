"""Extra snapshot-pool slots for a run of many partitions, against a real (temporary) Dagster instance."""

from __future__ import annotations

from siphon_dagster.snapshot.pool_slots import UNLIMITED_POOL_PARALLEL, extra_slots
from tests.helpers.instance import instance_for_test

POOL = "siphon_snapshot_clickhouse"


def _instance(limit: int | None):
    overrides = {"concurrency": {"pools": {"default_limit": limit}}} if limit is not None else {}
    return instance_for_test(overrides=overrides)


def _holding(instance, *runs: str):
    """The pool's storage, its slots initialized, with one slot claimed by each of `runs`' steps."""
    storage = instance.event_log_storage
    storage.initialize_concurrency_limit_to_default(POOL)
    for run in runs:
        assert storage.claim_concurrency_slot(POOL, run, "snapshot").is_claimed
    return storage


def test_a_run_takes_the_free_slots_and_gives_them_back():
    with _instance(3) as instance:
        storage = _holding(instance, "run-a")  # the step's own slot
        with extra_slots(instance, POOL, "run-a", "snapshot", wanted=5) as parallel:
            assert parallel == 3
            assert storage.get_concurrency_info(POOL).active_slot_count == 3
        info = storage.get_concurrency_info(POOL)
        assert info.active_slot_count == 1
        assert [step.step_key for step in info.pending_steps] == ["snapshot"]  # the step's own, assigned


def test_slots_another_run_holds_are_left_to_it():
    with _instance(3) as instance:
        _holding(instance, "run-b", "run-a")
        with extra_slots(instance, POOL, "run-a", "snapshot", wanted=5) as parallel:
            assert parallel == 2


def test_a_step_waiting_for_a_slot_goes_first():
    with _instance(2) as instance:
        storage = _holding(instance, "run-a", "run-b")
        assert not storage.claim_concurrency_slot(POOL, "run-c", "snapshot").is_claimed  # waits
        storage.free_concurrency_slot_for_step("run-b", "snapshot")
        with extra_slots(instance, POOL, "run-a", "snapshot", wanted=3) as parallel:
            assert parallel == 1  # run-c's step was waiting: the free slot is its


def test_one_range_asks_for_nothing_and_an_unlimited_pool_reads_two_at_a_time():
    with _instance(None) as instance:
        with extra_slots(instance, POOL, "run-a", "snapshot", wanted=0) as parallel:
            assert parallel == 1
        with extra_slots(instance, POOL, "run-a", "snapshot", wanted=10) as parallel:
            assert parallel == UNLIMITED_POOL_PARALLEL
