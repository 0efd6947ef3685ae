"""The boundary of exact snapshots: a commit at the consistent point of a partition snapshot's slot.

A partition snapshot's rows get version (consistent point, 0); a streamed change gets (commit LSN of
its transaction, position), positions counting from 1. Snapshots and the stream converge only if the
snapshot a temporary slot exports holds exactly the transactions whose commit record starts before
the slot's consistent point, and the deciding case is a commit record starting exactly at it: that
transaction must be missing from the snapshot and reach the stream with version (point, 1) or more.

Such a commit exists, and can be produced on purpose (PostgreSQL's snapbuild.c). The consistent
point is the end of the xl_running_xacts record at which the slot's snapshot builder becomes
consistent. The builder gets there either at a record that lists no running transaction, or through
BUILDING_SNAPSHOT and FULL_SNAPSHOT at a record whose oldest running transaction started after the
FULL_SNAPSHOT point; the transactions that record lists are outside the exported snapshot (past its
xmax), and decoding replays every commit from there on. If no other WAL is written in between, the
first of them to commit writes its commit record exactly at the consistent point. A writer running
freely hits that only by chance, so the first test walks the builder through its phases with three
transactions (each phase waits for the transactions its record lists on their locks, which pg_locks
shows):

    X updates key 1, left open; the slot is requested   record 1 lists X: BUILDING, waits for X
    Y updates key 2; X commits                          record 2 lists Y: FULL, waits for Y
    Z updates key 1; Y commits                          record 3 lists Z: CONSISTENT, the slot exists
    Z commits                                           its commit record starts at the consistent point

Y is then the last commit inside the snapshot and Z the first outside it. Z changes the key whose
snapshot row carries X's value at version (point, 0): were positions to start at 0, Z's change and
that row would tie, and a target would keep whichever it applied last. The second test runs a writer
as fast as it can on one key while snapshots are taken, and checks the split for every commit.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from siphon_core import naming
from siphon_core.config import ClickHouseTargetConfig, TableConfig
from siphon_core.replication import SlotInfo
from siphon_core.wire import siphon_pb2 as pb
from siphon_dagster import source
from siphon_dagster.partitions import BlockRange
from siphon_dagster.snapshot.reader import SnapshotProgress, exported_snapshot, read_range
from siphon_dagster.targets.base import TableSchema, change_batch_schema
from siphon_dagster.targets.clickhouse import ClickHouseTarget
from tests.helpers.application import Application
from tests.helpers.producer import execute, wait_until
from tests.helpers.stream import StreamEvent, unique_events

EVERY_BLOCK = BlockRange(0, 1 << 20)  # far past the table's end: every row, wherever updates moved it
# Other WAL (autovacuum, the background writer's own running_xacts every 15 s) can land between the
# consistent point and the commit meant for it; the split must hold then too, and the walk is retried.
ATTEMPTS = 3
SNAPSHOTS_UNDER_LOAD = 25


@pytest.fixture
def app(app: Application) -> Application:
    """The shared application fixture, with the table the tests write."""
    app.sql("create table {schema}.t (id bigint primary key, v bigint not null, writer text)")
    app.sql("insert into {schema}.t values (1, 0, 'initial'), (2, 0, 'initial')")
    return app


def start_producer(app: Application) -> None:
    # Its heartbeat is WAL (pg_logical_emit_message): none may fall between a point and its commit.
    app.producer(["t"], heartbeat_interval_seconds=3600)


@dataclass
class Snapshot:
    slot: SlotInfo
    copy_text: list[bytes]  # what the partition asset sends to a target
    transactions: str  # the exported snapshot as a pg_snapshot (xmin:xmax:xip), to ask what it sees

    @property
    def version(self) -> tuple[int, int]:
        return self.slot.consistent_point, 0

    def sees(self, dsn: str, xids: list[int]) -> set[int]:
        # pgoutput's xids are 32-bit; a fresh cluster is in epoch 0, where they equal the xid8 values.
        query = "select x from unnest(%s::text[]::xid8[]) x where pg_visible_in_snapshot(x, %s::pg_snapshot)"
        return {int(row[0]) for row in execute(dsn, query, ([str(xid) for xid in xids], self.transactions))}


def read_snapshot(app: Application, slot: SlotInfo) -> Snapshot:
    """The table as the partition asset reads it under the slot's exported snapshot."""
    with source.connect(app.dsn) as connection:
        table = source.table_schema(connection, TableConfig(name=app.qualified("t")))
    chunks = list(read_range(app.dsn, slot.snapshot_name or "", table, EVERY_BLOCK, SnapshotProgress()))
    with psycopg.connect(app.dsn) as connection:
        connection.execute("set transaction isolation level repeatable read, read only")
        connection.execute(sql.SQL("set transaction snapshot {}").format(sql.Literal(slot.snapshot_name)))
        transactions = connection.execute("select pg_current_snapshot()::text").fetchone()[0]
    return Snapshot(slot, chunks, transactions)


