"""Group runs end to end: many tables in one streaming run, through Dagster, against real NATS,
PostgreSQL (the source catalog) and the embedded ClickHouse server; and the driver's decode of a
small batch against Spark's."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

import dagster as dg
import pytest
from pyspark.sql import SparkSession

from siphon_core.config import StreamingConfig, TableConfig, parse_config
from siphon_dagster.definitions import build_definitions, build_resources
from siphon_dagster.streaming.consumer import StreamConsumer
from siphon_dagster.streaming.group_run import SWITCH_INTERVAL_SECONDS, GroupRunner, TableFailure
from siphon_dagster.streaming.pace import BatchPace
from siphon_dagster.streaming.report import BatchReport
from siphon_dagster.streaming.schema import table_schema
from siphon_dagster.streaming.spark_session import get_spark_session
from siphon_dagster.streaming.strategy import RetryPolicy
from tests.helpers.instance import instance_for_test
from tests.integration.test_streaming_consumer import (
    STORY,
    STORY_ROWS,
    make_target,
    notes_schema,
    publish,
    queue,
)
from tests.unit.test_streaming_packages import NOTES, insert, package


@pytest.fixture(scope="module")
def spark() -> SparkSession:
    return get_spark_session()


def rows_of(target, name: str):
    return target.current_rows_as_text(table_schema("public", name, NOTES))


@pytest.mark.parametrize("threshold", [0, 1 << 30], ids=["spark", "driver"])
def test_small_batches_decoded_in_the_driver_give_the_rows_spark_gives(request, nats_url, spark: SparkSession,
                                                                        unique_name, threshold):
    target = make_target(request, "clickhouse", unique_name)
    publish(nats_url, unique_name, STORY)
    streaming = StreamingConfig(batch_max_messages=3, batch_max_wait_seconds=0.3, driver_decode_max_bytes=threshold)
    reports: list[BatchReport] = []
    StreamConsumer(queue(nats_url, unique_name), target, TableConfig(name="public.notes"), spark,
                   streaming).run(stop_when_drained=True, on_batch=reports.append)
    # The story's unchanged TOASTed values are filled from the batch history and the target: both
    # paths decode it (the driver path reads the history in the driver too).
    assert target.current_rows_as_text(notes_schema()) == STORY_ROWS
    assert [r.decoded_in_driver for r in reports] == [threshold > 0] * len(reports)
    target.close()


def group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, tables, interval=60.0, on_error="stop"):
    return parse_config({
        "application_identifier": unique_name,
        "source": {"dsn": postgres_dsn},
        "queue": {"url": nats_url},
        "tables": [{"name": f"public.{name}", "on_error": on_error} for name in tables],
        "targets": {"clickhouse": {"url": clickhouse_url, "database": unique_name}},
        "streaming": {"batch_max_wait_seconds": 0.3, "materialization_interval_seconds": interval},
    })


class Consumers:
    """A run's consumer factory as these tests make it: each consumer with its own connection to the
    target (`opened`, closed by `close`) and no Spark (batches this small are decoded in the
    driver). `wrap(table, target)` changes a table's target, `kind` is the consumer's class."""

    def __init__(self, config, settings: StreamingConfig, idle_pull_seconds: float | None = None,
                 pipelined: bool = False, wrap=lambda table, target: target, kind=StreamConsumer,
                 **consumer_args) -> None:  # noqa: ANN001, ANN003
        self.resources = build_resources(config)
        self.shared = self.resources["queue"].queue()
        self.settings, self.idle_pull_seconds, self.pipelined = settings, idle_pull_seconds, pipelined
        self.wrap, self.kind, self.consumer_args = wrap, kind, consumer_args
        self.opened: list = []

    def __call__(self, table: TableConfig) -> StreamConsumer:
        self.opened.append(self.resources["clickhouse_target"].open_target())
        made = self.kind(self.shared, self.wrap(table, self.opened[-1]), table,
                         lambda: pytest.fail("no Spark for small batches"), self.settings, source=None,
                         **self.consumer_args)
        if self.idle_pull_seconds is not None:
            made.idle_pull_seconds = self.idle_pull_seconds
        made.pipelined = self.pipelined
        return made

    def close(self) -> None:
        for target in self.opened:
            target.close()


def publish_backlogs(nats_url: str, application: str, names: list[str], count: int) -> None:
    """`count` one-row packages on each table's subject."""
    for name in names:
        publish(nats_url, application, [package([insert(0x300 + i, str(i), f"{name} {i}", str(i))], table=name)
                                         for i in range(count)], table=name)


