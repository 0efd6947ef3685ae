"""Every command answers an unknown table, an unreachable service and a refused login with one line
that names the table or the service, never a traceback, never a secret: `siphon-dagster`'s
subcommands and `siphon-producer run`, as subprocesses against `siphon-stack up --secure` (TLS and
passwords on PostgreSQL, NATS and ClickHouse), and `siphon-stack` itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from siphon_stack import stack
from siphon_stack.process import free_port
from tests.helpers.instance import write_instance_yaml
from tests.helpers.producer import drop_application

REPOSITORY = Path(__file__).resolve().parents[2]
CONCURRENT_COMMANDS = 4
PASSWORDS = ("SIPHON_PG_PASSWORD", "SIPHON_NATS_PRODUCER_PASSWORD", "SIPHON_NATS_DAGSTER_PASSWORD",
             "SIPHON_CLICKHOUSE_PASSWORD")
WRONG = "wrong-password-7f3a"


@pytest.fixture(scope="module")
def secured(shared_tmp_dir: Path) -> Iterator[dict[str, str]]:
    """`siphon-stack up --secure --no-snowflake`, with one table `cli_failures.items` in its source."""
    state = stack.up(shared_tmp_dir / "cli-failures-stack", with_snowflake=False, secure=True)
    env = dict(state.environment)
    try:
        with psycopg.connect(admin_dsn(env), autocommit=True) as connection:
            connection.execute("create schema cli_failures")
            connection.execute("create table cli_failures.items (id bigint primary key, title text)")
            connection.execute("insert into cli_failures.items select g, 'item' from generate_series(1, 100) g")
        yield env
    finally:
        stack.down(Path(state.directory))


def admin_dsn(env: dict[str, str]) -> str:
    return (f"host=127.0.0.1 port={env['SIPHON_PG_PORT']} dbname=siphon user=postgres "
            f"password={env['SIPHON_PG_PASSWORD']} sslmode=require")


def base_config(env: dict[str, str], identifier: str, nats_user: str = "dagster") -> dict[str, Any]:
    ca = env["SIPHON_STACK_CA_FILE"]
    return {
        "application_identifier": identifier,
        "source": {"dsn": f"postgresql://postgres:${{SIPHON_PG_PASSWORD}}@127.0.0.1:{env['SIPHON_PG_PORT']}/siphon",
                   "sslmode": "verify-full", "sslrootcert": ca},
        "queue": {"url": env["SIPHON_NATS_URL"], "tls_ca_file": ca, "user": nats_user,
                  "password": f"${{SIPHON_NATS_{nats_user.upper()}_PASSWORD}}"},
        "producer": {"metrics_port": free_port(), "connect_retries": 1},
        "tables": [{"name": "cli_failures.items", "targets": ["clickhouse"]}],
        "targets": {"clickhouse": {"url": env["SIPHON_CLICKHOUSE_URL"], "ca_file": ca, "database": identifier,
                                   "username": env["SIPHON_CLICKHOUSE_USER"],
                                   "password": "${SIPHON_CLICKHOUSE_PASSWORD}"}},
    }


# Each fault changes siphon.yaml or the passwords in the environment, and returns what the answer
# must name.
Fault = Callable[[dict, dict, Path], str]


def unreachable_postgres(config: dict, env: dict, directory: Path) -> str:
    port = free_port()
    config["source"]["dsn"] = re.sub(r":\d+/", f":{port}/", config["source"]["dsn"])
    return f"port {port}"


def unreachable_nats(config: dict, env: dict, directory: Path) -> str:
    config["queue"]["url"] = f"tls://127.0.0.1:{free_port()}"
    return f"NATS at {config['queue']['url']}"


def unreachable_clickhouse(config: dict, env: dict, directory: Path) -> str:
    config["targets"]["clickhouse"]["url"] = f"https://127.0.0.1:{free_port()}"
    return f"cannot reach {config['targets']['clickhouse']['url']}"


def wrong_postgres_password(config: dict, env: dict, directory: Path) -> str:
    env["SIPHON_PG_PASSWORD"] = WRONG
    return "password authentication failed"


def wrong_nats_password(config: dict, env: dict, directory: Path) -> str:
    env[f"SIPHON_NATS_{config['queue']['user'].upper()}_PASSWORD"] = WRONG
    return f"NATS at {config['queue']['url']} refused the login"


def wrong_clickhouse_password(config: dict, env: dict, directory: Path) -> str:
    env["SIPHON_CLICKHOUSE_PASSWORD"] = WRONG
    return config["targets"]["clickhouse"]["url"]


def unknown_table(config: dict, env: dict, directory: Path) -> str:
    """A table siphon.yaml does not have (the command names it)."""
    return "cli_failures.nowhere"


def table_missing_at_the_source(config: dict, env: dict, directory: Path) -> str:
    """A table siphon.yaml has and the source does not."""
    config["tables"][0]["name"] = "cli_failures.nowhere"
    return "cli_failures.nowhere"


def malformed_seed_file(config: dict, env: dict, directory: Path) -> str:
    """An nkey seed file holding no seed (a public key pasted instead): refused with the settings."""
    path = directory / "user.nk"
    path.write_text("UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4\n")
    config["queue"] = {"url": config["queue"]["url"], "tls_ca_file": config["queue"]["tls_ca_file"],
                       "nkey_seed_file": str(path)}
    return f"queue.nkey_seed_file: Value error, file '{path}' holds no valid user nkey seed"


DAGSTER = [sys.executable, "-m", "siphon_dagster.cli"]
PRODUCER = [sys.executable, "-m", "producer_service.cli", "run"]
ITEMS = ["--table", "cli_failures.items"]
CASES: list[tuple[str, list[str], Fault]] = [
    *[(f"dagster-{command.replace(' ', '-')}-unknown-table",
       [*DAGSTER, *command.split(), "--table", "cli_failures.nowhere", *extra], unknown_table)
      for command, extra in (("partitions refresh", []), ("partitions list", []),
                             ("target drop", ["--target", "clickhouse"]), ("check", []),
                             ("snapshot", []), ("resync", []), ("repair", ["--keys-file", "KEYS"]))],
    ("dagster-partitions-table-missing-at-the-source", [*DAGSTER, "partitions", "refresh"],
     table_missing_at_the_source),
    ("dagster-snapshot-table-missing-at-the-source", [*DAGSTER, "snapshot", "--table", "cli_failures.nowhere"],
     table_missing_at_the_source),
    ("dagster-partitions-unreachable-postgres", [*DAGSTER, "partitions", "refresh"], unreachable_postgres),
    ("dagster-partitions-wrong-postgres-password", [*DAGSTER, "partitions", "refresh"], wrong_postgres_password),
    ("dagster-snapshot-unreachable-postgres", [*DAGSTER, "snapshot", *ITEMS], unreachable_postgres),
    ("dagster-snapshot-unreachable-clickhouse", [*DAGSTER, "snapshot", *ITEMS], unreachable_clickhouse),
    ("dagster-snapshot-wrong-clickhouse-password", [*DAGSTER, "snapshot", *ITEMS], wrong_clickhouse_password),
    ("dagster-target-drop-unreachable-clickhouse", [*DAGSTER, "target", "drop", "--target", "clickhouse", *ITEMS],
     unreachable_clickhouse),
    ("dagster-target-drop-wrong-clickhouse-password",
     [*DAGSTER, "target", "drop", "--target", "clickhouse", *ITEMS], wrong_clickhouse_password),
    ("dagster-resync-unreachable-clickhouse", [*DAGSTER, "resync", *ITEMS], unreachable_clickhouse),
    ("dagster-repair-unreachable-postgres", [*DAGSTER, "repair", *ITEMS, "--keys-file", "KEYS"],
     unreachable_postgres),
    ("dagster-repair-wrong-postgres-password", [*DAGSTER, "repair", *ITEMS, "--keys-file", "KEYS"],
     wrong_postgres_password),
    # `check` answers with one line per check: the checks that need the service name it.
    ("dagster-check-unreachable-nats", [*DAGSTER, "check"], unreachable_nats),
    ("dagster-check-wrong-nats-password", [*DAGSTER, "check"], wrong_nats_password),
    ("dagster-check-unreachable-postgres", [*DAGSTER, "check"], unreachable_postgres),
    ("dagster-check-unreachable-clickhouse", [*DAGSTER, "check"], unreachable_clickhouse),
    ("dagster-check-wrong-clickhouse-password", [*DAGSTER, "check"], wrong_clickhouse_password),
    ("dagster-check-malformed-seed-file", [*DAGSTER, "check"], malformed_seed_file),
    ("producer-malformed-seed-file", PRODUCER, malformed_seed_file),
    ("producer-unknown-table", PRODUCER, table_missing_at_the_source),
    ("producer-unreachable-postgres", PRODUCER, unreachable_postgres),
    ("producer-wrong-postgres-password", PRODUCER, wrong_postgres_password),
    ("producer-unreachable-nats", PRODUCER, unreachable_nats),
    ("producer-wrong-nats-password", PRODUCER, wrong_nats_password),
]


@dataclass
class Answer:
    named: str  # what the answer must name
    result: subprocess.CompletedProcess[str]


def run_case(secured: dict[str, str], index: int, argv: list[str], fault: Fault, directory: Path) -> Answer:
    """One command, in a directory of its own, with its fault applied."""
    directory.mkdir(parents=True)
    producer = argv[:len(PRODUCER)] == PRODUCER
    identifier = f"t_cli_failure_{index}_{uuid.uuid4().hex[:8]}"
    config = base_config(secured, identifier, "producer" if producer else "dagster")
    # Give up soon on an unreachable service (the defaults wait minutes for one that may come back).
    config["producer"].update(connect_retries=0, publish_retry_seconds=5)
    config["checks"] = {"settle_timeout_seconds": 3}
    env = {key: secured[key] for key in PASSWORDS}
    named = fault(config, env, directory)
    if producer:  # the producer's siphon.yaml has no targets
        config.pop("targets")
        config["tables"] = [{"name": table["name"]} for table in config["tables"]]
    path = directory / "siphon.yaml"
    path.write_text(yaml.safe_dump(config))
    keys = directory / "keys.csv"
    keys.write_text("1\n")
    home = directory / "dagster_home"
    home.mkdir()
    write_instance_yaml(home)
    command = [str(keys) if word == "KEYS" else word for word in argv]
    at = len(PRODUCER) if producer else len(DAGSTER)
    command[at:at] = ["--config", str(path)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPOSITORY,
                                env={**os.environ, **env, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPOSITORY)})
    finally:
        if producer:
            drop_application(admin_dsn(secured), None, identifier)
    return Answer(named, result)


@pytest.fixture(scope="module")
def answers(secured: dict[str, str], shared_tmp_dir: Path) -> dict[str, Answer]:
    """Every case's answer. The commands run a few at a time: most of each one's time is an
    interpreter starting and a connection that waits to fail."""
    root = shared_tmp_dir / "cli-failures"
    with ThreadPoolExecutor(CONCURRENT_COMMANDS) as pool:
        futures = {name: pool.submit(run_case, secured, index, argv, fault, root / name)
                   for index, (name, argv, fault) in enumerate(CASES)}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize(("name", "argv", "fault"), CASES, ids=[name for name, _argv, _fault in CASES])
def test_a_command_answers_a_fault_with_one_line_naming_it(secured: dict[str, str], answers: dict[str, Answer],
                                                           name: str, argv: list[str], fault: Fault) -> None:
    answer = answers[name]
    result, named = answer.result, answer.named
    producer = argv[:len(PRODUCER)] == PRODUCER
    output = result.stdout + result.stderr
    print(output)  # shown when the test fails
    assert result.returncode != 0
    assert "Traceback" not in output
    for key in PASSWORDS:
        assert secured[key] not in output, key
    assert WRONG not in output
    if producer:
        # Its log lines are structured; one error says why it stopped.
        lines = [line for line in output.splitlines() if "level=error" in line or line.startswith("siphon-producer:")]
    elif argv[len(DAGSTER)] == "check" and fault not in (unknown_table, malformed_seed_file):
        lines = [line for line in output.splitlines() if line.strip()]
        assert all(line.split()[0] in ("PASS", "FAIL", "WARN") for line in lines), lines
        lines = [line for line in lines if named in line][:1]
    else:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert named in lines[0]


def test_siphon_stack_answers_a_directory_without_a_stack_in_one_line(tmp_path: Path) -> None:
    def run(action: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "siphon_stack.cli", action, "--dir", str(tmp_path / "none")],
                              capture_output=True, text=True, timeout=60, cwd=REPOSITORY)

    status, down = run("status"), run("down")
    assert status.returncode == 2 and not status.stdout
    assert status.stderr.count("\n") == 1 and str(tmp_path / "none") in status.stderr
    assert (down.returncode, down.stdout, down.stderr) == (0, "stopped: nothing was running\n", "")

