from siphon_dagster.streaming.pace import BUSY_WITHIN_SECONDS, CEILING_SECONDS, BatchPace


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_few_busy_tables_keep_the_configured_wait():
    clock = Clock()
    pace = BatchPace(1.0, max_batches_per_second=50, clock=clock)
    for i in range(20):
        pace.record(f"public.t{i}")
    assert pace.wait_seconds() == 1.0


def test_many_busy_tables_collect_longer_within_the_budget():
    clock = Clock()
    pace = BatchPace(1.0, max_batches_per_second=50, clock=clock)
    for i in range(150):
        pace.record(f"public.t{i}")
    # 150 tables, each cutting a batch every 3 s, make 50 batches per second.
    assert pace.wait_seconds() == 3.0


def test_the_wait_never_exceeds_the_ceiling():
    clock = Clock()
    pace = BatchPace(1.0, max_batches_per_second=10, clock=clock)
    for i in range(500):
        pace.record(f"public.t{i}")
    assert pace.wait_seconds() == CEILING_SECONDS


def test_tables_gone_quiet_stop_counting():
    clock = Clock()
    pace = BatchPace(0.5, max_batches_per_second=10, clock=clock)
    for i in range(40):
        pace.record(f"public.t{i}")
    assert pace.wait_seconds() == 4.0
    clock.now += BUSY_WITHIN_SECONDS + 1
    pace.record("public.t0")
    assert pace.busy_tables() == 1
    assert pace.wait_seconds() == 0.5


def test_a_ceiling_below_the_configured_wait_keeps_the_configured_wait():
    pace = BatchPace(8.0, max_batches_per_second=1, clock=Clock())
    for i in range(100):
        pace.record(f"public.t{i}")
    assert pace.wait_seconds() == 8.0