def test_a_failing_table_stops_alone_and_the_others_of_the_run_converge(request, nats_url, postgres_dsn,
                                                                        clickhouse_url, unique_name):
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, ["notes", "ones", "bad"])
    publish(nats_url, unique_name, STORY)
    publish(nats_url, unique_name, [package([insert(0x200 + i, str(i), f"one {i}", str(i))], table="ones")
                                    for i in range(5)], table="ones")
    bad = publish(nats_url, unique_name, [package([insert(0x1A0, "1", b"\xff not UTF-8", "1")], table="bad")],
                  table="bad")
    defs = build_definitions(config)
    job = defs.resolve_job_def("stream_clickhouse")
    with instance_for_test() as instance:
        result = job.execute_in_process(instance=instance, raise_on_error=False,
                                        tags={"siphon/stream-tables": "public.notes,public.removed",
                                              "siphon/stream-tables-hash": "0000000000000000"},
                                        run_config={"ops": {"apply_clickhouse": {"config": {"stop_when_drained": True}}}})
        # The run ends failed, naming the table that stopped, after the other tables drained.
        assert not result.success
        # Made from an older copy of the job, it says which tables it applied: the sensor keeps two
        # runs off one table by these tags.
        assert json.loads(instance.get_run_by_id(result.run_id).tags["siphon/stream-tables"]) == \
            ["public.bad", "public.notes", "public.ones"]
        failure = result.failure_data_for_node("apply_clickhouse").error.message
        assert "public.bad" in failure and "not valid UTF-8" in failure
        events = [e.dagster_event for e in instance.all_logs(result.run_id) if e.dagster_event is not None]
        materialized = {e.asset_key.to_user_string() for e in events if e.is_step_materialization}
        assert materialized == {"clickhouse/public/notes", "clickhouse/public/ones"}
        # A run that streams for days keeps none of its events in memory until it ends: they went
        # to the event log alone, and nothing was left for Dagster to hand on when the op returned.
        assert not [e for e in result.all_events if e.is_step_materialization
                    or e.event_type == dg.DagsterEventType.ASSET_OBSERVATION]
        observed = [e.event_specific_data.asset_observation for e in events
                    if e.event_type == dg.DagsterEventType.ASSET_OBSERVATION]
        [observation] = [o for o in observed if o.asset_key.to_user_string() == "clickhouse/public/bad"]
        error = observation.metadata["error"].value
        assert f"cannot apply stream sequences {bad[0]}-{bad[0]}" in error and "not valid UTF-8" in error
        errors = [e.message for e in instance.all_logs(result.run_id) if e.level >= 40]
        assert any("table public.bad (target clickhouse) stopped" in m for m in errors)
        # The stream made both tables at the target, new there (nothing of them ever materialized):
        # no signal to load them again, and the run's log names them in a line a tick that names
        # every table made since the last (hundreds at a first start).
        assert not [o for o in observed if "siphon/dropped" in o.metadata]
        logged = [e.user_message for e in instance.all_logs(result.run_id)]
        assert not [line for line in logged if "no table at clickhouse" in line]
        lines = [line for line in logged if "new at clickhouse, made by the stream" in line]
        assert lines and all(" table(s) new at clickhouse, made by the stream: " in line for line in lines), lines
        named = [name for line in lines for name in line.rsplit(": ", 1)[1].split(", ")]
        assert sorted(named) == ["public.notes", "public.ones"]
    target = build_resources(config)["clickhouse_target"].open_target()
    try:
        assert target.current_rows_as_text(notes_schema()) == STORY_ROWS
        assert rows_of(target, "ones") == [(str(i), f"one {i}", str(i)) for i in range(5)]
    finally:
        target.close()


