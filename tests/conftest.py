"""Shared fixtures: real services on loopback, each started once per test session on first use and
stopped by the process id we started; per-test isolation by unique names."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg import sql

from siphon_stack.nats import NatsServer
from siphon_stack.postgres import PostgresServer, find_bindir
from siphon_stack.process import free_port, port_accepts, start_process, stop_pid, wait_until
from siphon_stack.snowflake import FakesnowServer
from tests.helpers.application import Application
from tests.helpers.processes import children
from tests.helpers.producer import execute

# These end with the Python process that started them, by design: multiprocessing's resource
# tracker, and the JVM of the local Spark session a process keeps for its life (its gateway exits
# when its standard input closes).
_LEFT_BY_DESIGN = ("multiprocessing.resource_tracker", "org.apache.spark.deploy.SparkSubmit")


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Fails the session's last test when a process the tests started outlives every fixture
    (autouse and session-wide, this is set up first and ended last): such a process outlives the
    suite too, as Dagster's `tail` processes once did."""
    yield
    left = [f"{pid}: {command}" for pid, command in children(os.getpid())
            if not any(marker in command for marker in _LEFT_BY_DESIGN)]
    assert not left, "processes the tests left running:\n" + "\n".join(left)


@pytest.fixture(scope="session")
def shared_tmp_dir() -> Iterator[Path]:
    """A temporary directory that PostgreSQL's unprivileged account can enter (pytest's are private
    to the user who runs the tests, and PostgreSQL never runs as root)."""
    directory = Path(tempfile.mkdtemp(prefix="siphon-tests-"))
    os.chmod(directory, 0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server(shared_tmp_dir: Path) -> Iterator[PostgresServer]:
    server = PostgresServer(shared_tmp_dir / "postgres", free_port(), find_bindir())
    server.initialize()
    pid = server.start()
    server.pid = pid  # type: ignore[attr-defined]  # tests that restart PostgreSQL need it
    try:
        yield server
    finally:
        server.stop(server.pid)  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def postgres_dsn(postgres_server: PostgresServer) -> str:
    return postgres_server.dsn


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats"), free_port(), free_port())
    server.pid = server.start()  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        stop_pid(server.pid)  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def clickhouse_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("clickhouse")
    port = free_port()
    log = root / "clickhouse.log"
    process = start_process(
        "siphon-clickhouse",
        [sys.executable, "-m", "siphon_stack.clickhouse_server", "--data-dir", str(root / "data"), "--port", str(port)],
        log,
    )
    wait_until("embedded ClickHouse", lambda: port_accepts(port), 90.0, pid=process.pid, log_path=log)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_pid(process.pid)


@pytest.fixture(scope="session")
def snowflake_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    server = FakesnowServer(tmp_path_factory.mktemp("fakesnow"), free_port())
    pid = server.start()
    try:
        yield server.environment()
    finally:
        stop_pid(pid)


@pytest.fixture
def app(postgres_dsn: str, nats_url: str, unique_name: str, tmp_path: Path) -> Iterator[Application]:
    """A producer application of this test's own: schema, application identifier, slot and stream."""
    application = Application(postgres_dsn, nats_url, unique_name, unique_name, tmp_path)
    execute(postgres_dsn, sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
    try:
        yield application
    finally:
        for process in application.producers:
            print(f"--- log of {process.config_path.name}\n{process.log()}")  # shown when the test fails
        application.close()


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A short identifier unique to this test, usable as a schema, slot, stream or database name."""
    base = "".join(ch if ch.isalnum() else "_" for ch in request.node.name.lower())[:24].strip("_")
    return f"t_{base}_{uuid.uuid4().hex[:8]}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(Path(str(item.fspath))):
            item.add_marker(pytest.mark.integration)


def pytest_sessionfinish() -> None:
    # Importing fakesnow (as the tests of its server's patches do) makes a stage directory under
    # the system's temporary directory that fakesnow never removes.
    stage = sys.modules.get("fakesnow.transforms.stage")
    if stage is not None:
        shutil.rmtree(stage.LOCAL_BUCKET_PATH, ignore_errors=True)
