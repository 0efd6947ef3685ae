"""NATS logins other than a password, against a real nats-server: an nkey seed
(`queue.nkey_seed_file`, the server lists the users' public keys) and a creds file
(`queue.creds_file`, decentralized authentication: an operator, an account and user JWTs). Each side
logs in as its own user holding exactly its permissions (`siphon_stack.nats.PERMISSIONS`, the
README's) and connects to PostgreSQL as the README's least-privilege role; the producer publishes,
snapshots and a streaming run bring a table into ClickHouse, and the server denies nothing. An
unknown key is refused at once, in one line that names NATS and the URL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import nkeys
import psycopg
import pytest
import yaml
from psycopg import sql
from psycopg.conninfo import make_conninfo

from siphon_core import naming
from siphon_core.config import load_config, parse_config
from siphon_core.queue import JetStreamQueue, QueueError
from siphon_dagster import source
from siphon_dagster.checks.command import run_checks, selected_keys, status_line
from siphon_dagster.definitions import build_definitions, build_resources
from siphon_dagster.partitions import ranges_for
from siphon_dagster.specs import group_name, table_specs
from siphon_stack.nats import PERMISSIONS, NatsServer
from siphon_stack.process import free_port, stop_pid
from tests.helpers.instance import instance_for_test
from tests.helpers.nats_identities import Operator, new_seed, nkey_users_block
from tests.helpers.producer import ProducerProcess, drop_application, producer_config, wait_until
from tests.integration.test_end_to_end import run_stream_jobs, source_rows, target_rows

ROWS = 500


@dataclass
class Logins:
    """A running server and the `queue:` settings of its users: the producer, the Dagster side, and a
    stranger whose key the server does not know."""

    url: str
    log_path: Path
    producer: dict[str, str]
    dagster: dict[str, str]
    stranger: dict[str, str]
    secrets: list[bytes]  # what must never be printed: the seeds


def nkey_logins(root: Path) -> tuple[str, dict[str, dict[str, str]], list[bytes]]:
    seeds = {name: new_seed() for name in ("producer", "dagster", "stranger")}
    files = {}
    for name, seed in seeds.items():
        files[name] = root / f"{name}.nk"
        files[name].write_bytes(seed + b"\n")
        files[name].chmod(0o600)
    block = nkey_users_block({name: (seeds[name], PERMISSIONS[name]) for name in ("producer", "dagster")})
    return block, {name: {"nkey_seed_file": str(path)} for name, path in files.items()}, list(seeds.values())


def creds_logins(root: Path) -> tuple[str, dict[str, dict[str, str]], list[bytes]]:
    operator = Operator()
    files = {name: operator.user_creds(root / f"{name}.creds", f"siphon-{name}", PERMISSIONS[name])
             for name in ("producer", "dagster")}
    # Signed by an account the server's operator never issued.
    files["stranger"] = operator.user_creds(root / "stranger.creds", "stranger", PERMISSIONS["producer"],
                                            account_seed=new_seed(nkeys.PREFIX_BYTE_ACCOUNT))
    seeds = [line.encode() for path in files.values() for line in path.read_text().splitlines()
             if line.startswith("SU")]
    return operator.server_block(), {name: {"creds_file": str(path)} for name, path in files.items()}, seeds


@pytest.fixture(scope="module", params=["nkey", "creds"])
def logins(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logins]:
    root = tmp_path_factory.mktemp(f"nats-{request.param}")
    keys = root / "keys"
    keys.mkdir()
    block, queues, seeds = (nkey_logins if request.param == "nkey" else creds_logins)(keys)
    server = NatsServer(root / "server", free_port(), free_port(), login_block=block)
    pid = server.start()
    try:
        yield Logins(server.url, server.log_path, queues["producer"], queues["dagster"], queues["stranger"], seeds)
    finally:
        stop_pid(pid)


@pytest.fixture
def roles(postgres_dsn: str, unique_name: str) -> Iterator[dict[str, str]]:
    """A schema with one table, the README's two roles ("PostgreSQL roles") and the publication,
    created by the table's owner; the roles' DSNs."""
    schema, items = sql.Identifier(unique_name), sql.Identifier(unique_name, "items")
    names = {"producer": f"{unique_name}_producer", "reader": f"{unique_name}_reader"}
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        database = sql.Identifier(connection.info.dbname)
        connection.execute(sql.SQL("create schema {}").format(schema))
        connection.execute(sql.SQL("create table {} (id bigint primary key, title text, qty integer)").format(items))
        connection.execute(sql.SQL("insert into {} select g, 'item ' || g, g from generate_series(1, %s::int) g"
                                   ).format(items), (ROWS,))
        for role in map(sql.Identifier, names.values()):
            connection.execute(sql.SQL("create role {} login replication").format(role))
            connection.execute(sql.SQL("grant connect on database {} to {}").format(database, role))
            connection.execute(sql.SQL("grant usage on schema {} to {}").format(schema, role))
            connection.execute(sql.SQL("grant select on {} to {}").format(items, role))
        connection.execute(sql.SQL("create publication {} for table {} with (publish_via_partition_root = true)"
                                   ).format(sql.Identifier(naming.publication_name(unique_name)), items))
    try:
        yield {kind: make_conninfo(postgres_dsn, user=role) for kind, role in names.items()}
    finally:
        drop_application(postgres_dsn, None, unique_name)
        with psycopg.connect(postgres_dsn, autocommit=True) as connection:
            connection.execute(sql.SQL("drop schema {} cascade").format(schema))
            for role in map(sql.Identifier, names.values()):
                connection.execute(sql.SQL("drop owned by {}").format(role))
                connection.execute(sql.SQL("drop role {}").format(role))


def side_config(logins: Logins, login: dict[str, str], dsn: str, identifier: str, **extra: Any) -> dict[str, Any]:
    config = producer_config(identifier, dsn, logins.url, [{"name": f"{identifier}.items", "blocks_per_partition": 2}],
                             connect_retries=1)
    config["queue"].update(login)
    return {**config, **extra}


def test_each_side_streams_with_its_own_key_and_least_privileges(logins: Logins, roles: dict[str, str],
                                                                   postgres_dsn: str, clickhouse_url: str,
                                                                   unique_name: str, tmp_path: Path) -> None:
    items = sql.Identifier(unique_name, "items")
    producer = ProducerProcess(tmp_path / "producer", side_config(logins, logins.producer, roles["producer"],
                                                                  unique_name))
    dagster_path = tmp_path / "siphon.yaml"
    dagster_path.write_text(yaml.safe_dump(side_config(
        logins, logins.dagster, roles["reader"], unique_name, targets={"clickhouse": {"url": clickhouse_url,
                                                                                       "database": unique_name}},
        streaming={"batch_max_wait_seconds": 0.3})))
    config = load_config(dagster_path)
    try:
        producer.start(timeout=60)
        defs, specs = build_definitions(config), table_specs(config)
        with instance_for_test() as instance:
            with source.connect(roles["reader"]) as connection:
                size = source.table_size(connection, specs[0].table)
            keys = [r.key for r in ranges_for(size.blocks, specs[0].table.blocks_per_partition)]
            instance.add_dynamic_partitions(specs[0].partitions_def_name, keys)
            asset = defs.resolve_assets_def(specs[0].target_key("clickhouse"))
            for key in keys:
                assert dg.materialize([asset], partition_key=key, instance=instance).success
            # These changes reach ClickHouse through the queue only: published by the producer's
            # user, consumed and acknowledged by the Dagster side's.
            with psycopg.connect(postgres_dsn, autocommit=True) as connection:
                connection.execute(sql.SQL("update {} set qty = qty + 1000 where id % 7 = 0").format(items))
                connection.execute(sql.SQL("delete from {} where id % 11 = 0").format(items))
                connection.execute(sql.SQL("insert into {} select g, 'late', 0 from generate_series(%s::int, %s::int) g"
                                           ).format(items), (ROWS + 1, ROWS + 50))
                end = naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])

            def caught_up() -> bool:
                with psycopg.connect(postgres_dsn) as connection:
                    row = connection.execute("select confirmed_flush_lsn::text from pg_replication_slots "
                                             "where slot_name = %s", (naming.slot_name(unique_name),)).fetchone()
                return bool(row and row[0]) and naming.parse_lsn(row[0]) >= end

            wait_until(caught_up, 60, "producer caught up")
            run_stream_jobs(defs, specs, instance, drain=True)
            # The checks read the queue (consumer positions, single messages) and the source too.
            evaluations = run_checks(defs, group_name(unique_name), selected_keys(config, None, None), instance)
            assert evaluations
            assert all(e.passed for e in evaluations), [status_line(e) for e in evaluations]
        with psycopg.connect(postgres_dsn) as connection:
            table = source.table_schema(connection, config.tables[0])
        target = build_resources(config)["clickhouse_target"].open_target()
        try:
            expected, actual = source_rows(postgres_dsn, table), target_rows(target, table)
        finally:
            target.close()
        assert len(expected) == ROWS + 50 - ROWS // 11
        assert actual == expected
        assert producer.stop() == 0
        log = producer.log().encode()
        assert not [seed for seed in logins.secrets if seed in log]
        denied = [line for line in logins.log_path.read_text().splitlines() if "Violation" in line]
        assert not denied
    finally:
        producer.ensure_stopped()


def test_an_unknown_key_is_refused_at_once_in_one_line(logins: Logins, postgres_dsn: str, unique_name: str,
                                                       tmp_path: Path) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        connection.execute(sql.SQL("create table {} (id bigint primary key)").format(
            sql.Identifier(unique_name, "items")))
    wrong = ProducerProcess(tmp_path, side_config(logins, logins.stranger, postgres_dsn, unique_name), name="stranger")
    started = time.monotonic()
    wrong.start(wait_streaming=False)
    try:
        assert wrong.wait(60) == 3
    finally:
        wrong.ensure_stopped()
        drop_application(postgres_dsn, None, unique_name)
    assert time.monotonic() - started < 30  # not retried like an unreachable server
    log = wrong.log()
    errors = [line for line in log.splitlines() if "refused the login" in line]
    assert len(errors) == 1, log
    assert f"NATS at {logins.url} refused the login" in errors[0]
    assert "Traceback" not in log
    assert not [seed for seed in logins.secrets if seed.decode() in log]

    # The Dagster side's queue client fails the same way, at once.
    queue_config = parse_config({"application_identifier": unique_name, "source": {"dsn": postgres_dsn},
                                 "queue": {"url": logins.url, **logins.stranger}, "tables": [{"name": "public.x"}]})
    queue = JetStreamQueue.from_config(queue_config.queue, unique_name)
    started = time.monotonic()
    with pytest.raises(QueueError) as refused:
        asyncio.run(asyncio.wait_for(queue.connect(connect_timeout=2.0), 20))
    assert time.monotonic() - started < 10
    assert str(refused.value).startswith(f"NATS at {logins.url} refused the login")
    assert "\n" not in str(refused.value)
