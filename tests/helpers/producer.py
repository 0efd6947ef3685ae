"""A `siphon-producer` subprocess per test, and the source-side plumbing around it: a config per
test (its own application identifier, hence slot, publication and stream), and the clean-up of
those names afterwards. Processes are stopped only by the pid we started."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import psycopg
import yaml
from nats.js.errors import NotFoundError
from psycopg import sql

from siphon_core import naming
from siphon_stack.process import free_port, pid_alive

REPOSITORY = Path(__file__).resolve().parents[2]


def producer_config(application_identifier: str, dsn: str, nats_url: str, tables: list[str | dict[str, Any]],
                    **producer: Any) -> dict[str, Any]:
    settings = {"flush_interval_seconds": 0.3, "status_interval_seconds": 0.5, "heartbeat_interval_seconds": 5,
                "metrics_port": free_port(), "connect_retries": 3, **producer}
    return {
        "application_identifier": application_identifier,
        "source": {"dsn": dsn},
        "queue": {"url": nats_url},
        "producer": settings,
        "tables": [{"name": t} if isinstance(t, str) else t for t in tables],
    }


class ProducerProcess:
    """`python -m producer_service.cli run --config <file>` with its log in the test's directory."""

    def __init__(self, directory: Path, config: dict[str, Any], name: str = "producer") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.config_path = directory / f"{name}.yaml"
        self.log_path = directory / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.write_config()

    def write_config(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config))

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.config['producer']['metrics_port']}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, wait_streaming: bool = True, timeout: float = 30.0, extra_args: tuple[str, ...] = ()
              ) -> ProducerProcess:
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "producer_service.cli", "run", "--config", str(self.config_path), *extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPOSITORY,
                env={**os.environ, "PYTHONPATH": str(REPOSITORY)}, start_new_session=True)
        if wait_streaming:
            self.wait_streaming(timeout)
        return self

    def health(self) -> tuple[int, dict[str, Any]] | None:
        return producer_health(self.config["producer"]["metrics_port"])

    def wait_streaming(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = self.health()
            if health is not None and health[0] == 200:
                return
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"the producer exited with {self.process.returncode}:\n{self.log()}")
            time.sleep(0.1)
        raise AssertionError(f"the producer was not streaming after {timeout:.0f}s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by its name with labels."""
        with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and the exit code."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        """kill -9, and reap it."""
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(30)

    def ensure_stopped(self) -> None:
        if self.process is not None and pid_alive(self.process.pid):
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def producer_health(metrics_port: int) -> tuple[int, dict[str, Any]] | None:
    """The status and body of a producer's /healthz, or None while nothing answers on the port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=1) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
    except OSError:
        return None


def producer_streaming(metrics_port: int) -> bool:
    """Whether the producer serving metrics on the port says it is streaming (/healthz is 200)."""
    health = producer_health(metrics_port)
    return health is not None and health[0] == 200


def execute(dsn: str, query: str | sql.Composable, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        cursor = connection.execute(query, params)
        return cursor.fetchall() if cursor.description else []


def current_lsn(dsn: str) -> int:
    return naming.parse_lsn(execute(dsn, "select pg_current_wal_lsn()::text")[0][0])


def slot_confirmed_lsn(dsn: str, slot: str) -> int:
    rows = execute(dsn, "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,))
    return naming.parse_lsn(rows[0][0]) if rows and rows[0][0] else 0


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f}s")
        time.sleep(interval)


def drop_application(dsn: str, nats_url: str | None, application_identifier: str) -> None:
    """Drops the slot (waiting for its walsender to go), the publication and the stream (unless
    `nats_url` is None: a server of the test's own goes with its streams)."""
    slot = naming.slot_name(application_identifier)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = execute(dsn, "select active_pid from pg_replication_slots where slot_name = %s", (slot,))
        if not rows:
            break
        if rows[0][0] is None:
            execute(dsn, "select pg_drop_replication_slot(%s)", (slot,))
            break
        time.sleep(0.2)
    execute(dsn, sql.SQL("drop publication if exists {}").format(
        sql.Identifier(naming.publication_name(application_identifier))))
    if nats_url is None:
        return

    async def delete_stream() -> None:
        connection = await nats.connect(str(nats_url), connect_timeout=5, max_reconnect_attempts=2)
        try:
            try:
                await connection.jetstream().delete_stream(naming.stream_name(application_identifier))
            except NotFoundError:
                pass
        finally:
            await connection.close()

    asyncio.run(delete_stream())