class SlotRequest:
    """A partition snapshot's temporary slot, requested on a thread (creating it waits for the
    transactions running then) and held until the block exits."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.created: Future[SlotInfo] = Future()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="snapshot-slot", daemon=True)

    def _hold(self) -> None:
        try:
            with exported_snapshot(self.dsn) as slot:
                self.created.set_result(slot)
                self._release.wait()
        except BaseException as error:
            if not self.created.done():
                self.created.set_exception(error)

    def start(self) -> None:
        self._thread.start()

    def __enter__(self) -> SlotRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        if self._thread.is_alive():
            self._thread.join(30)


def wait_for_builder_waiting_on(monitor: psycopg.Connection, xid: int) -> None:
    """Until a walsender (a slot being created) waits for transaction `xid` to end."""
    query = ("select 1 from pg_locks l join pg_stat_activity a on a.pid = l.pid where a.backend_type = 'walsender' "
             "and l.locktype = 'transactionid' and l.transactionid::text = %s and not l.granted")
    wait_until(lambda: monitor.execute(query, (str(xid),)).fetchone() is not None, 10,
               f"the slot's snapshot builder waiting for transaction {xid}", interval=0.005)


def update(connection: psycopg.Connection, app: Application, key: int, writer: str) -> int:
    """Updates one row in the connection's open transaction; returns the transaction's id."""
    statement = sql.SQL("update {} set v = v + 1, writer = %s where id = %s returning pg_current_xact_id()::text")
    return int(connection.execute(statement.format(app.table("t")), (writer, key)).fetchone()[0])


def source_rows(app: Application) -> list[tuple[str | None, ...]]:
    return app.sql("select id::text, v::text, writer from {schema}.t order by id")


def assert_split_at(dsn: str, snapshot: Snapshot, transactions: dict[int, list[StreamEvent]]) -> None:
    """Each transaction is in the snapshot with every streamed version below the snapshot's, or
    outside it with every streamed version above: never both ways, never neither."""
    visible = snapshot.sees(dsn, list(transactions))
    for xid, events in transactions.items():
        assert events, f"transaction {xid} never reached the stream"
        versions = [event.version for event in events]
        assert min(position for _, position in versions) >= 1, f"transaction {xid}: positions start at 1: {versions}"
        if xid in visible:
            assert max(versions) < snapshot.version, (
                f"transaction {xid} is in the snapshot at {snapshot.version}, but streamed at {versions}: "
                "a target would take the stream's version over the snapshot's")
        else:
            assert min(versions) > snapshot.version, (
                f"transaction {xid} is missing from the snapshot at {snapshot.version} and streamed at "
                f"{versions}: a target would keep the snapshot's older row")


def change_batch(table: TableSchema, events: list[StreamEvent]) -> pa.Table:
    """Stream events as the streaming apply hands them to a target (UPDATEs only here)."""
    schema = change_batch_schema(table)
    rows = []
    for event in events:
        assert event.operation == pb.UPDATE and event.new is not None
        values = [value.decode() if isinstance(value, bytes) else value for value in event.new]
        rows.append([*values, naming.row_version(event.commit_lsn, event.position), False])
    columns = list(zip(*rows, strict=True))
    return pa.table([pa.array(list(values), type=field.type) for values, field in zip(columns, schema, strict=True)],
                    schema=schema)


def assert_converges_in_any_order(app: Application, clickhouse_url: str, database: str, snapshot: Snapshot,
                                  events: list[StreamEvent], expected: list[tuple[str | None, ...]]) -> None:
    """The snapshot and the stream, applied in several orders (each into a database of its own),
    leave the source's rows."""
    with source.connect(app.dsn) as connection:
        table = source.table_schema(connection, TableConfig(name=app.qualified("t")))
    snapshot_step = ("snapshot", snapshot.copy_text)
    stream_steps = [("stream", [event]) for event in events]
    orders = {
        "snapshot, then the stream": [snapshot_step, *stream_steps],
        "the stream, then the snapshot": [*stream_steps, snapshot_step],
        "the stream backwards, the snapshot in the middle": [*stream_steps[::-1][:1], snapshot_step,
                                                             *stream_steps[::-1][1:]],
    }
    for i, (name, steps) in enumerate(orders.items()):
        target = ClickHouseTarget(ClickHouseTargetConfig(url=clickhouse_url, database=f"{database}_{i}"))
        try:
            target.ensure_table(table)
            for kind, step in steps:
                if kind == "snapshot":
                    target.apply_copy_text(table, step, naming.row_version(*snapshot.version))
                else:
                    target.apply_rows(table, change_batch(table, step))
            assert target.current_rows_as_text(table) == expected, f"{name}: the target did not converge"
        finally:
            target.drop_table(table)
            target.close()


