"""The producer under faults, with a concurrent writer: kill -9 at random points, a restart of the
NATS server and of PostgreSQL mid-stream, a crash of PostgreSQL (kill -9 of the postmaster), a NATS
outage longer than the publish retry budget, and a restart of an idle source. Afterwards every
committed change is in the stream at least once, per table in commit order, and repeats only ever
repeat a version with the same event.

The writer commits small transactions (two inserts and one counter increment each); the table's
final content is the truth: its row count is the number of inserts, the sum of its counters the
number of updates, and folding the stream by version must give back every row. After a crash,
a commit the writer did not see acknowledged may or may not have happened; the table says which.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from siphon_core.wire import siphon_pb2 as pb
from siphon_stack.postgres import PostgresServer
from siphon_stack.process import pid_alive
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
        self.acknowledged: list[int] = []  # `seq` of every row whose commit returned
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
                    self.acknowledged += (sequence - 1, sequence)
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
    return app.producer(["ledger"], **{"on_lock_held": "wait", "connect_retries": 12, "flush_interval_seconds": 0.5,
                                       **settings})


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


def test_a_postgres_restart_mid_stream_loses_nothing(app: Application, postgres_restarted) -> None:
    postgres_server = postgres_restarted
    producer = start_producer(app)
    with Writer(app.dsn, app.table("ledger")) as writer:
        time.sleep(2)
        postgres_server.stop(postgres_server.pid)
        time.sleep(1)
        start_again(postgres_server)
        producer.wait_streaming(60)  # reconnected with backoff
        time.sleep(2)
    assert writer.commits > 300 and writer.reconnects >= 1
    assert producer.process is not None and producer.process.poll() is None, "the producer rode out the restart"

    assert_stream_holds_every_committed_change(app, producer)
    assert "connection lost; reconnecting" in producer.log()


def crash_and_restart_postgres(server: PostgresServer) -> None:
    """kill -9 of the postmaster, then a start on the same data directory, which runs crash recovery.
    The postmaster's children notice its death and exit; the start waits for them, since PostgreSQL
    refuses to start while one still holds the old shared memory."""
    recoveries = _recoveries(server)
    os.kill(server.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    wait_until(lambda: not pid_alive(server.pid) and not _live_members(server.pid), 60,  # type: ignore[attr-defined]
               "the crashed server's processes exited")
    start_again(server)
    assert _recoveries(server) > recoveries, "the start ran crash recovery"


def start_again(server: PostgresServer, attempts: int = 3) -> None:
    """Starts the shared server on its data directory and port, trying again when a start fails
    (a loaded machine can take longer than a start waits): every later test needs it running."""
    for attempt in range(1, attempts + 1):
        try:
            server.pid = server.start(timeout=120)  # type: ignore[attr-defined]
            return
        except Exception:
            started = _postmaster_pid(server)
            if started is not None and pid_alive(started):
                # Still recovering when the start stopped waiting: it is our server, let it finish.
                wait_until(server.is_ready, 300, "PostgreSQL ready after a slow start")
                server.pid = started  # type: ignore[attr-defined]
                return
            if attempt == attempts:
                raise
            time.sleep(2)


def _postmaster_pid(server: PostgresServer) -> int | None:
    try:
        return int((server.data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture
def postgres_restarted(postgres_server: PostgresServer) -> Iterator[PostgresServer]:
    """The shared server, for a test that stops or kills it: running again afterwards, whatever
    the test's outcome."""
    try:
        yield postgres_server
    finally:
        if not pid_alive(postgres_server.pid) or not postgres_server.is_ready():  # type: ignore[attr-defined]
            start_again(postgres_server)


def _recoveries(server: PostgresServer) -> int:
    return server.log_path.read_text(errors="replace").count("automatic recovery in progress")


