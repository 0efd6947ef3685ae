"""The streaming apply end to end: synthetic packages published to a real NATS JetStream stream,
applied by `StreamConsumer` through local Spark to the embedded ClickHouse server and to Snowflake
(fakesnow), with crashes, dead letters and stops."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import nats
import nats.errors
import psycopg
import pyarrow as pa
import pytest
import zstandard
from psycopg import sql
from pyspark.sql import SparkSession

from siphon_core import naming
from siphon_core.config import StreamingConfig, TableConfig, parse_config
from siphon_core.queue import JetStreamQueue, StreamSettings
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import encode_package, message_id
from siphon_core.wire.tuple_data import UNCHANGED_TOAST as U
from siphon_dagster.streaming.consumer import StreamApplyError, StreamConsumer
from siphon_dagster.streaming.report import BatchReport
from siphon_dagster.streaming.schema import table_schema
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.streaming.spark_facts import decode_slices
from siphon_dagster.streaming.spark_session import get_spark_session
from siphon_dagster.targets import build_target
from siphon_dagster.targets.base import TableSchema, Target
from tests.unit.test_streaming_packages import NOTES, column, delete, insert, package, update

FAST = StreamingConfig(batch_max_messages=3, batch_max_wait_seconds=0.3)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    yield get_spark_session()


def make_target(request: pytest.FixtureRequest, name: str, unique_name: str) -> Target:
    """A target whose ClickHouse database or Snowflake schema belongs to this test alone."""
    if name == "clickhouse":
        targets = {"clickhouse": {"url": request.getfixturevalue("clickhouse_url"), "database": unique_name}}
    else:
        env = request.getfixturevalue("snowflake_env")
        targets = {"snowflake": {
            "account": env["SIPHON_SNOWFLAKE_ACCOUNT"], "user": env["SIPHON_SNOWFLAKE_USER"],
            "password": env["SIPHON_SNOWFLAKE_PASSWORD"], "host": env["SIPHON_SNOWFLAKE_HOST"],
            "port": int(env["SIPHON_SNOWFLAKE_PORT"]), "protocol": env["SIPHON_SNOWFLAKE_PROTOCOL"],
            "database": "SIPHON", "schema": unique_name}}
    config = parse_config({"application_identifier": unique_name, "source": {"dsn": "postgresql://x@127.0.0.1/x"},
                           "tables": [{"name": "public.notes"}], "targets": targets})
    return build_target(name, config)


def queue(nats_url: str, application: str) -> JetStreamQueue:
    return JetStreamQueue(nats_url, StreamSettings(application))


def publish(nats_url: str, application: str, messages: Sequence[pb.Package | bytes], schema: str = "public",
            table: str = "notes") -> list[int]:
    """Publishes packages (or raw bytes) to the table's subject; returns their stream sequences."""

    async def run() -> list[int]:
        publisher = queue(nats_url, application)
        await publisher.connect()
        try:
            await publisher.ensure_stream()
            subject = naming.table_subject(application, schema, table)
            sequences = []
            for i, message in enumerate(messages):
                if isinstance(message, bytes):
                    sequences.append(await publisher.publish(subject, message, f"raw-{i}"))
                else:
                    sequences.append(await publisher.publish(subject, encode_package(message), message_id(message)))
            return sequences
        finally:
            await publisher.close()

    return asyncio.run(run())


def dead_letters(nats_url: str, application: str) -> list[tuple[int, str]]:
    """(original stream sequence, error) of every message on the table's dead-letter subject."""

    async def run() -> list[tuple[int, str]]:
        client = await nats.connect(nats_url)
        try:
            js = client.jetstream()
            subscription = await js.pull_subscribe(naming.dead_letter_subject(application, "public", "notes"),
                                                   stream=naming.stream_name(application))
            try:
                messages = await subscription.fetch(10, timeout=2)
            except nats.errors.TimeoutError:
                return []
            return [(int(m.headers["Siphon-Stream-Sequence"]), m.headers["Siphon-Error"]) for m in messages]
        finally:
            await client.close()

    return asyncio.run(run())


