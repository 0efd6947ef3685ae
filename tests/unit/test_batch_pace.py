from siphon_dagster.streaming.pace import (
    BUSY_WITHIN_SECONDS,
    CEILING_SECONDS,
    GATHERED_BACKLOG,
    GATHERED_FIRST,
    GATHERED_IN_LINE,
    GATHERED_PACED,
    BatchPace,
    gathering,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def busy(tables: int, floor: float, budget: float, clock: Clock | None = None) -> BatchPace:
    """A pace whose `tables` tables each cut a batch just now."""
    pace = BatchPace(floor, max_batches_per_second=budget, clock=clock or Clock())
    for i in range(tables):
        pace.record(f"public.t{i}")
    return pace


def test_few_busy_tables_keep_the_configured_wait():
    assert busy(20, floor=1.0, budget=50).wait_seconds() == 1.0


def test_many_busy_tables_collect_longer_within_the_budget():
    # 150 tables, each cutting a batch every 3 s, make 50 batches per second.
    assert busy(150, floor=1.0, budget=50).wait_seconds() == 3.0


def test_the_wait_never_exceeds_the_ceiling():
    assert busy(500, floor=1.0, budget=10).wait_seconds() == CEILING_SECONDS


def test_tables_gone_quiet_stop_counting():
    clock = Clock()
    pace = busy(40, floor=0.5, budget=10, clock=clock)
    assert pace.wait_seconds() == 4.0
    clock.now += BUSY_WITHIN_SECONDS + 1
    pace.record("public.t0")
    assert pace.busy_tables() == 1
    assert pace.wait_seconds() == 0.5


def test_a_ceiling_below_the_configured_wait_keeps_the_configured_wait():
    assert busy(100, floor=8.0, budget=1).wait_seconds() == 8.0


def test_a_batch_waits_for_the_pace_only_when_nothing_else_sets_its_gathering():
    # Messages already waiting are a backlog whatever else holds; a table's first batch never
    # waits; with every turn taken the batch gathers in line, else it waits the pace's time.
    assert gathering(backlog=True, applied_any=False, turns_taken=True) == GATHERED_BACKLOG
    assert gathering(backlog=False, applied_any=False, turns_taken=True) == GATHERED_FIRST
    assert gathering(backlog=False, applied_any=True, turns_taken=True) == GATHERED_IN_LINE
    assert gathering(backlog=False, applied_any=True, turns_taken=False) == GATHERED_PACED
