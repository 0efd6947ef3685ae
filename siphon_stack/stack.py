"""The local stack as one unit: start every service, record what we started, stop exactly that.

State lives in DIR: `stack.json` (ports and process ids) and `stack.env` (shell `export`
lines for clients). A crashed run leaves a `stack.json` whose processes are gone; the next
`up` notices and starts afresh on the same data.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote

from siphon_stack.certificates import StackCertificates, ensure_certificates
from siphon_stack.clickhouse import PASSWORD_VARIABLE as CLICKHOUSE_PASSWORD_VARIABLE
from siphon_stack.nats import PERMISSIONS as NATS_PERMISSIONS
from siphon_stack.nats import NatsServer
from siphon_stack.postgres import PostgresServer, find_bindir
from siphon_stack.process import (
    StackError,
    free_port,
    pid_alive,
    port_accepts,
    start_process,
    stop_pid,
    wait_until,
)
from siphon_stack.snowflake import FakesnowServer
from siphon_stack.spark import SparkConnectServer, require_java

SERVICES = ("postgres", "nats", "clickhouse", "snowflake", "spark_connect")
CLICKHOUSE_USER = "siphon"


@dataclass
class ServiceState:
    pid: int
    port: int
    extra: dict[str, int | str] = field(default_factory=dict)


@dataclass
class StackState:
    directory: str
    services: dict[str, ServiceState] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def state_file(self) -> Path:
        return Path(self.directory) / "stack.json"

    def save(self) -> None:
        payload = {"directory": self.directory, "environment": self.environment,
                   "services": {name: asdict(state) for name, state in self.services.items()}}
        lines = [f"export {key}={shlex.quote(value)}" for key, value in sorted(self.environment.items())]
        # Both may hold the secure stack's passwords: readable by their owner only.
        for path, text in ((self.state_file, json.dumps(payload, indent=2)),
                           (Path(self.directory) / "stack.env", "\n".join(lines) + "\n")):
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(text)
            os.chmod(path, 0o600)

    @classmethod
    def load(cls, directory: Path) -> StackState | None:
        path = directory / "stack.json"
        if not path.exists():
            return None
        payload = json.loads(path.read_text())
        services = {name: ServiceState(**state) for name, state in payload.get("services", {}).items()}
        return cls(payload["directory"], services, payload.get("environment", {}))

    def alive(self) -> dict[str, bool]:
        return {name: pid_alive(state.pid) for name, state in self.services.items()}


def _start_clickhouse(root: Path, port: int, tls: StackCertificates | None = None, password: str | None = None) -> int:
    log = root / "clickhouse.log"
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "siphon_stack.clickhouse_server", "--data-dir", str(data), "--port", str(port)]
    env = None
    if tls is not None:
        argv += ["--tls-cert", str(tls.cert_file), "--tls-key", str(tls.key_file), "--user", CLICKHOUSE_USER]
        env = {CLICKHOUSE_PASSWORD_VARIABLE: password or ""}
    process = start_process("siphon-clickhouse", argv, log, env=env)
    wait_until("embedded ClickHouse", lambda: port_accepts(port), 90.0, pid=process.pid, log_path=log)
    return process.pid


def _password(environment: dict[str, str], variable: str) -> str:
    """The running stack's password, or a new one (24 characters, safe in a URL and a shell)."""
    return environment.get(variable) or secrets.token_urlsafe(18)