def consumer(nats_url: str, application: str, target: Target, spark: SparkSession, on_error: str = "stop",
             table: str = "public.notes", source: SourceRowReader | None = None) -> StreamConsumer:
    return StreamConsumer(queue(nats_url, application), target, TableConfig(name=table, on_error=on_error), spark,
                          FAST, source=source)


def notes_schema(columns: Sequence[pb.Column] = NOTES, schema: str = "public") -> TableSchema:
    return table_schema(schema, "notes", columns)


class CrashAfterCommit:
    """Delegates to a real target, then fails once right after a batch was committed, before the ack."""

    def __init__(self, inner: Target, crash_on_call: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls = 0
        self.crash_on_call = crash_on_call

    def __getattr__(self, attribute: str) -> object:
        return getattr(self.inner, attribute)

    def apply_rows(self, table: TableSchema, rows: pa.Table) -> int:
        written = self.inner.apply_rows(table, rows)
        self.calls += 1
        if self.calls == self.crash_on_call:
            raise RuntimeError("simulated crash after the target committed, before the ack")
        return written


class ExitAfterCommit(CrashAfterCommit):
    """The process dies on the spot after the target committed: no unsubscribe, no close, no ack."""

    def apply_rows(self, table: TableSchema, rows: pa.Table) -> int:
        written = self.inner.apply_rows(table, rows)
        self.calls += 1
        if self.calls == self.crash_on_call:
            os._exit(17)
        return written


def run_until_exit(nats_url: str, clickhouse_url: str, application: str) -> None:
    """Body of the child process of the process-exit test."""
    config = parse_config({"application_identifier": application, "source": {"dsn": "postgresql://x@127.0.0.1/x"},
                           "tables": [{"name": "public.notes"}],
                           "targets": {"clickhouse": {"url": clickhouse_url, "database": application}}})
    target = ExitAfterCommit(build_target("clickhouse", config), crash_on_call=2)
    consumer(nats_url, application, target, get_spark_session()).run(stop_when_drained=True)  # type: ignore[arg-type]


STORY = [
    package([insert(0x100, "1", "a", "1"), insert(0x100, "2", "b", "2", position=2), insert(0x100, "3", "c", "3", position=3)]),
    package([update(0x101, "1", "a" * 3000, "10"), delete(0x102, "2", None, None)]),
    package([update(0x103, "1", U, "11"), update(0x104, "30", U, "3", old_key=["3", None, None])]),
    package([insert(0x105, "2", "b again", "20")]),
    package([update(0x106, "2", U, "21"), update(0x107, "1", U, "12")]),
    package([insert(0x108, "4", None, "4"), delete(0x109, "30", None, None)]),
]
STORY_ROWS = [("1", "a" * 3000, "12"), ("2", "b again", "21"), ("4", None, "4")]


@pytest.mark.parametrize("target_name", ["clickhouse", "snowflake"])
def test_stream_converges_at_the_target(request: pytest.FixtureRequest, nats_url: str, spark: SparkSession,
                                        unique_name: str, target_name: str) -> None:
    target = make_target(request, target_name, unique_name)
    sequences = publish(nats_url, unique_name, STORY)
    reports: list[BatchReport] = []
    summary = consumer(nats_url, unique_name, target, spark).run(stop_when_drained=True, on_batch=reports.append)
    assert target.current_rows_as_text(notes_schema()) == STORY_ROWS
    assert summary.events == 12 and summary.applied_lsn == 0x109
    assert [(r.first_sequence, r.last_sequence) for r in reports] == [(sequences[0], sequences[2]),
                                                                      (sequences[3], sequences[5])]
    assert reports[-1].pending == 0 and reports[-1].applied_lsn_text == "0/109"
    assert reports[0].rows_by_operation == {"insert": 3, "update": 3, "delete": 1}
    assert reports[0].lag_oldest_seconds >= reports[0].lag_newest_seconds > 0
    # Every phase is timed, and what the apply waited beyond its phases is one of them.
    for report in reports:
        assert {"pull", "apply", "ack", "queued"} <= set(report.seconds) and min(report.seconds.values()) >= 0
        assert sum(report.seconds.values()) <= report.latency_seconds + 0.05
    # Snowflake says how it loaded each batch: batches this small go as the VALUES of their MERGE.
    assert [r.load_path for r in reports] == ([None, None] if target_name == "clickhouse" else ["values", "values"])
    target.close()


def test_a_crash_after_commit_before_ack_replays_and_converges(request: pytest.FixtureRequest, nats_url: str,
                                                               spark: SparkSession, unique_name: str) -> None:
    target = make_target(request, "clickhouse", unique_name)
    publish(nats_url, unique_name, STORY)
    crashing = CrashAfterCommit(target, crash_on_call=2)
    with pytest.raises(StreamApplyError, match="simulated crash"):
        consumer(nats_url, unique_name, crashing, spark).run(stop_when_drained=True)  # type: ignore[arg-type]
    # More changes arrive while the run is down; the next run replays the unacknowledged batch first.
    publish(nats_url, unique_name, [package([update(0x200, "4", U, "40")])])
    summary = consumer(nats_url, unique_name, target, spark).run(stop_when_drained=True)
    assert summary.events == 6  # the second batch again, then the new package
    assert target.current_rows_as_text(notes_schema()) == [*STORY_ROWS[:2], ("4", None, "40")]
    target.close()


def test_a_process_exit_mid_run_replays_and_converges(request: pytest.FixtureRequest, nats_url: str,
                                                       clickhouse_url: str, spark: SparkSession,
                                                       unique_name: str) -> None:
    target = make_target(request, "clickhouse", unique_name)
    publish(nats_url, unique_name, STORY)
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from tests.integration.test_streaming_consumer import run_until_exit; "
                               "run_until_exit(*sys.argv[1:])", nats_url, clickhouse_url, unique_name],
        cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert child.returncode == 17, child.stderr[-3000:]
    summary = consumer(nats_url, unique_name, target, spark).run(stop_when_drained=True)
    assert summary.events == 5  # the batch applied but never acknowledged, applied again
    assert target.current_rows_as_text(notes_schema()) == STORY_ROWS
    target.close()