def test_commit_exactly_at_the_consistent_point(app: Application, clickhouse_url: str, unique_name: str) -> None:
    start_producer(app)
    walks: list[tuple[Snapshot, tuple[int, int, int], list[tuple[str | None, ...]]]] = []
    with psycopg.connect(app.dsn, autocommit=True) as monitor:
        for _ in range(ATTEMPTS):
            # The writers close first on the way out, so that a slot still being created stops waiting.
            with SlotRequest(app.dsn) as request, ExitStack() as writers:
                x, y, z = (writers.enter_context(psycopg.connect(app.dsn)) for _ in range(3))
                x_id = update(x, app, 1, "x")
                request.start()  # after X's update: the slot's first record lists X
                wait_for_builder_waiting_on(monitor, x_id)
                y_id = update(y, app, 2, "y")
                x.commit()
                wait_for_builder_waiting_on(monitor, y_id)
                z_id = update(z, app, 1, "z")
                y.commit()
                slot = request.created.result(timeout=10)
                z.commit()
                snapshot = read_snapshot(app, slot)
            walks.append((snapshot, (x_id, y_id, z_id), source_rows(app)))
            streamed = {event.xid: event for event in app.wait_for_events(3 * len(walks), "t")}
            if streamed[z_id].commit_lsn == slot.consistent_point:
                break

    events = unique_events(app.wait_for_events(3 * len(walks), "t"))
    by_xid: dict[int, list[StreamEvent]] = {}
    for event in events:
        by_xid.setdefault(event.xid, []).append(event)
    for snapshot, (x_id, y_id, z_id), _ in walks:
        seen = snapshot.sees(app.dsn, [x_id, y_id, z_id])
        assert seen == {x_id, y_id}, f"the snapshot at {snapshot.version} sees {seen} of X, Y, Z = {x_id, y_id, z_id}"
        assert_split_at(app.dsn, snapshot, by_xid)

    snapshot, (x_id, y_id, z_id), expected = walks[-1]
    point = snapshot.slot.consistent_point
    [z_change] = by_xid[z_id]
    assert z_change.commit_lsn == point, (
        f"in {len(walks)} walks no commit landed exactly at the consistent point; in the last, Z committed at "
        f"{naming.format_lsn(z_change.commit_lsn)} and the point is {naming.format_lsn(point)}")
    assert z_change.version == (point, 1)
    # The closest boundary on the other side: Y, the last commit inside the snapshot, just before.
    assert max(event.commit_lsn for event in by_xid[y_id]) < point

    upto = [event for event in events if event.commit_lsn <= point]
    assert_converges_in_any_order(app, clickhouse_url, unique_name, snapshot, upto, expected)


def test_snapshots_under_a_busy_writer_split_its_commits_at_the_consistent_point(app: Application) -> None:
    """One key updated as fast as the source allows while snapshots are taken one after another:
    for every snapshot, the commits before its consistent point are in it (the key's counter shows
    which) and every later one streams with a greater version, however close to the point."""
    start_producer(app)
    stop = threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        try:
            with psycopg.connect(app.dsn, autocommit=True) as connection:
                statement = sql.SQL("update {} set v = v + 1, writer = 'busy' where id = 1").format(app.table("t"))
                while not stop.is_set():
                    connection.execute(statement)
        except BaseException as error:  # surfaced below
            failures.append(error)

    with source.connect(app.dsn) as connection:
        table = source.table_schema(connection, TableConfig(name=app.qualified("t")))
    seen: list[tuple[int, int]] = []  # (consistent point, the counter the snapshot holds)
    writer = threading.Thread(target=write, name="busy-writer", daemon=True)
    writer.start()
    try:
        for _ in range(SNAPSHOTS_UNDER_LOAD):
            with exported_snapshot(app.dsn) as slot:
                text = b"".join(read_range(app.dsn, slot.snapshot_name or "", table, EVERY_BLOCK, SnapshotProgress()))
            counter = next(int(line.split(b"\t")[1]) for line in text.splitlines() if line.startswith(b"1\t"))
            seen.append((slot.consistent_point, counter))
    finally:
        stop.set()
        writer.join(30)
    assert not failures, failures
    written = int(app.sql("select v from {schema}.t where id = 1")[0][0])
    assert seen[-1][1] > seen[0][1], "the writer made no progress while the snapshots were taken"

    commits: dict[int, tuple[int, int]] = {}  # counter -> version of the update that wrote it
    for event in unique_events(app.wait_for_events(written, "t", timeout=60)):
        commits[int(event.new_row()["v"])] = event.version  # type: ignore[arg-type]
    assert sorted(commits) == list(range(1, written + 1))
    assert min(position for _, position in commits.values()) >= 1
    for point, counter in seen:
        inside = [commits[value] for value in range(1, counter + 1)]
        outside = [commits[value] for value in range(counter + 1, written + 1)]
        assert not inside or max(inside) < (point, 0), f"a commit in the snapshot at {point} streams after it"
        assert not outside or min(outside) > (point, 0), f"a commit missing from the snapshot at {point} streams before it"
