"""The streaming apply through Spark Connect: a StreamConsumer that is a thin client of a Spark
Connect server (`SIPHON_SPARK_REMOTE`), on a real stream (PostgreSQL -> siphon-producer ->
JetStream), converging in ClickHouse row for row, with the decode run by the server's Python workers.

The consumer runs in a child process. pyspark marks a process that connected to Spark Connect as a
Connect process for good (the SPARK_CONNECT_MODE_ENABLED variable switches its functions and its
builder) and refuses to connect while a local driver runs: the local Spark that other tests share
in this process must never meet a remote one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark import SparkContext

from siphon_core.config import TableConfig, parse_config
from siphon_dagster.streaming.consumer import StreamConsumer
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.streaming.spark_session import (
    REMOTE_ENVIRONMENT_VARIABLE,
    get_spark_session,
    stop_spark_session,
)
from siphon_dagster.targets import build_target
from siphon_stack.process import free_port
from siphon_stack.spark import SparkConnectServer
from tests.helpers.application import Application
from tests.integration.test_streaming_consumer import FAST, make_target, queue

REPOSITORY = Path(__file__).parents[2]


@dataclass(frozen=True)
class RunningServer:
    url: str
    pid: int


@pytest.fixture(scope="module")
def spark_connect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = SparkConnectServer(tmp_path_factory.mktemp("spark_connect"), free_port())
    pid = server.start()
    try:
        yield RunningServer(server.url, pid)
    finally:
        SparkConnectServer.stop(pid)


def descendants(pid: int) -> list[str]:
    """Command lines of every process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, pending = [], list(children.get(pid, []))
    while pending:
        child = pending.pop()
        pending += children.get(child, [])
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                found.append(cmdline.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def python_workers(pid: int) -> list[str]:
    return [c for c in descendants(pid) if "pyspark.daemon" in c or "pyspark.worker" in c]


def run_remote_consumer(nats_url: str, clickhouse_url: str, dsn: str, application: str, table: str) -> None:
    """Body of the child process: Spark comes from SIPHON_SPARK_REMOTE, as in a deployment."""
    spark = get_spark_session()
    try:
        config = parse_config({"application_identifier": application, "source": {"dsn": dsn}, "tables": [{"name": table}],
                               "targets": {"clickhouse": {"url": clickhouse_url, "database": application}}})
        target, source = build_target("clickhouse", config), SourceRowReader(dsn)
        summary = StreamConsumer(queue(nats_url, application), target, TableConfig(name=table), spark, FAST,
                                 source=source).run(stop_when_drained=True)
        source.close()
        target.close()
        waits = [policy.max_backoff * policy.max_retries for policy in spark.client.get_retry_policies()]
        print(json.dumps({"spark": type(spark).__module__, "longest_retry_wait_ms": max(waits),
                          "local_driver": SparkContext._active_spark_context is not None,
                          "events": summary.events, "batches": summary.batches}))
    finally:
        stop_spark_session()


def test_a_remote_client_decodes_on_the_server_and_the_target_converges(
        request: pytest.FixtureRequest, app: Application, spark_connect: RunningServer, clickhouse_url: str) -> None:
    assert python_workers(spark_connect.pid) == []  # nothing has run Python on the server yet
    app.sql("create table {schema}.notes (id bigint primary key, body text, score integer)")
    app.sql("alter table {schema}.notes alter column body set storage external")
    app.producer(["notes"])
    app.sql("insert into {schema}.notes select g, 'note ' || g, g from generate_series(1, 40) g")
    app.sql("update {schema}.notes set body = repeat(md5(id::text), 100) where id <= 5")  # stored out of line
    app.sql("update {schema}.notes set score = score * 10 where id % 4 = 0")  # leaves those values unchanged
    app.sql("update {schema}.notes set id = id + 100 where id in (2, 3)")
    app.sql("delete from {schema}.notes where id between 30 and 34")
    events = 40 + 5 + 10 + 2 + 5
    app.wait_for_events(events, "notes")

    child = subprocess.run(
        [sys.executable, "-c", "import sys; from tests.integration.test_spark_connect import run_remote_consumer; "
                               "run_remote_consumer(*sys.argv[1:])",
         app.nats_url, clickhouse_url, app.dsn, app.identifier, app.qualified("notes")],
        cwd=REPOSITORY, env={**os.environ, REMOTE_ENVIRONMENT_VARIABLE: spark_connect.url},
        capture_output=True, text=True, timeout=180)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["spark"].startswith("pyspark.sql.connect.") and not report["local_driver"]
    assert report["events"] == events and report["batches"] >= 1
    # An unreachable server fails a run within minutes, not after the client's default ten.
    assert report["longest_retry_wait_ms"] <= 180_000
    # The decode (mapInArrow) ran in Python workers that the server started.
    assert python_workers(spark_connect.pid), descendants(spark_connect.pid)

    table = app.table_schema("notes")
    target = make_target(request, "clickhouse", app.identifier)
    try:
        assert target.current_rows_as_text(table) == app.rows_as_text(table)
        assert target.count_current(table) == 35
    finally:
        target.close()