def test_dead_letter_moves_bad_messages_aside_and_goes_on(request: pytest.FixtureRequest, nats_url: str,
                                                          spark: SparkSession, unique_name: str) -> None:
    target = make_target(request, "clickhouse", unique_name)
    sequences = publish(nats_url, unique_name, [
        package([insert(0x100, "1", "a", "1")]),
        b"not a package",
        package([insert(0x101, "2", b"\xff not UTF-8", "2")]),  # cannot be applied
        package([insert(0x102, "3", "c", "3")]),
    ])
    reports: list[BatchReport] = []
    consumer(nats_url, unique_name, target, spark, on_error="dead_letter").run(stop_when_drained=True,
                                                                             on_batch=reports.append)
    assert target.current_rows_as_text(notes_schema()) == [("1", "a", "1"), ("3", "c", "3")]
    assert sorted(s for r in reports for s in r.dead_lettered) == [sequences[1], sequences[2]]
    letters = dict(dead_letters(nats_url, unique_name))
    assert sorted(letters) == [sequences[1], sequences[2]]
    assert "not a zstd-compressed package" in letters[sequences[1]]
    assert reports[-1].pending == 0
    target.close()


def test_dead_letter_moves_nothing_aside_while_the_target_is_down(request: pytest.FixtureRequest, nats_url: str,
                                                                  spark: SparkSession, unique_name: str) -> None:
    """A ClickHouse no one listens for: every package fails alone, and none of them is bad. The table
    stops with its messages unacknowledged, and a run against the target applies them all."""
    publish(nats_url, unique_name, [package([insert(0x100, "1", "a", "1")]), package([insert(0x101, "2", "b", "2")])])
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    config = parse_config({"application_identifier": unique_name, "source": {"dsn": "postgresql://x@127.0.0.1/x"},
                           "tables": [{"name": "public.notes"}],
                           "targets": {"clickhouse": {"url": f"http://127.0.0.1:{closed_port}", "database": unique_name}}})
    down = build_target("clickhouse", config)
    with pytest.raises(StreamApplyError, match="the target does not answer"):
        consumer(nats_url, unique_name, down, spark, on_error="dead_letter").run(stop_when_drained=True)
    down.close()
    assert dead_letters(nats_url, unique_name) == []
    target = make_target(request, "clickhouse", unique_name)
    reports: list[BatchReport] = []
    consumer(nats_url, unique_name, target, spark, on_error="dead_letter").run(stop_when_drained=True,
                                                                             on_batch=reports.append)
    assert target.current_rows_as_text(notes_schema()) == [("1", "a", "1"), ("2", "b", "2")]
    assert [s for r in reports for s in r.dead_lettered] == []
    target.close()


