"""Starts that cannot succeed end cleanly: a source that never answers yields to SIGTERM at once, a
refused login is said once and not retried, and a queue that cannot be reached leaves no
publication or slot behind at the source."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
import yaml

from siphon_core import naming
from siphon_stack.postgres import PostgresServer, ServerAccount, find_bindir
from siphon_stack.process import free_port
from tests.helpers.producer import REPOSITORY, producer_config


def start_producer(directory: Path, config: dict) -> tuple[subprocess.Popen, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    path, log = directory / "siphon.yaml", directory / "producer.log"
    path.write_text(yaml.safe_dump(config))
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "producer_service.cli", "run", "--config", str(path)],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPOSITORY,
                                   env={**os.environ, "PYTHONPATH": str(REPOSITORY)}, start_new_session=True)
    return process, log


def test_sigterm_ends_a_connect_to_a_source_that_never_answers(tmp_path: Path, nats_url: str) -> None:
    # A listening socket that never accepts: the TCP connect succeeds, PostgreSQL's answer never comes.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        dsn = f"postgresql://siphon@127.0.0.1:{silent.getsockname()[1]}/app"
        process, log = start_producer(tmp_path, producer_config("silent", dsn, nats_url, ["public.t"]))
        time.sleep(3.0)
        assert process.poll() is None, log.read_text()
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=20)
        assert time.monotonic() - started < 5.0, log.read_text()
        assert code == 0, log.read_text()
    finally:
        silent.close()


@pytest.fixture(scope="module")
def password_server(shared_tmp_dir: Path) -> PostgresServer:
    """A server of its own that checks passwords (the shared one trusts loopback)."""
    server = PostgresServer(shared_tmp_dir / "pg-password", free_port(), find_bindir())
    server.initialize()
    pid = server.start()
    try:
        hba = server.data_dir / "pg_hba.conf"
        hba.write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
                       "host replication all 127.0.0.1/32 scram-sha-256\n")
        account = ServerAccount.for_postgres()
        if account:
            os.chown(hba, account.uid, account.gid)
        with psycopg.connect(server.dsn, autocommit=True) as connection:
            connection.execute("alter role postgres password 'right-password'")
            connection.execute("select pg_reload_conf()")
        yield server
    finally:
        server.stop(pid)


def test_a_refused_login_is_said_once_and_not_retried(tmp_path: Path, nats_url: str,
                                                      password_server: PostgresServer) -> None:
    dsn = f"postgresql://postgres:wrong-password@127.0.0.1:{password_server.port}/siphon"
    process, log = start_producer(tmp_path, producer_config("refused", dsn, nats_url, ["public.t"],
                                                            connect_retries=5))
    code = process.wait(timeout=30)
    text = log.read_text()
    assert code == 3, text
    assert "refused the login" in text and "password authentication failed" in text
    assert "reconnecting" not in text
    assert "wrong-password" not in text


def test_a_start_that_cannot_reach_the_queue_leaves_nothing_at_the_source(tmp_path: Path, postgres_dsn: str,
                                                                        unique_name: str) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(f'create table "{unique_name}" (id int primary key)')
    closed_port = free_port()
    config = producer_config(unique_name, postgres_dsn, f"nats://127.0.0.1:{closed_port}",
                             [f"public.{unique_name}"], connect_retries=0, publish_retry_seconds=2)
    process, log = start_producer(tmp_path, config)
    code = process.wait(timeout=60)
    assert code == 1, log.read_text()
    with psycopg.connect(postgres_dsn) as connection:
        slots = connection.execute("select slot_name from pg_replication_slots where slot_name = %s",
                                   (naming.slot_name(unique_name),)).fetchall()
        publications = connection.execute("select pubname from pg_publication where pubname = %s",
                                          (naming.publication_name(unique_name),)).fetchall()
    assert slots == [] and publications == [], log.read_text()