def up(directory: Path, with_snowflake: bool = True, with_spark_connect: bool = False,
       secure: bool = False) -> StackState:
    """Starts every service that is not already running from this directory. `secure`: TLS (a CA made
    here, in DIR/tls) and a password on PostgreSQL, NATS and ClickHouse; see `secure_environment`."""
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    previous = StackState.load(directory)
    state = StackState(str(directory))
    if previous:
        for name, service in previous.services.items():
            if pid_alive(service.pid):
                state.services[name] = service
        state.environment = dict(previous.environment) if state.services else {}
    if state.services and secure != (state.environment.get("SIPHON_STACK_SECURE") == "1"):
        raise StackError(f"the stack in {directory} runs {'without' if secure else 'with'} --secure; "
                         "stop it with `siphon-stack down` first")
    tls = ensure_certificates(directory / "tls") if secure else None
    passwords = {variable: _password(state.environment, variable) for variable in
                 ("SIPHON_PG_PASSWORD", "SIPHON_NATS_PRODUCER_PASSWORD", "SIPHON_NATS_DAGSTER_PASSWORD",
                  "SIPHON_CLICKHOUSE_PASSWORD")} if secure else {}
    bindir = find_bindir()
    if with_spark_connect:
        require_java()
    started: list[tuple[str, int]] = []
    try:
        if "postgres" not in state.services:
            pg = PostgresServer(directory / "postgres", free_port(), bindir, tls=tls,
                                password=passwords.get("SIPHON_PG_PASSWORD"))
            pg.initialize()
            pid = pg.start()
            started.append(("postgres", pid))
            state.services["postgres"] = ServiceState(pid, pg.port, {"bindir": str(bindir)})
        pg_port = state.services["postgres"].port
        state.environment.update({
            "SIPHON_PG_DSN": f"postgresql://postgres@127.0.0.1:{pg_port}/siphon",
            "SIPHON_PG_PORT": str(pg_port),
            "SIPHON_PG_BINDIR": str(bindir),
            "PGHOST": "127.0.0.1",
            "PGPORT": str(pg_port),
            "PGUSER": "postgres",
            "PGDATABASE": "siphon",
        })

        if "nats" not in state.services:
            users = {name: passwords[f"SIPHON_NATS_{name.upper()}_PASSWORD"] for name in NATS_PERMISSIONS} if secure else {}
            nats = NatsServer(directory / "nats", free_port(), free_port(), tls=tls, users=users)
            pid = nats.start()
            started.append(("nats", pid))
            state.services["nats"] = ServiceState(pid, nats.port, {"monitor_port": nats.monitor_port})
        state.environment["SIPHON_NATS_URL"] = f"nats://127.0.0.1:{state.services['nats'].port}"

        if "clickhouse" not in state.services:
            port = free_port()
            pid = _start_clickhouse(directory / "clickhouse", port, tls, passwords.get("SIPHON_CLICKHOUSE_PASSWORD"))
            started.append(("clickhouse", pid))
            state.services["clickhouse"] = ServiceState(pid, port)
        state.environment["SIPHON_CLICKHOUSE_URL"] = f"http://127.0.0.1:{state.services['clickhouse'].port}"

        if with_snowflake:
            if "snowflake" not in state.services:
                snow = FakesnowServer(directory / "fakesnow", free_port())
                pid = snow.start()
                started.append(("snowflake", pid))
                state.services["snowflake"] = ServiceState(pid, snow.port)
            state.environment.update(FakesnowServer(directory / "fakesnow", state.services["snowflake"].port).environment())

        if with_spark_connect:
            if "spark_connect" not in state.services:
                spark = SparkConnectServer(directory / "spark", free_port())
                pid = spark.start()
                started.append(("spark_connect", pid))
                state.services["spark_connect"] = ServiceState(pid, spark.port)
            state.environment["SIPHON_SPARK_REMOTE"] = f"sc://127.0.0.1:{state.services['spark_connect'].port}"
        if tls is not None:
            state.environment.update(secure_environment(state, tls, passwords))
    except BaseException:
        # Nothing half-started stays running.
        for _, pid in reversed(started):
            stop_pid(pid)
        raise
    state.save()
    return state


def secure_environment(state: StackState, tls: StackCertificates, passwords: dict[str, str]) -> dict[str, str]:
    """What clients of a `--secure` stack need (written to stack.env): the CA, the TLS addresses and
    the passwords. fakesnow (the Snowflake stand-in) speaks plain HTTP only and keeps its settings."""
    ca = str(tls.ca_file)
    pg_port = state.services["postgres"].port
    return {
        "SIPHON_STACK_SECURE": "1",
        "SIPHON_STACK_CA_FILE": ca,
        "SIPHON_PG_DSN": (f"postgresql://postgres@127.0.0.1:{pg_port}/siphon?sslmode=verify-full"
                          f"&sslrootcert={quote(ca, safe='/')}"),
        "PGSSLMODE": "verify-full",
        "PGSSLROOTCERT": ca,
        "PGPASSWORD": passwords["SIPHON_PG_PASSWORD"],
        "SIPHON_NATS_URL": f"tls://127.0.0.1:{state.services['nats'].port}",
        "SIPHON_NATS_PRODUCER_USER": "producer",
        "SIPHON_NATS_DAGSTER_USER": "dagster",
        "SIPHON_CLICKHOUSE_URL": f"https://127.0.0.1:{state.services['clickhouse'].port}",
        "SIPHON_CLICKHOUSE_USER": CLICKHOUSE_USER,
        **passwords,
    }


def down(directory: Path) -> list[str]:
    state = StackState.load(directory.resolve())
    if state is None:
        return []
    stopped = []
    for name in reversed(SERVICES):
        service = state.services.get(name)
        if service is None:
            continue
        if name == "postgres":
            PostgresServer(Path(state.directory) / "postgres", service.port, Path(".")).stop(service.pid)
        else:
            stop_pid(service.pid)
        stopped.append(name)
    state.state_file.unlink(missing_ok=True)
    return stopped


def status(directory: Path) -> StackState:
    state = StackState.load(directory.resolve())
    if state is None:
        raise StackError(f"no stack in {directory}; start one with `siphon-stack up --dir {directory}`")
    return state