def test_hostile_messages_are_dead_lettered_never_taken_for_a_schema_change(
        request: pytest.FixtureRequest, nats_url: str, spark: SparkSession, unique_name: str) -> None:
    target = make_target(request, "clickhouse", unique_name)
    hostile = [
        zstandard.ZstdCompressor().compress(b""),  # 9 bytes: an empty package
        zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20)),  # expands to 64 MB
        encode_package(pb.Package(schema="public", table="notes", events=[insert(0x105, "9", "x", "9")])),  # no columns
    ]
    sequences = publish(nats_url, unique_name, [package([insert(0x100, "1", "a", "1")]), *hostile,
                                                 package([insert(0x110, "3", "c", "3")])])
    reports: list[BatchReport] = []
    consumer(nats_url, unique_name, target, spark, on_error="dead_letter").run(stop_when_drained=True,
                                                                             on_batch=reports.append)
    assert target.current_rows_as_text(notes_schema()) == [("1", "a", "1"), ("3", "c", "3")]
    letters = dict(dead_letters(nats_url, unique_name))
    assert sorted(letters) == sequences[1:4]
    assert "an empty package" in letters[sequences[1]]
    assert "decompresses to more than" in letters[sequences[2]]
    assert "without columns" in letters[sequences[3]]
    # Under on_error: stop the table stops on the bad message itself, with no advice to rebuild it.
    bad = publish(nats_url, unique_name, hostile[:1], table="other")
    with pytest.raises(StreamApplyError, match=rf"stream sequence {bad[0]} is not a Siphon package .*empty package") \
            as raised:
        consumer(nats_url, unique_name, target, spark, table="public.other").run(stop_when_drained=True)
    assert "primary key" not in str(raised.value) and "drop" not in str(raised.value)
    target.close()


def test_stop_strategy_names_table_sequences_and_lsn(request: pytest.FixtureRequest, nats_url: str,
                                                     spark: SparkSession, unique_name: str) -> None:
    target = make_target(request, "clickhouse", unique_name)
    sequences = publish(nats_url, unique_name, [package([insert(0x1A0, "1", b"\xff not UTF-8", "1")])])
    with pytest.raises(StreamApplyError) as raised:
        consumer(nats_url, unique_name, target, spark).run(stop_when_drained=True)
    message = str(raised.value)
    assert f"table public.notes (target clickhouse): cannot apply stream sequences {sequences[0]}-{sequences[0]}" in message
    assert "commit LSN 0/1A0 to 0/1A0" in message
    assert "column body: a value is not valid UTF-8" in message and "on_error: retry or dead_letter" in message
    garbage = publish(nats_url, unique_name, [b"garbage"], table="other")
    with pytest.raises(StreamApplyError, match=rf"public\.other .* stream sequence {garbage[0]} is not a Siphon package .*dead_letter"):
        consumer(nats_url, unique_name, target, spark, table="public.other").run(stop_when_drained=True)
    target.close()