def test_a_failed_table_is_started_again_with_backoff_while_the_others_stream(request, nats_url, postgres_dsn,
                                                                            clickhouse_url, unique_name):
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, ["notes", "bad"])
    publish(nats_url, unique_name, [package([insert(0x1A0, "1", b"\xff", "1")], table="bad")], table="bad")
    publish(nats_url, unique_name, STORY)
    failures: list[TableFailure] = []
    reports: list[BatchReport] = []
    consumers = Consumers(config, config.streaming, idle_pull_seconds=0.5, pipelined=True)
    intervals: set[float] = set()

    def make_consumer(table: TableConfig) -> StreamConsumer:
        intervals.add(sys.getswitchinterval())
        return consumers(table)

    runner = GroupRunner(consumers.shared, list(config.tables), make_consumer, reports.append, failures.append,
                         retry_initial_seconds=0.2, retry_max_seconds=0.5)
    done = threading.Event()

    def stop_when_seen() -> None:
        # Stops once the good table converged and the bad one failed at least three times.
        while not done.wait(0.2):
            if len(failures) >= 3 and sum(r.events for r in reports) == 12:
                runner.stop()
                return

    watcher = threading.Thread(target=stop_when_seen, daemon=True)
    watcher.start()
    before = sys.getswitchinterval()
    try:
        summary = runner.run()
    finally:
        done.set()
    assert {f.table for f in failures} == {"public.bad"}
    # The run's threads take turns at a short switch interval, and the process gets its own back.
    assert intervals == {SWITCH_INTERVAL_SECONDS} and sys.getswitchinterval() == before
    assert [f.attempt for f in failures[:3]] == [1, 2, 3] and all(f.retry_in_seconds for f in failures)
    assert summary.tables["public.notes"].events == 12
    assert consumers.opened[0].current_rows_as_text(notes_schema()) == STORY_ROWS
    consumers.close()


class _Interrupt(BaseException):
    """What Dagster raises in a run it terminates (DagsterExecutionInterruptedError): no Exception."""


