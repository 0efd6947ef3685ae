"""The producer under faults, with a concurrent writer: kill -9 at random points, a restart of the
NATS server and of PostgreSQL mid-stream. Afterwards every committed change is in the stream at
least once, per table in commit order, and repeats only ever repeat a version with the same event.

The writer commits small transactions (two inserts and one counter increment each); the table's
final content is the truth: its row count is the number of inserts, the sum of its counters the
number of updates, and folding the stream by version must give back every row.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from siphon_core.wire import siphon_pb2 as pb
from tests.helpers import stream
from tests.helpers.application import Application
from tests.helpers.producer import ProducerProcess, current_lsn, execute, slot_confirmed_lsn, wait_until


class Writer:
    """Commits small transactions on a thread until stopped, riding out a restarting server."""

    def __init__(self, dsn: str, table: sql.Composable, pause: float = 0.004) -> None:
        self._dsn = dsn
        self._table = table
        self._pause = pause
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="writer")
        self.commits = 0
        self.reconnects = 0
        self.failure: BaseException | None = None

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        if self.failure is not None:
            raise AssertionError(f"the writer failed: {self.failure!r}") from self.failure

    def _connect(self) -> psycopg.Connection:
        deadline = time.monotonic() + 60
        while True:
            try:
                return psycopg.connect(self._dsn, connect_timeout=2)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _run(self) -> None:
        insert = sql.SQL("insert into {} (seq, n) values (%s, 0), (%s, 0)").format(self._table)
        update = sql.SQL("update {} set n = n + 1 where id = (select max(id) - %s from {})").format(
            self._table, self._table)
        rng = random.Random(7)
        sequence = 0
        try:
            connection = self._connect()
            while not self._stop.is_set():
                try:
                    sequence += 2
                    connection.execute(insert, (sequence - 1, sequence))
                    connection.execute(update, (rng.randrange(20),))
                    connection.commit()
                    self.commits += 1
                except psycopg.OperationalError:
                    # The server went away; whether that commit happened, the table will say.
                    self.reconnects += 1
                    connection.close()
                    connection = self._connect()
                time.sleep(self._pause)
            connection.close()
        except BaseException as error:  # surfaced by stop()
            self.failure = error


@pytest.fixture
def app(postgres_dsn: str, nats_url: str, unique_name: str, tmp_path: Path) -> Iterator[Application]:
    application = Application(postgres_dsn, nats_url, unique_name, unique_name, tmp_path)
    execute(postgres_dsn, sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
    application.sql("create table {schema}.ledger (id bigserial primary key, seq bigint not null, n integer not null)")
    try:
        yield application
    finally:
        for process in application.producers:
            print(f"--- log of {process.config_path.name}\n{process.log()}")
        application.close()


def start_producer(app: Application, **settings: object) -> ProducerProcess:
    return app.producer(["ledger"], on_lock_held="wait", connect_retries=12, flush_interval_seconds=0.5,
                        **settings)


def assert_stream_holds_every_committed_change(app: Application, producer: ProducerProcess) -> int:
    """Waits until the producer confirmed the end of the WAL, then checks the stream against the table."""
    end = current_lsn(app.dsn)
    wait_until(lambda: slot_confirmed_lsn(app.dsn, app.slot) >= end, 60, "the producer caught up")
    assert producer.stop() == 0

    rows = dict(app.sql("select id, n from {schema}.ledger"))
    events = app.events("ledger")
    stream.assert_commit_order(events)
    unique = stream.unique_events(events)
    inserts = [e for e in unique if e.operation == pb.INSERT]
    updates = [e for e in unique if e.operation == pb.UPDATE]
    assert len(inserts) == len(rows), "every committed insert, once per version"
    assert len(updates) == sum(rows.values()), "every committed update, once per version"
    assert len(unique) == len(inserts) + len(updates)
    folded: dict[int, int] = {}
    for event in sorted(unique, key=lambda e: e.version):
        folded[int(event.new_row()["id"])] = int(event.new_row()["n"])
    assert folded == rows
    return len(events) - len(unique)  # repeats


def test_kill_9_at_random_points_loses_nothing(app: Application) -> None:
    rng = random.Random()
    producer = start_producer(app)
    kills = 0
    with Writer(app.dsn, app.table("ledger")) as writer:
        deadline = time.monotonic() + 40
        while kills < 8 and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.5, 4.0))
            producer.kill()
            kills += 1
            producer.start(timeout=60)
        time.sleep(1)
    assert kills >= 5 and writer.commits > 500

    repeats = assert_stream_holds_every_committed_change(app, producer)
    print(f"{kills} kills, {writer.commits} commits, {repeats} repeated events")


def test_a_nats_server_restart_mid_stream_loses_nothing(app: Application, nats_server) -> None:
    producer = start_producer(app)
    with Writer(app.dsn, app.table("ledger")) as writer:
        time.sleep(2)
        nats_server.stop(nats_server.pid)
        time.sleep(6)  # longer than a publish waits for its ack: publishes fail and are sent again
        nats_server.pid = nats_server.start()  # the same store and port
        time.sleep(3)
    assert writer.commits > 300
    assert producer.process is not None and producer.process.poll() is None, "the producer rode out the restart"

    assert_stream_holds_every_committed_change(app, producer)
    assert "publish failed; sending again from the first unacknowledged package" in producer.log()


def test_a_postgres_restart_mid_stream_loses_nothing(app: Application, postgres_server) -> None:
    producer = start_producer(app)
    with Writer(app.dsn, app.table("ledger")) as writer:
        time.sleep(2)
        postgres_server.stop(postgres_server.pid)
        time.sleep(1)
        postgres_server.pid = postgres_server.start()
        producer.wait_streaming(60)  # reconnected with backoff
        time.sleep(2)
    assert writer.commits > 300 and writer.reconnects >= 1
    assert producer.process is not None and producer.process.poll() is None, "the producer rode out the restart"

    assert_stream_holds_every_committed_change(app, producer)
    assert "connection lost; reconnecting" in producer.log()