def test_unchanged_values_are_re_read_from_the_source_as_postgresql_prints_them(
        request: pytest.FixtureRequest, nats_url: str, postgres_dsn: str, spark: SparkSession,
        unique_name: str) -> None:
    columns = (*NOTES, column("flag", 16, "boolean"), column("code", 1042, "character(5)"))
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        connection.execute(sql.SQL("create table {}.notes (id bigint primary key, body text, score integer, "
                                   "flag boolean, code char(5))").format(sql.Identifier(unique_name)))
        connection.execute(sql.SQL("insert into {}.notes values (1, 'at the source', 5, true, 'ab')").format(
            sql.Identifier(unique_name)))
    target = make_target(request, "clickhouse", unique_name)
    publish(nats_url, unique_name, [package([update(0x300, "1", U, "6", U, U)], columns=columns, schema=unique_name)],
            schema=unique_name)
    source = SourceRowReader(postgres_dsn)
    summary = consumer(nats_url, unique_name, target, spark, table=f"{unique_name}.notes", source=source).run(
        stop_when_drained=True)
    assert summary.rows_applied == 1
    assert target.current_rows_as_text(notes_schema(columns, unique_name)) == [("1", "at the source", "6", "t", "ab   ")]
    source.close()
    target.close()


BIG = "b" * 3000  # stands for a TOASTed value
WITH_TAG = (*NOTES, column("tag"))
PIPELINED = [
    # Batch 1 (3 messages a batch): rows with large values.
    package([insert(0x100, "1", BIG, "1"), insert(0x100, "2", BIG, "2", position=2)]),
    package([insert(0x101, "3", BIG, "3"), insert(0x101, "4", BIG, "4", position=2)]),
    package([insert(0x102, "5", "five", "5"), insert(0x102, "6", "six", "6", position=2)]),
    # Batch 2, same schema: may be decoded while batch 1 is written; its unchanged values can only
    # come from the rows batch 1 wrote.
    package([update(0x103, "1", U, "10")]),
    package([update(0x104, "2", U, "20")]),
    package([update(0x105, "3", U, "30"), delete(0x105, "6", None, None, position=2)]),
    # Batch 3 adds a column: never prepared before batch 2 is written.
    package([insert(0x106, "7", "seven", "7", "t7")], columns=WITH_TAG),
    package([update(0x107, "4", U, "40", "t4")], columns=WITH_TAG),
    package([delete(0x108, "5", None, None, None)], columns=WITH_TAG),
    # Batch 4 fills an unchanged value of the added column from batch 3's write.
    package([update(0x109, "1", U, "11", "t1")], columns=WITH_TAG),
    package([update(0x10A, "7", U, "70", U)], columns=WITH_TAG),
    package([insert(0x10B, "8", BIG, "8", None)], columns=WITH_TAG),
]


def test_keys_that_several_spark_tasks_saw_keep_their_newest_row_at_clickhouse(
        request: pytest.FixtureRequest, nats_url: str, spark: SparkSession, unique_name: str) -> None:
    target = make_target(request, "clickhouse", unique_name)
    # Every package changes every key; the last deletes key 3 and inserts key 5 again after its delete.
    story = [package([update(0x100 + 16 * p + k, str(k), f"v{p}", str(p), position=1) if p else
                      insert(0x100 + k, str(k), "v0", "0") for k in range(6)]) for p in range(5)]
    story.append(package([delete(0x200, "3", None, None), delete(0x201, "5", None, None),
                          insert(0x202, "5", "back", "9")]))
    publish(nats_url, unique_name, story)
    reports: list[BatchReport] = []
    streaming = StreamingConfig(batch_max_messages=len(story), batch_max_wait_seconds=2.0, driver_decode_max_bytes=0)
    StreamConsumer(queue(nats_url, unique_name), target, TableConfig(name="public.notes"), spark, streaming).run(
        stop_when_drained=True, on_batch=reports.append)

    assert len(reports) == 1 and not reports[0].decoded_in_driver
    assert target.current_rows_as_text(notes_schema()) == [
        ("0", "v4", "4"), ("1", "v4", "4"), ("2", "v4", "4"), ("4", "v4", "4"), ("5", "back", "9")]
    # Each Spark task folded its packages; the newest row of a key another task also holds is not
    # taken out before the write (ClickHouse keeps the greatest version).
    tasks = min(decode_slices(spark), len(story))
    rows = reports[0].rows_applied
    assert 6 < rows <= 6 * tasks if tasks > 1 else rows == 6, (rows, tasks)
    target.close()