class _WrappedTarget:
    """A real target with one behaviour changed by a subclass; everything else is the target's."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


class _InterruptOnWrite(_WrappedTarget):
    """A real target whose first write raises an interrupt, as a terminated run's signal handler does
    in whatever frame the run is in."""

    def __init__(self, inner, writes_before: int) -> None:  # noqa: ANN001
        super().__init__(inner)
        self.writes_left = writes_before

    def apply_rows(self, table, rows):  # noqa: ANN001, ANN201
        if self.writes_left == 0:
            raise _Interrupt()
        self.writes_left -= 1
        return self.inner.apply_rows(table, rows)


def test_an_interrupt_in_one_table_ends_every_table_before_the_connection_closes(
        request, nats_url, postgres_dsn, clickhouse_url, unique_name, caplog):
    names = [f"t{i}" for i in range(6)]
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, names)
    publish_backlogs(nats_url, unique_name, names, 60)  # every table busy pulling, writing and acking
    failures: list[TableFailure] = []
    consumers = Consumers(
        config, StreamingConfig(batch_max_messages=2, batch_max_wait_seconds=0.3), idle_pull_seconds=30.0,
        wrap=lambda table, target: _InterruptOnWrite(target, writes_before=3) if table.name == "public.t3" else target)
    runner = GroupRunner(consumers.shared, list(config.tables), consumers, lambda report: None, failures.append)
    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(_Interrupt):
        runner.run()
    # Every other table ended with the run: none went on to fail against the closed connection,
    # and no table's task was left to fail on its own.
    assert failures == []
    assert not [r for r in caplog.records if r.name == "asyncio"], [r.getMessage()[:300] for r in caplog.records]
    consumers.close()


def test_dagsters_termination_signal_ends_a_busy_group_run_and_the_next_run_applies_the_rest(
        request, nats_url, postgres_dsn, clickhouse_url, unique_name, caplog):
    """Dagster terminates a run with SIGINT, whose handler raises in whatever frame the event loop
    is in. The run ends each time, however busy its tables and the queue's client are, leaves no
    task to fail after it, and nothing it had taken is lost: a second run applies every row."""
    from dagster._core.errors import DagsterExecutionInterruptedError
    from dagster._utils.interrupts import raise_interrupts_as

    names = [f"i{i}" for i in range(8)]
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, names)
    publish_backlogs(nats_url, unique_name, names, 40)
    runs: list[Consumers] = []
    for attempt in range(3):  # the signal lands somewhere else in the loop each time
        consumers = Consumers(config, StreamingConfig(batch_max_messages=2, batch_max_wait_seconds=0.05),
                              idle_pull_seconds=5.0, pipelined=True)
        runs.append(consumers)
        applied: list[BatchReport] = []

        def on_batch(report: BatchReport, applied: list[BatchReport] = applied, after: int = 3 + attempt) -> None:
            applied.append(report)
            if len(applied) == after:
                threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT)).start()

        runner = GroupRunner(consumers.shared, list(config.tables), consumers, on_batch, lambda failure: None)
        with caplog.at_level(logging.ERROR, logger="asyncio"), raise_interrupts_as(DagsterExecutionInterruptedError), \
                pytest.raises(DagsterExecutionInterruptedError):
            runner.run()  # never drained on its own: without the signal it would stream on
        assert len(applied) >= 3 + attempt
        assert not [r for r in caplog.records if r.name == "asyncio"], [r.getMessage()[:300] for r in caplog.records]
    drain = Consumers(config, StreamingConfig(batch_max_messages=50, batch_max_wait_seconds=0.05))
    runs.append(drain)
    GroupRunner(drain.shared, list(config.tables), drain, lambda report: None,
                lambda failure: None).run(stop_when_drained=True)
    for name in names:
        assert rows_of(drain.opened[-1], name) == [(str(i), f"{name} {i}", str(i)) for i in range(40)], name
    for consumers in runs:
        consumers.close()


def test_an_interrupted_run_hands_back_the_applied_batches_whose_reports_it_had_not_written(
        request, nats_url, postgres_dsn, clickhouse_url, unique_name):
    """An interrupt drops the reports still queued behind a slow event log, but not the batches
    they describe: the run hands those back, so every applied batch is reported once, by the
    reporting thread or by the caller (a table the stream made included)."""
    from dagster._core.errors import DagsterExecutionInterruptedError
    from dagster._utils.interrupts import raise_interrupts_as

    names = [f"u{i}" for i in range(4)]
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, names)
    publish_backlogs(nats_url, unique_name, names, 30)
    consumers = Consumers(config, StreamingConfig(batch_max_messages=2, batch_max_wait_seconds=0.05),
                          idle_pull_seconds=5.0, pipelined=True)
    reported: list[BatchReport] = []

    def on_batch(report: BatchReport) -> None:
        reported.append(report)
        if len(reported) == 3:
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT)).start()
        time.sleep(0.3)  # an event log that takes its time: reports queue up behind it

    applied: list[tuple[BatchReport, str]] = []  # what the run's metrics record, and on which thread
    runner = GroupRunner(consumers.shared, list(config.tables), consumers, on_batch, lambda failure: None,
                         on_applied=lambda report: applied.append((report, threading.current_thread().name)))
    with raise_interrupts_as(DagsterExecutionInterruptedError), pytest.raises(DagsterExecutionInterruptedError):
        runner.run()
    unreported = runner.unreported_batches()
    assert unreported, "no report was queued when the interrupt came: nothing was tested"
    first_run = reported + unreported
    assert len({(r.table, r.first_sequence) for r in first_run}) == len(first_run), "a batch reported twice"
    # The metrics' hook saw every applied batch once, as it was acked, on the run's own thread, not
    # behind the reports.
    assert sorted((r.table, r.first_sequence) for r, _ in applied) == \
        sorted((r.table, r.first_sequence) for r in first_run)
    assert {thread for _, thread in applied} == {threading.current_thread().name}
    assert any(r.created_table for r in first_run)
    drain = Consumers(config, StreamingConfig(batch_max_messages=50, batch_max_wait_seconds=0.05))
    drained: list[BatchReport] = []
    GroupRunner(drain.shared, list(config.tables), drain, drained.append, lambda failure: None).run(
        stop_when_drained=True)
    for name in names:
        # Every package applied by one run or the other is in a report: none went unreported.
        events = sum(r.events for r in first_run + drained if r.table == f"public.{name}")
        assert events >= 30, (name, events)
        assert rows_of(drain.opened[-1], name) == [(str(i), f"{name} {i}", str(i)) for i in range(30)], name
    for each in (consumers, drain):
        each.close()


class _SlowWrites(_WrappedTarget):
    """A real target whose writes take a while longer, as a busy warehouse's do."""

    def __init__(self, inner, seconds: float) -> None:  # noqa: ANN001
        super().__init__(inner)
        self.seconds = seconds

    def apply_rows(self, table, rows):  # noqa: ANN001, ANN201
        time.sleep(self.seconds)
        return self.inner.apply_rows(table, rows)