def _live_members(group: int) -> list[int]:
    """Processes of a process group that are not zombies."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def lost_connections(producer: ProducerProcess) -> int:
    return producer.log().count("connection lost; reconnecting")


def wait_for_reconnect(producer: ProducerProcess, lost_before: int) -> None:
    """Waits for the producer to notice the lost connection and stream again."""
    wait_until(lambda: lost_connections(producer) > lost_before, 60, "the producer noticed the lost connection")
    producer.wait_streaming(90)


def assert_acknowledged_commits_streamed(app: Application, writer: Writer) -> None:
    """A commit the writer saw acknowledged survived the crash and reached the stream."""
    in_table = {seq for (seq,) in app.sql("select seq from {schema}.ledger")}
    missing = set(writer.acknowledged) - in_table
    assert not missing, f"acknowledged commits missing from the table after recovery: {sorted(missing)[:10]}"
    streamed = {int(e.new_row()["seq"]) for e in app.events("ledger") if e.operation == pb.INSERT}
    assert set(writer.acknowledged) <= streamed


def test_a_postgres_crash_mid_stream_loses_no_committed_change(app: Application, postgres_restarted) -> None:
    postgres_server = postgres_restarted
    producer = start_producer(app)
    rng = random.Random()
    with Writer(app.dsn, app.table("ledger")) as writer:
        for _ in range(2):
            target = writer.commits + rng.randrange(100, 400)
            wait_until(lambda target=target: writer.commits >= target, 60, "the writer committed")
            lost = lost_connections(producer)
            crash_and_restart_postgres(postgres_server)
            wait_for_reconnect(producer, lost)
        committed = writer.commits
        wait_until(lambda: writer.commits >= committed + 100, 60, "writes resumed")
    assert writer.reconnects >= 2
    assert producer.process is not None and producer.process.poll() is None, "the producer rode out the crashes"

    repeats = assert_stream_holds_every_committed_change(app, producer)
    assert_acknowledged_commits_streamed(app, writer)
    print(f"{writer.commits} acknowledged commits, {writer.reconnects} writer reconnects, {repeats} repeated events")


def test_a_nats_outage_longer_than_the_retry_budget_stops_the_producer_and_loses_nothing(
        app: Application, nats_server) -> None:
    budget = 6.0
    producer = start_producer(app, publish_retry_seconds=budget, connect_retries=1, heartbeat_interval_seconds=60)
    app.sql("insert into {schema}.ledger (seq, n) values (0, 0)")
    end = current_lsn(app.dsn)
    wait_until(lambda: slot_confirmed_lsn(app.dsn, app.slot) >= end, 30, "the producer caught up")
    # Idle for longer than the budget: it counts from the first failed publish, not from the last ack.
    time.sleep(budget + 1)

    nats_server.stop(nats_server.pid)
    try:
        # Committed while JetStream is away: this change can never be acknowledged by this producer.
        app.sql("insert into {schema}.ledger (seq, n) values (-1, 0)")
        with Writer(app.dsn, app.table("ledger")) as writer:
            assert producer.wait(timeout=60) == 1, "the producer gives up once the budget is spent"
            confirmed = slot_confirmed_lsn(app.dsn, app.slot)
            nats_server.pid = nats_server.start()  # the same store and port
            producer.start(timeout=60)  # as a supervisor would
            committed = writer.commits
            wait_until(lambda: writer.commits >= committed + 100, 60, "writes went on")
    finally:
        if not pid_alive(nats_server.pid):  # the other tests need it
            nats_server.pid = nats_server.start()

    assert_stream_holds_every_committed_change(app, producer)
    marker = next(e for e in app.events("ledger") if e.operation == pb.INSERT and int(e.new_row()["seq"]) == -1)
    assert confirmed <= marker.commit_lsn, "the slot never moved past a change JetStream did not acknowledge"
    log = producer.log()
    assert "publish failed; sending again from the first unacknowledged package" in log, "it retried first"
    assert f"failed for {budget:.0f}s" in log
    assert "giving up after repeated connection failures" in log and "producer.publish_retry_seconds" in log


@pytest.mark.parametrize("how", ["restart", "crash"])
def test_a_postgres_restart_of_an_idle_source_loses_nothing(app: Application, postgres_restarted, how: str) -> None:
    postgres_server = postgres_restarted
    producer = start_producer(app, heartbeat_interval_seconds=0.5)
    app.sql("insert into {schema}.ledger (seq, n) values (0, 0)")
    wait_until(lambda: producer.metrics().get("siphon_producer_heartbeats_total", 0) >= 2, 30,
               "heartbeats on the idle source")
    end = current_lsn(app.dsn)
    wait_until(lambda: slot_confirmed_lsn(app.dsn, app.slot) >= end, 30, "the slot followed the heartbeats")

    lost = lost_connections(producer)
    if how == "crash":
        crash_and_restart_postgres(postgres_server)
    else:
        postgres_server.stop(postgres_server.pid)
        start_again(postgres_server)
    wait_for_reconnect(producer, lost)
    wait_until(lambda: producer.metrics().get("siphon_producer_heartbeats_total", 0) >= 1, 30,
               "heartbeats after the restart")

    with Writer(app.dsn, app.table("ledger")) as writer:
        wait_until(lambda: writer.commits >= 200, 60, "the writer committed")
    assert producer.process is not None and producer.process.poll() is None, "the producer rode out the restart"
    assert_stream_holds_every_committed_change(app, producer)