def test_batches_prepared_while_the_one_before_is_written_converge(request: pytest.FixtureRequest, nats_url: str,
                                                                    spark: SparkSession, unique_name: str) -> None:
    target = make_target(request, "clickhouse", unique_name)
    publish(nats_url, unique_name, PIPELINED)
    reports: list[BatchReport] = []
    summary = consumer(nats_url, unique_name, target, spark).run(stop_when_drained=True, on_batch=reports.append)
    assert summary.events == 16 and summary.applied_lsn == 0x10B
    assert target.current_rows_as_text(notes_schema(WITH_TAG)) == [
        ("1", BIG, "11", "t1"), ("2", BIG, "20", None), ("3", BIG, "30", None), ("4", BIG, "40", "t4"),
        ("7", "seven", "70", "t7"), ("8", BIG, "8", None)]
    early = [r.prepared_early for r in reports]
    assert len(early) == 4 and early[1], f"batch 2's messages were there while batch 1 was written: {early}"
    assert not early[2], "a batch that changes the schema is prepared only after the batch before is written"
    assert [r.unchanged_values_filled for r in reports] == [0, 3, 1, 3]
    target.close()


def test_one_batch_in_flight_converges_and_prepares_nothing_ahead(request: pytest.FixtureRequest, nats_url: str,
                                                                 spark: SparkSession, unique_name: str) -> None:
    # As a run of many tables applies each of them: the next batch is pulled once this one is acked.
    target = make_target(request, "clickhouse", unique_name)
    publish(nats_url, unique_name, PIPELINED)
    reports: list[BatchReport] = []
    run = consumer(nats_url, unique_name, target, spark)
    run.pipelined = False
    summary = run.run(stop_when_drained=True, on_batch=reports.append)
    assert summary.events == 16 and summary.applied_lsn == 0x10B
    assert target.current_rows_as_text(notes_schema(WITH_TAG)) == [
        ("1", BIG, "11", "t1"), ("2", BIG, "20", None), ("3", BIG, "30", None), ("4", BIG, "40", "t4"),
        ("7", "seven", "70", "t7"), ("8", BIG, "8", None)]
    assert reports and not any(r.prepared_early for r in reports)
    target.close()


def test_a_batch_pulled_with_none_in_flight_is_cut_at_a_quarter_of_the_byte_limit(
        request: pytest.FixtureRequest, nats_url: str, spark: SparkSession, unique_name: str) -> None:
    # Behind a backlog, the first batch is decoded while nothing is written: a small one lets the
    # writes start sooner, and the batches after it are full again.
    target = make_target(request, "clickhouse", unique_name)
    bodies = [os.urandom(1000).hex() for _ in range(12)]  # about 1 KB a message, compressed
    packages = [package([insert(0x400 + i, str(i), body, "1")]) for i, body in enumerate(bodies)]
    size = max(len(encode_package(p)) for p in packages)
    publish(nats_url, unique_name, packages)
    # A quarter of the byte limit holds 4.5 messages: the first batch takes 5.
    sizes = StreamingConfig(batch_max_messages=1000, batch_max_bytes=18 * size, batch_max_wait_seconds=0.3)
    run = StreamConsumer(queue(nats_url, unique_name), target, TableConfig(name="public.notes"), spark, sizes)
    reports: list[BatchReport] = []
    run.run(stop_when_drained=True, on_batch=reports.append)
    assert [r.messages for r in reports] == [5, 7], "a quarter of the byte limit, then the rest in one request"
    assert target.current_rows_as_text(notes_schema()) == [(str(i), body, "1") for i, body in enumerate(bodies)]
    target.close()


class SlowFirstWrite(CrashAfterCommit):
    """Delegates to a real target; its first write takes `seconds` longer."""

    def __init__(self, inner: Target, seconds: float) -> None:
        super().__init__(inner, crash_on_call=0)
        self.seconds = seconds

    def apply_rows(self, table: TableSchema, rows: pa.Table) -> int:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.seconds)
        return self.inner.apply_rows(table, rows)