def test_a_group_run_takes_no_more_batches_at_once_than_it_writes(request, nats_url, postgres_dsn,
                                                                   clickhouse_url, unique_name):
    """With more busy tables than apply threads, a table waits for its turn before it takes its
    messages, so what it takes is as fresh as can be; taken batches never queue for a thread."""
    names = [f"w{i}" for i in range(6)]
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, names)
    publish_backlogs(nats_url, unique_name, names, 30)
    reports: list[BatchReport] = []
    taken: set[str] = set()  # tables whose batch is taken and not yet acked (both on the event loop)
    most_taken = [0]

    class Watched(StreamConsumer):
        async def _take_waiting(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            taken.add(self.table.name)
            most_taken[0] = max(most_taken[0], len(taken))
            return await super()._take_waiting(*args, **kwargs)

        async def _finish(self, batch):  # noqa: ANN001, ANN202
            try:
                return await super()._finish(batch)
            finally:
                taken.discard(self.table.name)

    consumers = Consumers(config, StreamingConfig(batch_max_messages=5, batch_max_wait_seconds=0.05),
                          idle_pull_seconds=5.0, wrap=lambda table, target: _SlowWrites(target, 0.1), kind=Watched)

    def on_batch(report: BatchReport) -> None:
        reports.append(report)
        if sum(r.events for r in reports) == 30 * len(names):
            runner.stop()

    runner = GroupRunner(consumers.shared, list(config.tables), consumers, on_batch, lambda failure: None,
                         apply_threads=2)
    summary = runner.run()
    assert {name: totals.events for name, totals in summary.tables.items()} == {f"public.{n}": 30 for n in names}
    assert most_taken[0] == 2
    assert sum(r.seconds["queued"] for r in reports) > 0  # waiting for a turn is reported as queued
    # Every table's backlog was waiting when its batches began: none waited for the pace.
    assert {r.gathered for r in reports} <= {"backlog", "waiting_for_turn"} and "backlog" in {r.gathered for r in reports}
    consumers.close()


class _FailingWrites(_WrappedTarget):
    """A real target whose writes fail, each failure noted with its time."""

    def __init__(self, inner, failures: list[float]) -> None:  # noqa: ANN001
        super().__init__(inner)
        self.failures = failures

    def apply_rows(self, table, rows):  # noqa: ANN001, ANN201
        self.failures.append(time.monotonic())
        raise RuntimeError("the warehouse refused the write")


def test_a_batch_waiting_to_retry_gives_its_turn_to_the_other_tables(request, nats_url, postgres_dsn,
                                                                     clickhouse_url, unique_name):
    """With one turn, a table whose writes keep failing (on_error: retry) still lets another table
    apply its batches between its attempts."""
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, ["good", "bad"], on_error="retry")
    publish(nats_url, unique_name, [package([insert(0x500, "1", "bad 1", "1")], table="bad")], table="bad")
    failures: list[float] = []
    applied: list[float] = []
    consumers = Consumers(
        config, StreamingConfig(batch_max_wait_seconds=0.05), idle_pull_seconds=0.5,
        wrap=lambda table, target: _FailingWrites(target, failures) if table.name == "public.bad" else target,
        retry=RetryPolicy(attempts=3, initial_wait_seconds=1.5, max_wait_seconds=1.5))

    def on_batch(report: BatchReport) -> None:
        applied.append(time.monotonic())

    def on_failure(failure: TableFailure) -> None:
        runner.stop()  # the bad table used up its attempts

    def feed_good_table() -> None:
        # Once the bad table failed its first attempt and waits to retry, the good table gets changes.
        deadline = time.monotonic() + 30
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        publish(nats_url, unique_name, [package([insert(0x510 + i, str(i), f"good {i}", str(i))], table="good")
                                        for i in range(3)], table="good")

    runner = GroupRunner(consumers.shared, list(config.tables), consumers, on_batch, on_failure, apply_threads=1)
    feeder = threading.Thread(target=feed_good_table, daemon=True)
    feeder.start()
    summary = runner.run()
    feeder.join(5)
    assert len(failures) == 3
    assert summary.tables["public.good"].events == 3
    # The good table's batch was applied while the bad one waited between its attempts, not after.
    assert applied and failures[0] < applied[0] < failures[-1]
    consumers.close()


