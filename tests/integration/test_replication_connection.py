"""ReplicationConnection against a real PostgreSQL: slots, snapshots, streaming, feedback, errors."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from producer_service.pgoutput import Begin, Commit, Insert, MessageDecoder, PgoutputMessage, Relation, Update
from siphon_core.naming import parse_lsn
from siphon_core.replication import Keepalive, ReplicationConnection, ReplicationError, XLogData
from siphon_core.wire.tuple_data import decode_tuple
from tests.fixtures import capture_pgoutput


@dataclass
class Source:
    dsn: str
    schema: str
    publication: str
    slot: str

    def execute(self, query: sql.Composable | str, params: tuple = ()) -> list[tuple]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []

    def table(self, name: str = "items") -> sql.Composable:
        return sql.Identifier(self.schema, name)


@pytest.fixture
def source(postgres_dsn: str, unique_name: str) -> Iterator[Source]:
    """A schema with table `items` (id, name) and a publication for it, all named `unique_name`."""
    src = Source(postgres_dsn, unique_name, unique_name, unique_name)
    src.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(src.schema)))
    src.execute(sql.SQL("CREATE TABLE {} (id integer PRIMARY KEY, name text)").format(src.table()))
    src.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(src.publication), src.table()))
    yield src
    src.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(src.publication)))
    src.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(src.schema)))


def read_transaction(replication: ReplicationConnection, timeout: float = 30.0) -> list[tuple[XLogData, PgoutputMessage]]:
    """Messages up to and including the next Commit, keepalives skipped."""
    decoder = MessageDecoder()
    received: list[tuple[XLogData, PgoutputMessage]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        item = replication.read(1.0)  # one at a time: what follows the Commit stays for the next call
        if isinstance(item, XLogData):
            message = decoder.decode(item.payload)
            received.append((item, message))
            if isinstance(message, Commit):
                return received
    raise AssertionError(f"no Commit within {timeout:.0f}s; received {received}")


def insert(source: Source, *rows: tuple[int, str]) -> None:
    for row in rows:
        source.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(source.table()), row)


def test_identify_system_reports_the_cluster_timeline_position_and_database(postgres_dsn):
    with psycopg.connect(postgres_dsn) as conn:
        system_id = conn.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]
        before = parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])

    with ReplicationConnection(postgres_dsn) as replication:
        identity = replication.identify_system()

    assert identity.systemid == system_id
    assert identity.timeline >= 1
    assert identity.xlogpos >= before
    assert identity.dbname == "siphon"


def test_exported_snapshot_is_importable_while_the_connection_stays_open(source):
    insert(source, (1, "before the slot"))
    with ReplicationConnection(source.dsn) as replication:
        slot = replication.create_slot(source.slot, temporary=True, export_snapshot=True)
        insert(source, (2, "after the slot"))

        with psycopg.connect(source.dsn) as reader:
            reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            reader.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(slot.snapshot_name)))
            seen = reader.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(source.table())).fetchall()

        assert slot.name == source.slot
        assert slot.snapshot_name
        assert seen == [(1,)]  # exactly what committed before the consistent point
        temporary = source.execute("SELECT temporary, plugin FROM pg_replication_slots WHERE slot_name = %s",
                                   (source.slot,))
        assert temporary == [(True, "pgoutput")]

        replication.drop_slot(source.slot)
        assert not replication.slot_exists(source.slot)


def test_changes_after_the_consistent_point_are_streamed(source):
    with ReplicationConnection(source.dsn) as replication:
        slot = replication.create_slot(source.slot, temporary=True)
        insert(source, (2, "after the slot"))
        replication.start(source.slot, [source.publication], 0)

        received = read_transaction(replication)

    messages = [message for _, message in received]
    assert [type(message) for message in messages] == [Begin, Relation, Insert, Commit]
    begin, relation, change, commit = messages
    assert begin.final_lsn == commit.commit_lsn > slot.consistent_point
    assert (relation.namespace, relation.name) == (source.schema, "items")
    assert change.relation_id == relation.relation_id
    assert decode_tuple(change.new_tuple)[0] == [b"2", b"after the slot"]
    assert received[-1][0].data_start == commit.end_lsn


def test_slot_create_exists_and_drop(source):
    with ReplicationConnection(source.dsn) as replication:
        slot = replication.create_slot(source.slot)
        try:
            assert slot.snapshot_name is None
            assert slot.consistent_point > 0
            assert replication.slot_exists(source.slot)
        finally:
            replication.drop_slot(source.slot)
        assert not replication.slot_exists(source.slot)


@pytest.mark.parametrize("proto_version", [1, 2])
def test_both_protocol_versions_decode(source, proto_version):
    with ReplicationConnection(source.dsn) as replication:
        replication.create_slot(source.slot, temporary=True)
        replication.start(source.slot, [source.publication], 0, proto_version=proto_version)
        insert(source, (1, "one"))
        source.execute(sql.SQL("UPDATE {} SET id = 10 WHERE id = 1").format(source.table()))
        first = [message for _, message in read_transaction(replication)]
        second = [message for _, message in read_transaction(replication)]

    assert [type(message) for message in first] == [Begin, Relation, Insert, Commit]
    assert [type(message) for message in second] == [Begin, Update, Commit]
    update = second[1]
    assert update.old_kind == "K"
    assert decode_tuple(update.old_tuple)[0] == [b"1", None]
    assert decode_tuple(update.new_tuple)[0] == [b"10", b"one"]


def test_publication_names_with_any_characters_are_quoted(source):
    publication = 'Odd, "quoted" \\ \'name\''
    source.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(publication), source.table()))
    try:
        with ReplicationConnection(source.dsn) as replication:
            replication.create_slot(source.slot, temporary=True)
            replication.start(source.slot, [publication, source.publication], 0)
            insert(source, (1, "one"))
            messages = [message for _, message in read_transaction(replication)]
    finally:
        source.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(publication)))

    assert isinstance(messages[2], Insert)


def test_status_update_moves_the_slot_and_a_requested_reply_arrives(source):
    with ReplicationConnection(source.dsn) as replication:
        replication.create_slot(source.slot, temporary=True)
        replication.start(source.slot, [source.publication], 0)
        insert(source, (1, "one"))
        commit = read_transaction(replication)[-1][1]
        assert isinstance(commit, Commit)

        replication.send_status(commit.end_lsn, commit.end_lsn, commit.end_lsn, reply_requested=True)

        deadline = time.monotonic() + 10
        reply = None
        while reply is None and time.monotonic() < deadline:
            reply = next((item for item in replication.read_batch(1.0) if isinstance(item, Keepalive)), None)
        assert reply is not None and reply.wal_end >= commit.end_lsn
        # A keepalive may leave before the walsender processed the update: poll the slot briefly.
        confirmed = 0
        while confirmed != commit.end_lsn and time.monotonic() < deadline:
            rows = source.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                                  (source.slot,))
            confirmed = parse_lsn(rows[0][0])
            replication.read_batch(0.1)
        assert confirmed == commit.end_lsn


def test_ending_the_stream_returns_once_the_server_took_the_last_status_update(source):
    with ReplicationConnection(source.dsn) as replication:
        replication.create_slot(source.slot, temporary=True)
        replication.start(source.slot, [source.publication], 0)
        with psycopg.connect(source.dsn, autocommit=True) as writer:  # 300 commits the reader is behind on
            for i in range(300):
                writer.execute(sql.SQL("INSERT INTO {} VALUES (%s, 'x')").format(source.table()), (i,))
        commit = read_transaction(replication)[-1][1]
        assert isinstance(commit, Commit)
        replication.send_status(commit.end_lsn, commit.end_lsn, commit.end_lsn)

        assert replication.end_stream(timeout=10.0)

        # No polling: the server had taken the update when it ended the stream.
        rows = source.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                              (source.slot,))
        assert parse_lsn(rows[0][0]) == commit.end_lsn
        assert replication.slot_exists(source.slot)  # the connection takes commands again
        with pytest.raises(ReplicationError, match="not streaming"):
            replication.read(0.1)


def test_answering_keepalives_keeps_the_stream_alive_past_the_sender_timeout(source):
    # The server asks for a reply after half of wal_sender_timeout without one, and hangs up after all of it.
    dsn = make_conninfo(source.dsn, options="-c wal_sender_timeout=1s")
    with ReplicationConnection(dsn) as replication:
        replication.create_slot(source.slot, temporary=True)
        replication.start(source.slot, [source.publication], 0)
        requests = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for item in replication.read_batch(0.2):
                if isinstance(item, Keepalive) and item.reply_requested:
                    requests += 1
                    replication.send_status(item.wal_end, item.wal_end, item.wal_end)
        insert(source, (1, "still streaming"))

        assert isinstance(read_transaction(replication)[-1][1], Commit)
        assert requests >= 2


def test_silence_past_the_sender_timeout_ends_the_stream_with_an_error(source):
    dsn = make_conninfo(source.dsn, options="-c wal_sender_timeout=1s")
    with ReplicationConnection(dsn) as replication:
        replication.create_slot(source.slot, temporary=True)
        replication.start(source.slot, [source.publication], 0)
        time.sleep(2.5)

        with pytest.raises(ReplicationError):
            for _ in range(20):
                replication.read_batch(0.5)


def test_missing_slot_is_a_clear_error(postgres_dsn, unique_name):
    with ReplicationConnection(postgres_dsn) as replication, pytest.raises(ReplicationError) as error:
        replication.start(unique_name, ["anything"], 0)

    assert f'replication slot "{unique_name}" does not exist' in str(error.value)
    assert error.value.sqlstate == "42704"


def test_slot_in_use_by_another_connection_names_its_pid(source):
    with ReplicationConnection(source.dsn) as holder, ReplicationConnection(source.dsn) as other:
        holder.create_slot(source.slot, temporary=True)
        holder.start(source.slot, [source.publication], 0)

        with pytest.raises(ReplicationError) as error:
            other.start(source.slot, [source.publication], 0)
        holder_pid = holder.backend_pid

    assert f"is active for PID {holder_pid}" in str(error.value)
    assert error.value.sqlstate == "55006"


def test_missing_publication_is_reported_from_the_stream(source):
    with ReplicationConnection(source.dsn) as replication:
        replication.create_slot(source.slot, temporary=True)
        replication.start(source.slot, [f"{source.publication}_missing"], 0)
        insert(source, (1, "one"))

        with pytest.raises(ReplicationError, match=f'publication "{source.publication}_missing" does not exist'):
            read_transaction(replication)


def test_streaming_requires_protocol_version_2(source):
    with ReplicationConnection(source.dsn) as replication, pytest.raises(ValueError, match="proto_version 2"):
        replication.start(source.slot, [source.publication], 0, proto_version=1, streaming=True)


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(ReplicationError, match="cannot open a replication connection to 127.0.0.1:1/siphon"):
        ReplicationConnection("postgresql://postgres@127.0.0.1:1/siphon?connect_timeout=2")


def test_a_role_that_may_not_set_lc_messages_still_connects(postgres_server, unique_name):
    admin = postgres_server.dsn
    role = sql.Identifier(unique_name)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION").format(role))
    try:
        with ReplicationConnection(postgres_server.dsn_for("siphon", unique_name)) as replication:
            assert replication.identify_system().dbname == "siphon"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(role))


def test_pinned_session_settings_override_database_defaults(postgres_server, unique_name):
    database = sql.Identifier(unique_name)
    with psycopg.connect(postgres_server.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(database))
        for setting, value in [("DateStyle", "SQL, DMY"), ("TimeZone", "Asia/Tokyo"), ("bytea_output", "escape"),
                               ("IntervalStyle", "iso_8601"), ("extra_float_digits", "0")]:
            conn.execute(sql.SQL("ALTER DATABASE {} SET {} = {}").format(database, sql.Identifier(setting),
                                                                        sql.Literal(value)))
    dsn = postgres_server.dsn_for(unique_name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SHOW DateStyle").fetchone()[0] == "SQL, DMY"  # the defaults are in effect
            conn.execute("CREATE TABLE typed (id integer PRIMARY KEY, d date, ts timestamptz, b bytea, "
                         "i interval, f float8)")
            conn.execute("CREATE PUBLICATION typed FOR TABLE typed")
        with ReplicationConnection(dsn) as replication:
            replication.create_slot("typed", temporary=True)
            replication.start("typed", ["typed"], 0)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO typed VALUES (1, '2024-03-05', '2024-03-05 12:34:56.789+00', "
                             "'\\x00ff', '1 day 2 hours 3 minutes 4 seconds', 1.0 / 3)")
            change = read_transaction(replication)[2][1]

        assert isinstance(change, Insert)
        assert decode_tuple(change.new_tuple)[0] == [
            b"1", b"2024-03-05", b"2024-03-05 12:34:56.789+00", b"\\x00ff", b"1 day 02:03:04", b"0.3333333333333333",
        ]
    finally:
        with psycopg.connect(postgres_server.dsn, autocommit=True) as conn:
            _wait_for_slots_to_go(conn, unique_name)
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(database))


def test_capture_script_still_produces_the_committed_message_kinds(postgres_dsn, unique_name):
    """Keeps tests/fixtures/pgoutput_captures.json reproducible: same scenarios, same message kinds."""
    committed = json.loads(capture_pgoutput.DEFAULT_OUTPUT.read_text())["scenarios"]

    fresh = capture_pgoutput.capture(postgres_dsn, schema=unique_name)["scenarios"]

    def kinds(scenarios):
        return {name: sorted({m["name"].rstrip("_0123456789") for m in s["messages"]}) for name, s in scenarios.items()}

    assert kinds(fresh) == kinds(committed)


def _wait_for_slots_to_go(conn: psycopg.Connection, database: str, timeout: float = 10.0) -> None:
    """A temporary slot is released by its walsender as it exits, just after our disconnect."""
    deadline = time.monotonic() + timeout
    while conn.execute("SELECT 1 FROM pg_replication_slots WHERE database = %s", (database,)).fetchone():
        if time.monotonic() > deadline:
            raise AssertionError(f"replication slots of database {database} still exist after {timeout:.0f}s")
        time.sleep(0.1)