def _consumer_with_ack_wait(nats_url: str, application: str, run: StreamConsumer, ack_wait_seconds: float) -> None:
    async def create() -> None:
        client = queue(nats_url, application)
        await client.connect()
        try:
            await client.ensure_stream()
            await client.ensure_consumer(run.durable, run.subject, ack_wait_seconds=ack_wait_seconds)
        finally:
            await client.close()

    asyncio.run(create())


@pytest.mark.parametrize("marked", [True, False], ids=["marked_in_progress", "not_marked"])
def test_a_batch_slower_than_the_ack_wait_is_not_delivered_again(request: pytest.FixtureRequest, nats_url: str,
                                                                 spark: SparkSession, unique_name: str,
                                                                 marked: bool) -> None:
    target = make_target(request, "clickhouse", unique_name)
    # Five batches: the later ones are pulled (and their ack wait starts) while the first is written.
    later = [package([insert(0x300 + i, str(10 + i), "later", "1")]) for i in range(9)]
    publish(nats_url, unique_name, STORY + later)
    run = consumer(nats_url, unique_name, SlowFirstWrite(target, seconds=6), spark)  # type: ignore[arg-type]
    _consumer_with_ack_wait(nats_url, unique_name, run, ack_wait_seconds=2)
    # Marks every 0.5 s keep the 2 s ack wait from running out; with none, it runs out (the control).
    run.progress_interval_seconds = 0.5 if marked else 3600

    reports: list[BatchReport] = []
    summary = run.run(stop_when_drained=True, on_batch=reports.append)

    assert target.current_rows_as_text(notes_schema()) == STORY_ROWS + [(str(10 + i), "later", "1") for i in range(9)]
    first_sequences = [r.first_sequence for r in reports]
    if marked:
        assert summary.events == 21 and first_sequences == sorted(set(first_sequences)), first_sequences
    else:
        assert summary.events > 21, f"JetStream redelivers what the ack wait let run out: {first_sequences}"
    target.close()


def test_a_group_runs_batch_takes_at_once_what_already_waits(request: pytest.FixtureRequest, nats_url: str,
                                                              spark: SparkSession, unique_name: str) -> None:
    # Messages already behind the first one: the batch takes them without gathering (a batch wait
    # longer than the test's timeout would otherwise hold it up).
    target = make_target(request, "clickhouse", unique_name)
    publish(nats_url, unique_name, STORY)
    run = consumer(nats_url, unique_name, target, spark)
    run.pipelined = False
    run.idle_pull_seconds = 5.0
    run.batch_wait = lambda: 600.0
    reports: list[BatchReport] = []
    run.run(max_batches=2, on_batch=reports.append)
    assert [r.messages for r in reports] == [3, 3]  # FAST cuts batches at 3 messages
    assert target.current_rows_as_text(notes_schema()) == STORY_ROWS
    target.close()


def group_run_in_background(run: StreamConsumer, batch_wait: float, max_batches: int = 2,
                            first_report_within: float = 30.0) -> tuple[threading.Thread, list[BatchReport]]:
    """Starts `run` as a group run's table (one batch in flight, a long wait for its next first
    message) on a thread; returns once its first batch is reported, with the thread and the reports."""
    run.pipelined = False
    run.idle_pull_seconds = 30.0
    run.batch_wait = lambda: batch_wait
    reports: list[BatchReport] = []
    worker = threading.Thread(target=run.run, kwargs={"max_batches": max_batches, "on_batch": reports.append})
    worker.start()
    deadline = time.monotonic() + first_report_within
    while not reports and time.monotonic() < deadline:
        time.sleep(0.05)
    return worker, reports