def test_a_run_stopped_while_tables_wait_for_turns_ends_after_the_batches_it_is_writing(
        request, nats_url, postgres_dsn, clickhouse_url, unique_name):
    """A stop does not wait for one more batch of every table waiting for a turn; what they had
    taken stays unacknowledged, and the next run applies it all."""
    names = [f"s{i}" for i in range(6)]
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, names)
    publish_backlogs(nats_url, unique_name, names, 30)
    applied: list[BatchReport] = []
    stopped_after: list[int] = []
    runs: list[Consumers] = []

    def run_once(stop_when_drained: bool) -> None:
        consumers = Consumers(config, StreamingConfig(batch_max_messages=5, batch_max_wait_seconds=0.05),
                              idle_pull_seconds=None if stop_when_drained else 5.0,
                              wrap=lambda table, target: _SlowWrites(target, 0.3))
        runs.append(consumers)

        def on_batch(report: BatchReport) -> None:
            applied.append(report)
            if not stop_when_drained and not stopped_after:
                stopped_after.append(len(applied))
                runner.stop()

        runner = GroupRunner(consumers.shared, list(config.tables), consumers, on_batch, lambda failure: None,
                             apply_threads=1)
        runner.run(stop_when_drained=stop_when_drained)

    run_once(stop_when_drained=False)
    # One turn: at most the batch being written when the stop came, and the one holding the turn.
    assert len(applied) - stopped_after[0] <= 1, [r.table for r in applied]
    run_once(stop_when_drained=True)
    for name in names:
        assert len(rows_of(runs[-1].opened[-1], name)) == 30, name
    for consumers in runs:
        consumers.close()


def test_a_tables_first_batch_goes_ahead_of_the_batches_of_tables_already_streaming(
        request, nats_url, postgres_dsn, clickhouse_url, unique_name):
    """With one turn and four busy tables waiting in line, three tables whose first messages
    arrive later are applied before any of the four writes again (beyond the batch being written):
    a table is not left out of the run while the others take turns."""
    busy, new = [f"b{i}" for i in range(4)], [f"n{i}" for i in range(3)]
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, busy + new)
    publish_backlogs(nats_url, unique_name, busy, 60)
    reports: list[BatchReport] = []
    published_at: list[int] = []  # how many batches were applied when the new tables' messages were out
    consumers = Consumers(config, StreamingConfig(batch_max_messages=5, batch_max_wait_seconds=0.05),
                          idle_pull_seconds=1.0, wrap=lambda table, target: _SlowWrites(target, 0.3))

    def publish_new() -> None:
        publish_backlogs(nats_url, unique_name, new, 5)
        published_at.append(len(reports))

    def on_batch(report: BatchReport) -> None:
        reports.append(report)
        streaming = {r.table for r in reports}
        if not published_at and len(reports) >= 8 and streaming == {f"public.{n}" for n in busy}:
            threading.Thread(target=publish_new).start()
        if {f"public.{n}" for n in new} <= streaming:
            runner.stop()

    runner = GroupRunner(consumers.shared, list(config.tables), consumers, on_batch, lambda failure: None,
                         apply_threads=1)
    runner.run()
    after = [r.table.removeprefix("public.") for r in reports[published_at[0]:]]
    last_new = max(after.index(n) for n in new)
    # Before the new tables' first batches: at most the batch being written when they arrived and
    # the one that held the turn then. In arrival order the three busy tables waiting in line would
    # each have written first.
    assert len([t for t in after[:last_new] if t in busy]) <= 2, after
    consumers.close()


def test_a_tables_first_batch_does_not_wait_for_the_pace_and_its_later_ones_do(
        request, nats_url, postgres_dsn, clickhouse_url, unique_name):
    """The pace makes a busy run's batches collect longer; a table's first batch is applied at
    once, since the table is not streaming until it lands."""
    config = group_config(unique_name, postgres_dsn, nats_url, clickhouse_url, ["paced"])
    publish_backlogs(nats_url, unique_name, ["paced"], 1)
    reports: list[BatchReport] = []
    consumers = Consumers(config, StreamingConfig(batch_max_messages=5, batch_max_wait_seconds=0.05),
                          idle_pull_seconds=1.0)

    def publish_later() -> None:
        publish(nats_url, unique_name, [package([insert(0x400, "9", "paced later", "9")], table="paced")],
                table="paced")

    def on_batch(report: BatchReport) -> None:
        reports.append(report)
        if len(reports) == 1:
            threading.Thread(target=publish_later).start()
        else:
            runner.stop()

    runner = GroupRunner(consumers.shared, list(config.tables), consumers, on_batch, lambda failure: None,
                         pace=BatchPace(8.0, 50.0), apply_threads=2, first_batch_turns=2)
    runner.run()
    assert len(reports) == 2
    assert reports[0].latency_seconds < 5.0  # from its message's pull to its ack: no 8 s of pace
    assert reports[1].latency_seconds >= 7.5  # a later batch of a quiet table collects for the pace
    assert [r.gathered for r in reports] == ["first_batch", "paced"]  # as /metrics counts them
    consumers.close()
