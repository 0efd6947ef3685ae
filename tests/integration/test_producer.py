"""siphon-producer against a real PostgreSQL and JetStream: what reaches the stream, and how the
producer behaves at its edges (set-up errors, a second instance, signals, idle sources, metrics).

Each test has its own schema and application identifier (so its own slot, publication and stream)
and runs the producer as a subprocess (`python -m producer_service.cli run`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from siphon_core import naming
from siphon_core.session import connection_options
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.tuple_data import UNCHANGED_TOAST
from tests.helpers import stream
from tests.helpers.application import Application
from tests.helpers.producer import current_lsn, drop_application, execute, slot_confirmed_lsn, wait_until

INS, UPD, DEL, TRUNC = pb.INSERT, pb.UPDATE, pb.DELETE, pb.TRUNCATE


def test_every_operation_arrives_in_commit_order_with_keys_and_metadata(app: Application) -> None:
    app.sql("create table {schema}.items (id integer primary key, name text, n bigint not null)")
    producer = app.producer(["items"])
    app.sql("insert into {schema}.items values (1, 'one', 10), (2, 'two', 20)")
    app.sql("update {schema}.items set name = 'uno' where id = 1")
    app.sql("update {schema}.items set id = 3 where id = 2")  # a primary-key change
    app.sql("delete from {schema}.items where id = 1")
    app.sql("truncate {schema}.items")

    events = app.wait_for_events(6, "items")

    assert [e.operation for e in events] == [INS, INS, UPD, UPD, DEL, TRUNC]
    assert events[0].new_row() == {"id": b"1", "name": b"one", "n": b"10"}
    assert events[1].new_row() == {"id": b"2", "name": b"two", "n": b"20"}
    assert events[2].new_row() == {"id": b"1", "name": b"uno", "n": b"10"} and events[2].old is None
    assert events[3].old_is_key and not events[3].old_is_full
    assert events[3].old_row() == {"id": b"2", "name": None, "n": None}
    assert events[3].new_row() == {"id": b"3", "name": b"two", "n": b"20"}
    assert events[4].old_is_key and events[4].old_row()["id"] == b"1" and events[4].new is None
    assert events[5].new is None and events[5].old is None
    # Versions: the first two events share a transaction (positions 1, 2); then one per statement.
    assert [e.version for e in events] == sorted(e.version for e in events)
    assert events[0].commit_lsn == events[1].commit_lsn and [events[0].position, events[1].position] == [1, 2]
    assert len({e.xid for e in events}) == 5 and all(e.xid for e in events)
    assert all(abs(e.commit_time_us / 1e6 - time.time()) < 120 for e in events)

    package = stream.read_packages(app.nats_url, app.identifier)[0].package
    assert (package.application_identifier, package.schema, package.table) == (app.identifier, app.schema, "items")
    assert [(c.name, c.type_name, c.primary_key, c.nullable) for c in package.columns] == [
        ("id", "integer", True, False), ("name", "text", False, True), ("n", "bigint", False, False)]
    assert package.value_encoding == pb.PGOUTPUT_TUPLE and package.producer_version
    assert producer.stop() == 0


def test_replica_identity_full_sends_the_whole_old_row(app: Application) -> None:
    app.sql("create table {schema}.full_rows (id integer primary key, a text, b integer)")
    app.sql("alter table {schema}.full_rows replica identity full")
    app.producer(["full_rows"])
    app.sql("insert into {schema}.full_rows values (1, 'x', 1)")
    app.sql("update {schema}.full_rows set b = 2 where id = 1")
    app.sql("delete from {schema}.full_rows where id = 1")

    events = app.wait_for_events(3, "full_rows")

    update, delete = events[1], events[2]
    assert update.old_is_full and not update.old_is_key
    assert update.old_row() == {"id": b"1", "a": b"x", "b": b"1"}
    assert update.new_row() == {"id": b"1", "a": b"x", "b": b"2"}
    assert delete.old_is_full and delete.old_row() == {"id": b"1", "a": b"x", "b": b"2"}


def test_an_unchanged_toasted_value_stays_marked_unchanged(app: Application) -> None:
    app.sql("create table {schema}.docs (id integer primary key, body text, n integer)")
    app.sql("alter table {schema}.docs alter column body set storage external")  # no compression: stays > 8 kB
    app.producer(["docs"])
    # 12 kB that do not compress: stored out of line (TOAST).
    app.sql("insert into {schema}.docs select 1, string_agg(md5(g::text), '') from generate_series(1, 400) g")
    app.sql("update {schema}.docs set n = 1 where id = 1")

    events = app.wait_for_events(2, "docs")

    assert len(events[0].new_row()["body"]) == 12_800
    assert events[1].new_row() == {"id": b"1", "body": UNCHANGED_TOAST, "n": b"1"}


def test_a_multi_table_transaction_reaches_each_table_subject_with_one_commit_version(app: Application) -> None:
    app.sql("create table {schema}.a (id integer primary key)")
    app.sql("create table {schema}.b (id integer primary key)")
    app.producer(["a", "b"])
    with psycopg.connect(app.dsn) as connection:
        for index in range(1, 4):
            connection.execute(sql.SQL("insert into {} values (%s)").format(app.table("a")), (index,))
            connection.execute(sql.SQL("insert into {} values (%s)").format(app.table("b")), (index,))

    events = app.wait_for_events(6)

    by_table = {name: [e for e in events if e.table == app.qualified(name)] for name in ("a", "b")}
    assert [e.new_row()["id"] for e in by_table["a"]] == [b"1", b"2", b"3"]
    assert [e.position for e in by_table["a"]] == [1, 3, 5]
    assert [e.position for e in by_table["b"]] == [2, 4, 6]
    assert len({e.commit_lsn for e in events}) == 1 and len({e.xid for e in events}) == 1
    subjects = {p.subject for p in stream.read_packages(app.nats_url, app.identifier)}
    assert subjects == {naming.table_subject(app.identifier, app.schema, name) for name in ("a", "b")}


def test_interleaved_transactions_arrive_in_commit_order(app: Application) -> None:
    app.sql("create table {schema}.log (id integer primary key, writer text)")
    app.producer(["log"])
    first, second = psycopg.connect(app.dsn), psycopg.connect(app.dsn)
    insert = sql.SQL("insert into {} values (%s, %s)").format(app.table("log"))
    try:
        for index in range(10):  # two open transactions writing alternately
            (first if index % 2 == 0 else second).execute(insert, (index, "first" if index % 2 == 0 else "second"))
        second.commit()  # ... committing in the opposite order
        first.commit()
    finally:
        first.close()
        second.close()

    events = app.wait_for_events(10, "log")

    assert [e.new_row()["writer"] for e in events] == [b"second"] * 5 + [b"first"] * 5
    assert [e.new_row()["id"] for e in events] == [str(i).encode() for i in (1, 3, 5, 7, 9, 0, 2, 4, 6, 8)]
    assert [e.position for e in events] == [1, 2, 3, 4, 5] * 2
    assert events[0].commit_lsn < events[5].commit_lsn
    stream.assert_commit_order(events)


def test_a_million_row_transaction_is_split_across_packages(app: Application) -> None:
    app.sql("create table {schema}.big (id integer primary key, v integer)")
    producer = app.producer(["big"], max_package_events=10_000)
    app.sql("insert into {schema}.big select g, g from generate_series(1, 1000000) g")
    end = current_lsn(app.dsn)
    wait_until(lambda: slot_confirmed_lsn(app.dsn, app.slot) >= end, 60, "the transaction acked")

    packages = stream.read_packages(app.nats_url, app.identifier)

    assert len(packages) >= 100
    assert all(len(p.package.events) <= 10_000 for p in packages)
    positions = [event.position for p in packages for event in p.package.events]
    assert positions == list(range(1, 1_000_001))
    assert len({event.commit_lsn for p in packages for event in p.package.events}) == 1
    metrics = producer.metrics()
    assert metrics[f'siphon_producer_events_total{{operation="insert",table="{app.qualified("big")}"}}'] == 1_000_000


def test_a_value_larger_than_a_message_arrives_whole(app: Application) -> None:
    app.sql("create table {schema}.blobs (id integer primary key, body bytea)")
    app.producer(["blobs"], queue={"max_message_bytes": 65_536})
    body = os.urandom(300_000)
    app.sql("insert into {schema}.blobs values (1, %s), (2, 'small')", (body,))

    events = app.wait_for_events(2, "blobs")

    assert events[0].new_row()["body"] == b"\\x" + body.hex().encode()
    assert events[1].new_row()["body"] == b"\\x736d616c6c"
    packages = stream.read_packages(app.nats_url, app.identifier)
    assert packages[0].message_count >= 9  # 600 kB of hex text in slices below 64 kB
    assert packages[1].message_count == 1


def test_excluded_columns_never_appear(app: Application) -> None:
    app.sql("create table {schema}.notes (id integer primary key, note text, secret text, n integer)")
    app.sql("alter table {schema}.notes replica identity full")
    app.producer([{"name": "notes", "exclude_columns": ["secret"]}])
    app.sql("insert into {schema}.notes values (1, 'hello', 'hunter2', 1)")
    app.sql("update {schema}.notes set n = 2, secret = 'swordfish' where id = 1")
    app.sql("update {schema}.notes set id = 2 where id = 1")
    app.sql("delete from {schema}.notes where id = 2")

    events = app.wait_for_events(4, "notes")

    assert all(e.columns == ("id", "note", "n") for e in events)
    assert events[0].new_row() == {"id": b"1", "note": b"hello", "n": b"1"}
    assert events[1].old_row() == {"id": b"1", "note": b"hello", "n": b"1"}
    assert events[3].old_row() == {"id": b"2", "note": b"hello", "n": b"2"}
    for package in stream.read_packages(app.nats_url, app.identifier):
        raw = package.package.SerializeToString()
        assert b"secret" not in raw and b"hunter2" not in raw and b"swordfish" not in raw


def test_a_table_added_to_the_configuration_joins_the_publication(app: Application) -> None:
    app.sql("create table {schema}.first (id integer primary key)")
    app.sql("create table {schema}.second (id integer primary key)")
    producer = app.producer(["first"])
    app.sql("insert into {schema}.first values (1)")
    app.wait_for_events(1, "first")
    assert producer.stop() == 0

    app.sql("insert into {schema}.second values (1)")  # before it is published: never streamed
    producer.config["tables"].append({"name": app.qualified("second")})
    producer.write_config()
    producer.start()
    app.sql("insert into {schema}.second values (2)")

    events = app.wait_for_events(1, "second")

    assert [e.new_row()["id"] for e in events] == [b"2"]
    published = execute(app.dsn, "select tablename from pg_publication_tables where pubname = %s order by 1",
                        (app.publication,))
    assert published == [("first",), ("second",)]
    assert "table added to the publication" in producer.log() and app.qualified("second") in producer.log()


def test_tables_added_and_removed_in_the_file_are_followed_without_a_restart(app: Application) -> None:
    app.sql("create table {schema}.kept (id integer primary key)")
    app.sql("create table {schema}.removed (id integer primary key)")
    app.sql("create table {schema}.added (id integer primary key, secret text, n int)")
    producer = app.producer(["kept", "removed"], config_check_seconds=0.5)
    pid = producer.pid
    app.sql("insert into {schema}.removed values (1)")
    app.wait_for_events(1, "removed")

    producer.config["tables"] = [{"name": app.qualified("kept")},
                                 {"name": app.qualified("added"), "exclude_columns": ["secret"]}]
    producer.write_config()
    wait_until(lambda: execute(app.dsn, "select tablename from pg_publication_tables where pubname = %s order by 1",
                               (app.publication,)) == [("added",), ("kept",)], 30, "the publication to follow the file")
    app.sql("insert into {schema}.removed values (2)")
    app.sql("insert into {schema}.added values (1, 'hunter2', 7)")
    app.sql("insert into {schema}.kept values (1)")

    added = app.wait_for_events(1, "added")
    app.wait_for_events(1, "kept")
    assert producer.pid == pid  # the same process
    assert [e.new_row() for e in added] == [{"id": b"1", "n": b"7"}]
    assert [e.new_row()["id"] for e in app.events("removed")] == [b"1"]  # nothing after its removal
    assert "table added to the publication" in producer.log()
    assert producer.metrics()["siphon_producer_configured_tables"] == 2


def test_a_table_change_that_cannot_apply_yet_keeps_streaming_and_applies_once_it_can(app: Application) -> None:
    app.sql("create table {schema}.kept (id integer primary key)")
    producer = app.producer(["kept"], config_check_seconds=0.3)
    producer.config["tables"].append({"name": app.qualified("later")})
    producer.write_config()
    wait_until(lambda: "cannot be applied yet" in producer.log(), 30, "the refused change to be logged")
    app.sql("insert into {schema}.kept values (1)")
    app.wait_for_events(1, "kept")  # still streaming the tables it had
    assert producer.log().count("cannot be applied yet") == 1  # once, not at every check
    assert f"table {app.qualified('later')}: does not exist" in producer.log()

    app.sql("create table {schema}.later (id integer primary key)")
    wait_until(lambda: ("later",) in execute(app.dsn, "select tablename from pg_publication_tables where pubname = %s",
                                             (app.publication,)), 30, "the table to join once it exists")
    app.sql("insert into {schema}.later values (5)")
    assert [e.new_row()["id"] for e in app.wait_for_events(1, "later")] == [b"5"]


def test_sighup_reads_the_file_at_once(app: Application) -> None:
    app.sql("create table {schema}.first (id integer primary key)")
    app.sql("create table {schema}.second (id integer primary key)")
    producer = app.producer(["first"], config_check_seconds=3600)
    producer.config["tables"].append({"name": app.qualified("second")})
    producer.write_config()
    time.sleep(1.0)
    assert ("second",) not in execute(app.dsn, "select tablename from pg_publication_tables where pubname = %s",
                                      (app.publication,))
    producer.signal(signal.SIGHUP)
    wait_until(lambda: ("second",) in execute(app.dsn, "select tablename from pg_publication_tables where pubname = %s",
                                              (app.publication,)), 10, "SIGHUP to apply the change")


def test_tables_added_together_stream_at_once_while_one_of_them_cannot_yet(app: Application) -> None:
    """One edit adds a table that can be replicated and one without a primary key: the first joins
    the publication at once (a snapshot of it may start), the second once it has a key."""
    app.sql("create table {schema}.kept (id integer primary key)")
    app.sql("create table {schema}.ready (id integer primary key)")
    app.sql("create table {schema}.keyless (id integer)")
    producer = app.producer(["kept"], config_check_seconds=0.3)
    producer.config["tables"] += [{"name": app.qualified("ready")}, {"name": app.qualified("keyless")}]
    producer.write_config()
    published = "select tablename from pg_publication_tables where pubname = %s order by 1"
    wait_until(lambda: execute(app.dsn, published, (app.publication,)) == [("kept",), ("ready",)], 30,
               "the table that can be replicated to join at once")
    app.sql("insert into {schema}.ready values (3)")
    assert [e.new_row()["id"] for e in app.wait_for_events(1, "ready")] == [b"3"]
    wait_until(lambda: f"table {app.qualified('keyless')}: has no primary key" in producer.log(), 30,
               "the table left out to be named")
    time.sleep(1.0)  # a few more checks: the reason is logged once
    assert producer.log().count("has no primary key") == 1
    app.sql("alter table {schema}.keyless add primary key (id)")
    wait_until(lambda: ("keyless",) in execute(app.dsn, published, (app.publication,)), 30,
               "the table to join once it has a key")
    app.sql("insert into {schema}.keyless values (9)")
    assert [e.new_row()["id"] for e in app.wait_for_events(1, "keyless")] == [b"9"]
    assert producer.metrics()["siphon_producer_configured_tables"] == 3


def test_a_table_added_while_a_lock_is_held_on_it_waits_and_the_stream_goes_on(app: Application) -> None:
    """Adding a table to the publication waits for a lock on it (a long CREATE INDEX, a migration):
    the producer gives up after its lock timeout, streams on, and adds the table at a later check."""
    app.sql("create table {schema}.first (id integer primary key)")
    app.sql("create table {schema}.locked (id integer primary key)")
    producer = app.producer(["first"], config_check_seconds=0.5)
    with psycopg.connect(app.dsn) as holder:
        holder.execute(sql.SQL("lock table {} in access exclusive mode").format(app.table("locked")))
        producer.config["tables"].append({"name": app.qualified("locked")})
        producer.write_config()
        wait_until(lambda: "cannot be applied yet" in producer.log() and "lock timeout" in producer.log(), 30,
                   "the change to wait for the lock")
        app.sql("insert into {schema}.first values (1)")
        app.wait_for_events(1, "first")  # the stream went on meanwhile
        holder.rollback()
    wait_until(lambda: ("locked",) in execute(app.dsn, "select tablename from pg_publication_tables where pubname = %s",
                                              (app.publication,)), 30, "the table to be added once the lock is gone")
    app.sql("insert into {schema}.locked values (7)")
    app.wait_for_events(1, "locked")


def test_a_file_that_no_longer_loads_changes_nothing(app: Application) -> None:
    app.sql("create table {schema}.first (id integer primary key)")
    producer = app.producer(["first"], config_check_seconds=0.3)
    Path(producer.config_path).write_text("tables: [this is not\n")
    wait_until(lambda: "does not load" in producer.log(), 30, "the broken file to be reported")
    app.sql("insert into {schema}.first values (1)")
    app.wait_for_events(1, "first")
    assert execute(app.dsn, "select tablename from pg_publication_tables where pubname = %s",
                   (app.publication,)) == [("first",)]


@pytest.mark.parametrize("identity", ["default", "full"])
def test_a_table_without_a_primary_key_is_refused_clearly(app: Application, identity: str) -> None:
    # FULL would make PostgreSQL send its changes, but identical rows and NULLs cannot be keyed at a target.
    app.sql("create table {schema}.keyless (a integer, b text)")
    app.sql(f"alter table {{schema}}.keyless replica identity {identity}")
    producer = app.producer(["keyless"], start=False)
    producer.start(wait_streaming=False)

    assert producer.wait(30) == 3
    log = producer.log()
    assert f"table {app.qualified('keyless')}: has no primary key" in log
    assert f'ALTER TABLE "{app.schema}"."keyless" ADD PRIMARY KEY' in log
    assert not execute(app.dsn, "select 1 from pg_replication_slots where slot_name = %s", (app.slot,))


def test_a_table_whose_replica_identity_is_nothing_is_refused_clearly(app: Application) -> None:
    app.sql("create table {schema}.silent (id integer primary key, b text)")
    app.sql("alter table {schema}.silent replica identity nothing")
    producer = app.producer(["silent"], start=False)
    producer.start(wait_streaming=False)

    assert producer.wait(30) == 3
    assert f"table {app.qualified('silent')}: has no usable replica identity" in producer.log()
    assert f'ALTER TABLE "{app.schema}"."silent" REPLICA IDENTITY DEFAULT' in producer.log()


def test_a_second_producer_of_the_application_exits_naming_the_holder(app: Application) -> None:
    app.sql("create table {schema}.items (id integer primary key)")
    first = app.producer(["items"])
    second = app.producer(["items"], start=False)
    second.start(wait_streaming=False)

    assert second.wait(30) == 3
    holder = execute(app.dsn, "select pid from pg_stat_activity where application_name = %s and backend_type = "
                     "'client backend'", (f"siphon-producer {app.identifier}",))
    log = second.log()
    assert f"another producer of application '{app.identifier}' is running" in log
    assert f"backend pid {holder[0][0]} (siphon-producer {app.identifier} from 127.0.0.1" in log
    assert first.health() is not None and first.health()[0] == 200


@pytest.fixture
def replication_role(postgres_server, app: Application) -> Iterator[str]:
    role = f"{app.schema}_replicator"
    execute(app.dsn, sql.SQL("create role {} login replication").format(sql.Identifier(role)))
    execute(app.dsn, sql.SQL("grant usage on schema {} to {}").format(sql.Identifier(app.schema), sql.Identifier(role)))
    try:
        yield postgres_server.dsn_for("siphon", role)
    finally:
        for process in app.producers:
            process.ensure_stopped()
        execute(app.dsn, sql.SQL("drop owned by {} cascade").format(sql.Identifier(role)))
        wait_until(lambda: not execute(app.dsn, "select 1 from pg_stat_activity where usename = %s", (role,)), 30,
                   "the role's sessions ended")
        execute(app.dsn, sql.SQL("drop role {}").format(sql.Identifier(role)))


def test_a_replication_role_streams_when_the_owner_created_the_publication(app: Application,
                                                                             replication_role: str) -> None:
    app.sql("create table {schema}.items (id integer primary key, name text)")
    role = psycopg.conninfo.conninfo_to_dict(replication_role)["user"]
    app.sql(f'grant select on {{schema}}.items to "{role}"')
    refused = app.producer(["items"], dsn=replication_role, start=False, name="refused")
    refused.start(wait_streaming=False)
    assert refused.wait(30) == 3
    log = refused.log()
    assert f"publication '{app.publication}' does not match the configured tables and this role may not change it" \
        in log
    assert f'CREATE PUBLICATION "{app.publication}" FOR TABLE "{app.schema}"."items"' in log

    app.sql(sql.SQL("create publication {} for table {{schema}}.items").format(
        sql.Identifier(app.publication)).as_string(None))
    producer = app.producer(["items"], dsn=replication_role, heartbeat_interval_seconds=0.5)
    app.sql("insert into {schema}.items values (1, 'by the owner')")

    events = app.wait_for_events(1, "items")
    assert events[0].new_row() == {"id": b"1", "name": b"by the owner"}
    wait_until(lambda: producer.metrics()["siphon_producer_heartbeats_total"] >= 1, 10, "a heartbeat by the role")


def test_a_role_without_replication_is_told_what_to_grant(app: Application, replication_role: str) -> None:
    app.sql("create table {schema}.items (id integer primary key)")
    role = psycopg.conninfo.conninfo_to_dict(replication_role)["user"]
    app.sql(f'alter role "{role}" noreplication')
    app.sql(f'grant select on {{schema}}.items to "{role}"')
    app.sql(sql.SQL("create publication {} for table {{schema}}.items").format(
        sql.Identifier(app.publication)).as_string(None))
    producer = app.producer(["items"], dsn=replication_role, start=False)
    producer.start(wait_streaming=False)

    assert producer.wait(30) == 3
    assert f'the producer\'s role needs the REPLICATION attribute: ALTER ROLE "{role}" REPLICATION' in producer.log()


def test_sigterm_flushes_acks_and_confirms_so_a_restart_resends_nothing(app: Application) -> None:
    app.sql("create table {schema}.items (id integer primary key)")
    producer = app.producer(["items"], flush_interval_seconds=60, max_package_events=100_000)
    insert = sql.SQL("insert into {} values (%s)").format(app.table("items"))
    stop_writing = threading.Event()
    written = []

    def write() -> None:  # one row per transaction, ids in commit order
        with psycopg.connect(app.dsn, autocommit=True) as connection:
            while not stop_writing.is_set():
                connection.execute(insert, (len(written) + 1,))
                written.append(len(written) + 1)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        time.sleep(1.5)
        assert producer.stop() == 0  # under load: buffers hold events, packages await acks
    finally:
        stop_writing.set()
        writer.join()
    confirmed = slot_confirmed_lsn(app.dsn, app.slot)
    before_restart = app.events("items")
    ids = [int(e.new_row()["id"]) for e in stream.unique_events(before_restart)]
    assert ids == list(range(1, len(ids) + 1)) and len(ids) > 10  # a prefix of the commits, no gap
    # Everything streamed before the stop was confirmed, except possibly one transaction left open
    # by the stop (its events were flushed, its commit not read yet).
    unconfirmed = {e.commit_lsn for e in before_restart if e.commit_lsn >= confirmed}
    assert len(unconfirmed) <= 1

    end = current_lsn(app.dsn)
    producer.start()
    events = app.wait_for_events(len(written), "items")
    assert producer.stop() == 0
    wait_until(lambda: slot_confirmed_lsn(app.dsn, app.slot) >= end, 10, "the slot confirmed at the end")

    stream.assert_commit_order(events)
    assert sorted(int(e.new_row()["id"]) for e in stream.unique_events(events)) == written
    # Only that open transaction may come again.
    streamed_before = {e.version for e in before_restart}
    resent = {e.commit_lsn for e in events[len(before_restart):] if e.version in streamed_before}
    assert resent <= unconfirmed
    assert "stopped" in producer.log()


def test_heartbeats_advance_the_slot_on_an_idle_source(app: Application) -> None:
    app.sql("create table {schema}.quiet (id integer primary key)")
    producer = app.producer(["quiet"], heartbeat_interval_seconds=0.5)
    # WAL of other databases and tables moves on; this application's tables never change.
    with psycopg.connect(app.dsn, autocommit=True) as connection:
        connection.execute("create temporary table elsewhere (x integer)")
        for _ in range(3):
            connection.execute("insert into elsewhere values (1)")
    before = current_lsn(app.dsn)

    wait_until(lambda: slot_confirmed_lsn(app.dsn, app.slot) >= before, 15, "the slot advanced past idle WAL")
    wait_until(lambda: producer.metrics()["siphon_producer_heartbeats_total"] >= 2, 15, "two heartbeats")
    assert not app.events()


def test_metrics_and_health_answer(app: Application) -> None:
    app.sql("create table {schema}.items (id integer primary key)")
    producer = app.producer(["items"])
    app.sql("insert into {schema}.items select generate_series(1, 5)")
    app.sql("delete from {schema}.items where id = 1")
    app.wait_for_events(6, "items")

    status, health = producer.health()
    assert status == 200 and health["streaming"] is True
    table = app.qualified("items")
    wait_until(lambda: producer.metrics()[f'siphon_producer_packages_total{{table="{table}"}}'] >= 1, 5, "counted")
    # The confirmed LSN is reported with the next status update, a moment after the ack.
    wait_until(lambda: producer.metrics()["siphon_producer_last_acked_lsn"] > 0, 5, "LSN confirmed")
    metrics = producer.metrics()
    assert metrics[f'siphon_producer_events_total{{operation="insert",table="{table}"}}'] == 5
    assert metrics[f'siphon_producer_events_total{{operation="delete",table="{table}"}}'] == 1
    assert metrics[f'siphon_producer_package_bytes_total{{table="{table}"}}'] > 0
    assert metrics["siphon_producer_publish_ack_seconds_count"] >= 1
    assert metrics["siphon_producer_max_resident_memory_bytes"] > 10_000_000
    assert metrics["siphon_producer_last_acked_lsn"] > 0
    assert producer.stop() == 0
    assert producer.health() is None  # the endpoint went with the process


# The producer's replication connection pins these; PostgreSQL's own output under them is the truth.
PINNED_OPTIONS = connection_options()

# Built-in types with edge values, as PostgreSQL input text (one row per value).
BUILT_IN_VALUES: dict[str, list[str]] = {
    "boolean": ["t", "f"],
    "smallint": ["-32768", "32767"],
    "integer": ["-2147483648", "2147483647"],
    "bigint": ["-9223372036854775808", "9223372036854775807"],
    "real": ["3.14", "NaN", "Infinity", "-Infinity", "-0", "1e-45", "3.4028235e+38"],
    "double precision": ["0.1", "NaN", "Infinity", "-Infinity", "-0", "5e-324", "1.7976931348623157e+308"],
    "numeric": ["NaN", "Infinity", "-Infinity", "1e-30", "1" + "0" * 300 + ".5", "-0.00100", "0"],
    "numeric(10,2)": ["12345678.91", "NaN", "-0.5"],
    "money": ["1234.56", "-92233720368547758.08"],
    "text": ["héllo\tworld\nnew\\line \"q\" 's", "", " ", "NULL", "ü日本語🎉", "\r\b\f\x01\x7f"],
    "character varying(20)": ["trailing  "],
    "character(5)": ["ab"],
    "name": ["a name"],
    '"char"': ["x"],
    "bytea": ["\\x0001027f80ff", "\\x", "\\x5c6e0a09"],
    "date": ["2024-02-29", "infinity", "-infinity", "4713-01-01 BC", "5874897-12-31"],
    "time": ["00:00:00", "24:00:00", "23:59:59.999999"],
    "time with time zone": ["12:34:56+05:30", "00:00:00-15:59"],
    "timestamp": ["2024-01-02 03:04:05.123456", "infinity", "-infinity", "4713-01-01 00:00:00 BC",
                  "294276-12-31 23:59:59.999999"],
    "timestamp with time zone": ["2024-01-02 03:04:05.123456+02", "infinity", "-infinity", "1900-01-01 00:00:00+00"],
    "interval": ["1 year 2 mons 3 days 04:05:06.789", "-1 mons +1 day -00:00:01", "178000000 years",
                 "-00:00:00.000001", "0"],
    "json": ['{"b": 1,  "a": [1, 2], "a": null}', ' "x" ', '{"k":"\\u00e9\\t"}', "[\n 1 ,\t2 ]"],
    "jsonb": ['{"b": 1, "a": {"c": [1, 2.50]}, "a": 2}', '"é\\t"'],
    "uuid": ["A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11"],
    "inet": ["192.168.0.1", "2001:db8::1/64"],
    "cidr": ["10.0.0.0/8"],
    "macaddr": ["08:00:2B:01:02:03"],
    "macaddr8": ["08:00:2b:01:02:03:04:05"],
    "bit(4)": ["1010"],
    "bit varying": ["", "101"],
    "xml": ['<a b="1">x &amp; y</a>'],
    "tsvector": ["a fat cat sat", "'with space':1A"],
    "tsquery": ["fat & (rat | cat)"],
    "point": ["(1.5,-2)", "(NaN,Infinity)"],
    "line": ["{1,-1,0}"],
    "lseg": ["[(0,0),(1,1)]"],
    "box": ["(1,1),(0,0)"],
    "path": ["[(0,0),(1,1),(2,0)]"],
    "polygon": ["((0,0),(1,1),(1,0))"],
    "circle": ["<(0,0),1.5>"],
    "oid": ["4294967295"],
    "xid": ["4294967295"],
    "xid8": ["18446744073709551615"],
    "pg_lsn": ["FFFFFFFF/FFFFFFFF"],
    "tid": ["(4294967295,65535)"],
    "regclass": ["pg_class"],
    "regtype": ["integer"],
    "pg_snapshot": ["10:20:10,14,15"],
    "jsonpath": ["$.a[*] ? (@ > 1)"],
    "int4range": ["[1,10)", "empty", "(,5]"],
    "int8range": ["[-9223372036854775808,9223372036854775807)"],
    "numrange": ["(1.5,)", "[-Infinity,Infinity]"],
    "tstzrange": ['["2024-01-01 00:00:00+00",infinity)'],
    "daterange": ["[2024-01-01,2024-02-01)"],
    "int4multirange": ["{[1,3), [5,7)}", "{}"],
    "integer[]": ["{1,NULL,3}", "{}", "{{1,2},{3,4}}", "[0:1]={5,6}"],
    "text[]": ['{"a b","c,d","NULL",NULL,"\\"q\\"","é\\\\",""}'],
    "double precision[]": ["{NaN,Infinity,-0,1e-300}"],
    "bytea[]": ['{"\\\\x00ff",NULL}'],
    "timestamp with time zone[]": ["{infinity,-infinity,\"2024-01-01 00:00:00+00\"}"],
    "numeric[]": ["{NaN,Infinity,1.50,NULL}"],
    "interval[]": ['{"1 mon","-2 years 3 days"}'],
}


def postgres_text(dsn: str, query: sql.Composable) -> list[tuple[bytes | None, ...]]:
    """PostgreSQL's output functions' bytes under the pinned settings, straight from libpq."""
    with psycopg.connect(dsn, options=PINNED_OPTIONS) as connection:
        cursor = connection.execute(query)
        result = cursor.pgresult
        assert result is not None
        return [tuple(None if (v := result.get_value(r, c)) is None else bytes(v) for c in range(result.nfields))
                for r in range(result.ntuples)]


def test_every_built_in_type_reaches_the_package_as_postgres_writes_it(app: Application) -> None:
    columns = {f"c{index}": kind for index, kind in enumerate(BUILT_IN_VALUES)}
    definition = sql.SQL(", ").join([sql.SQL("id integer primary key"),
                                     *(sql.SQL(f"{name} {kind}") for name, kind in columns.items())])
    app.sql(sql.SQL("create table {} ({})").format(app.table("all_types"), definition).as_string(None))
    app.producer(["all_types"])
    rows = max(len(values) for values in BUILT_IN_VALUES.values()) + 1  # the last row is all NULL
    insert = sql.SQL("insert into {} values (%s, {})").format(
        app.table("all_types"), sql.SQL(", ").join(sql.SQL(f"%s::{kind}") for kind in columns.values()))
    with psycopg.connect(app.dsn) as connection:  # one transaction
        for row in range(rows):
            values = [values[row] if row < len(values) else None for values in BUILT_IN_VALUES.values()]
            connection.execute(insert, [row, *values])

    events = app.wait_for_events(rows, "all_types")

    expected = postgres_text(app.dsn, sql.SQL("select * from {} order by id").format(app.table("all_types")))
    type_names = app.sql("select format_type(atttypid, atttypmod) from pg_attribute where attrelid = %s::regclass "
                         "and attnum > 0 order by attnum", (f"{app.schema}.all_types",))
    package_columns = stream.read_packages(app.nats_url, app.identifier)[0].package.columns
    assert [(c.name, c.type_name) for c in package_columns] == list(zip(["id", *columns], [t for t, in type_names],
                                                                         strict=True))
    for event, row in zip(events, expected, strict=True):
        assert event.new == row, [(name, got, want) for name, got, want in zip(event.columns, event.new, row, strict=True)
                                  if got != want]


def test_non_utf8_text_and_database_settings_do_not_change_values(postgres_server, nats_url: str, unique_name: str,
                                                                  tmp_path: Path) -> None:
    database = f"{unique_name}_ascii"
    quoted = sql.Identifier(database)
    execute(postgres_server.dsn, sql.SQL("create database {} encoding 'SQL_ASCII' template template0 "
                                         "lc_collate 'C' lc_ctype 'C'").format(quoted))
    # Database defaults that would change the text of dates, intervals, floats and bytea.
    for setting, value in (("DateStyle", "SQL, DMY"), ("IntervalStyle", "sql_standard"),
                           ("TimeZone", "Pacific/Chatham"), ("extra_float_digits", "0"), ("bytea_output", "escape")):
        execute(postgres_server.dsn, sql.SQL("alter database {} set {} = {}").format(
            quoted, sql.Identifier(setting), sql.Literal(value)))
    dsn = postgres_server.dsn_for(database)
    app = Application(dsn, nats_url, unique_name, "legacy", tmp_path)
    try:
        app.sql("create schema {schema}")
        app.sql("create table {schema}.latin (id integer primary key, body text, at timestamptz, span interval, "
                "ratio double precision, raw bytea)")
        app.producer(["latin"])
        app.sql(r"insert into {schema}.latin values (1, E'caf\xe9 na\xefve \xff\xfe\x80', "
                "'2024-03-04 05:06:07.5+00', '1 year 2 mons -3 days 04:05:06', 0.1, '\\x00ff'), "
                r"(2, E'utf-8 \xc3\xa9 and latin-1 \xe9 side by side', '-infinity', '-1 mons', 'NaN', '\\x')")

        events = app.wait_for_events(2, "latin")

        expected = postgres_text(dsn, sql.SQL("select * from {} order by id").format(app.table("latin")))
        assert [event.new for event in events] == expected
        assert events[0].new_row()["body"] == b"caf\xe9 na\xefve \xff\xfe\x80"
        assert events[0].new_row()["at"] == b"2024-03-04 05:06:07.5+00"
        assert events[0].new_row()["span"] == b"1 year 2 mons -3 days +04:05:06"
        assert events[0].new_row()["ratio"] == b"0.1" and events[0].new_row()["raw"] == b"\\x00ff"
    finally:
        for process in app.producers:
            print(f"--- log of {process.config_path.name}\n{process.log()}")
        for process in app.producers:
            process.ensure_stopped()
        drop_application(dsn, nats_url, app.identifier)
        execute(postgres_server.dsn, sql.SQL("drop database {}").format(quoted))