def test_a_group_runs_batch_gathers_what_arrives_after_its_first_message(
        request: pytest.FixtureRequest, nats_url: str, spark: SparkSession, unique_name: str) -> None:
    # A table's first batch goes at once (the table is not streaming until it lands); its later
    # batches gather for the wait after their first message.
    target = make_target(request, "clickhouse", unique_name)
    publish(nats_url, unique_name, STORY[:1])
    run = consumer(nats_url, unique_name, target, spark)
    worker, reports = group_run_in_background(run, batch_wait=8.0)
    deadline = time.monotonic() + 30
    publish(nats_url, unique_name, STORY[1:2])
    while not run._unacked and time.monotonic() < deadline:  # the next first message is pulled: the batch gathers
        time.sleep(0.05)
    publish(nats_url, unique_name, STORY[2:3])
    worker.join(60)
    assert not worker.is_alive()
    assert [r.messages for r in reports] == [1, 2]
    assert reports[0].latency_seconds < 6.0 and reports[1].latency_seconds >= 7.5
    target.close()


def test_a_batch_takes_the_waiting_messages_that_arrive_after_its_request_s_short_wait(
        monkeypatch: pytest.MonkeyPatch, nats_url: str, unique_name: str) -> None:
    # A busy process reads its socket late: what a request brought after its wait would stay in the
    # subscription until the table's next batch. The messages say how many were behind them, and
    # the batch takes again while some were.
    from types import SimpleNamespace

    from siphon_dagster.streaming import consumer as consumer_module

    monkeypatch.setattr(consumer_module, "_TAKE_WAITING_SECONDS", 0.002)
    monkeypatch.setattr(consumer_module, "_TAKE_WAITING_MISSES", 50)
    waiting = 900
    publish(nats_url, unique_name, [bytes(1500) for _ in range(waiting)])
    durable = naming.consumer_name("clickhouse", "public", "notes")

    async def take() -> tuple[int, int]:
        jetstream = queue(nats_url, unique_name)
        await jetstream.connect()
        try:
            await jetstream.ensure_consumer(durable, naming.table_subject(unique_name, "public", "notes"))
            subscription = await jetstream.pull_subscription(durable, naming.table_subject(unique_name, "public", "notes"))
            first = await subscription.fetch(1, timeout=5)
            batch = SimpleNamespace(streaming=StreamingConfig(), _unacked={})
            taken = await StreamConsumer._take_waiting(batch, subscription, 1, len(first[0].data),
                                                       int(first[0].metadata.num_pending or 0))
            await asyncio.sleep(0.5)  # anything still on its way lands in the subscription meanwhile
            # A fetch takes what the subscription holds first; `pending_msgs` would also count the
            # server's late "no messages" answers to the batch's short requests.
            try:
                left = len(await subscription.fetch(waiting, timeout=0.5))
            except TimeoutError:
                left = 0
            return len(first) + len(taken), left
        finally:
            await jetstream.close()

    taken, left_behind = asyncio.run(take())
    assert (taken, left_behind) == (waiting, 0)


def _alive(kind: type, subject: str | None = None) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is kind and (subject is None or o.subject == subject))


def test_a_written_batch_is_not_kept_while_its_table_waits_for_the_next(
        request: pytest.FixtureRequest, nats_url: str, spark: SparkSession, unique_name: str) -> None:
    # A run of hundreds of tables waits on each for its next message; a batch kept through that wait
    # (messages, packages, folded rows) made every table hold its last one, and a run behind a
    # backlog grew by hundreds of MB of full batches.
    from nats.aio.msg import Msg

    from siphon_dagster.streaming.apply import PreparedBatch

    target = make_target(request, "clickhouse", unique_name)
    publish(nats_url, unique_name, STORY[:3])
    subject = naming.table_subject(unique_name, "public", "notes")
    worker, reports = group_run_in_background(consumer(nats_url, unique_name, target, spark), batch_wait=0.0,
                                              first_report_within=60)
    time.sleep(0.5)  # the loop is back at its pull, waiting for a message that is not there yet
    kept_messages, kept_batches = _alive(Msg, subject), _alive(PreparedBatch)
    publish(nats_url, unique_name, STORY[3:4])
    worker.join(60)
    assert not worker.is_alive()
    assert [r.messages for r in reports] == [3, 1]
    assert (kept_messages, kept_batches) == (0, 0)
    target.close()
