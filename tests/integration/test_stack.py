"""`siphon-stack` as a person uses it: up, status, down, and what a crashed run leaves behind."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import psycopg
import pytest

from siphon_core.queue import JetStreamQueue, StreamSettings
from siphon_stack.process import pid_alive


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "siphon_stack.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def read_env(path):
    env = {}
    for line in path.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'")
    return env


@pytest.fixture(scope="module")
def stack_dir(shared_tmp_dir):
    directory = shared_tmp_dir / "stack"
    result = run_cli("up", "--dir", str(directory))
    assert result.returncode == 0, result.stderr
    yield directory
    run_cli("down", "--dir", str(directory))


def test_up_writes_the_environment_every_client_needs(stack_dir):
    env = read_env(stack_dir / "stack.env")
    for key in ("SIPHON_PG_DSN", "SIPHON_NATS_URL", "SIPHON_CLICKHOUSE_URL", "SIPHON_SNOWFLAKE_ACCOUNT",
                "SIPHON_SNOWFLAKE_PORT"):
        assert env.get(key), key
    with psycopg.connect(env["SIPHON_PG_DSN"]) as connection:
        assert connection.execute("show wal_level").fetchone()[0] == "logical"
        assert int(connection.execute("show max_replication_slots").fetchone()[0]) >= 16
    import clickhouse_connect

    host_port = env["SIPHON_CLICKHOUSE_URL"].rsplit(":", 1)
    client = clickhouse_connect.get_client(host="127.0.0.1", port=int(host_port[1]))
    assert client.query("select 40 + 2").result_rows == [(42,)]


def test_status_reports_every_service_running(stack_dir):
    result = run_cli("status", "--dir", str(stack_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("postgres", "nats", "clickhouse", "snowflake"):
        assert name in result.stdout
    assert "STOPPED" not in result.stdout


def test_jetstream_accepts_a_publish_with_an_ack(stack_dir, unique_name):
    env = read_env(stack_dir / "stack.env")

    async def publish():
        queue = JetStreamQueue(env["SIPHON_NATS_URL"], StreamSettings(unique_name))
        await queue.connect()
        try:
            await queue.ensure_stream()
            first = await queue.publish(f"siphon.{unique_name}.public.t", b"payload", message_id="m-1")
            again = await queue.publish(f"siphon.{unique_name}.public.t", b"payload", message_id="m-1")
            info = await queue.js.stream_info(queue.settings.stream)
            return first, again, info
        finally:
            await queue.close()

    first, again, info = asyncio.run(publish())
    assert first == again == 1  # the resend was recognised as a duplicate
    assert info.state.messages == 1
    assert info.config.duplicate_window == 600


def test_a_second_up_is_harmless_and_a_taken_directory_is_reused(stack_dir):
    before = (stack_dir / "stack.json").read_text()
    result = run_cli("up", "--dir", str(stack_dir))
    assert result.returncode == 0, result.stderr
    assert (stack_dir / "stack.json").read_text() == before


def test_down_stops_exactly_what_up_started_and_a_crash_leaves_nothing_blocking(shared_tmp_dir):
    tmp_path = shared_tmp_dir / "crashed"
    result = run_cli("up", "--dir", str(tmp_path), "--no-snowflake")
    assert result.returncode == 0, result.stderr
    state = json.loads((tmp_path / "stack.json").read_text())
    pids = {name: s["pid"] for name, s in state["services"].items()}
    # Simulate a crash: kill every service hard, leaving pid files and stack.json behind.
    for pid in pids.values():
        os.killpg(pid, signal.SIGKILL)
    for pid in pids.values():
        for _ in range(100):
            if not pid_alive(pid):
                break
            time.sleep(0.05)
    status = run_cli("status", "--dir", str(tmp_path))
    assert status.returncode == 3 and "STOPPED" in status.stdout
    again = run_cli("up", "--dir", str(tmp_path), "--no-snowflake")
    assert again.returncode == 0, again.stderr
    env = read_env(tmp_path / "stack.env")
    with psycopg.connect(env["SIPHON_PG_DSN"]) as connection:
        assert connection.execute("select 1").fetchone() == (1,)
    restarted = json.loads((tmp_path / "stack.json").read_text())["services"]
    down = run_cli("down", "--dir", str(tmp_path))
    assert down.returncode == 0 and "postgres" in down.stdout
    for service in restarted.values():
        assert not pid_alive(service["pid"])
    assert not (tmp_path / "stack.json").exists()


def test_missing_postgresql_gives_one_clear_message(tmp_path):
    env = {**os.environ, "SIPHON_PG_BINDIR": str(tmp_path / "nowhere"), "PATH": "/usr/bin:/bin"}
    # Hide every server installation: a bindir that does not exist and no initdb on PATH.
    result = subprocess.run(
        [sys.executable, "-c",
         "import glob, siphon_stack.postgres as p; glob.glob = lambda *a, **k: []; "
         "import sys; from siphon_stack import cli; sys.exit(cli.main(['up', '--dir', sys.argv[1]]))",
         str(tmp_path / "stack")], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert "PostgreSQL server binaries (initdb, postgres) were not found" in result.stderr
    assert "apt-get install postgresql" in result.stderr
