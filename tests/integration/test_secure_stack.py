"""The whole pipeline against `siphon-stack up --secure` (TLS and passwords on PostgreSQL, NATS and
ClickHouse, the NATS users holding only their side's permissions), refusals that must not fall back
to plain text, and a canary: the passwords appear in no log, no Dagster storage and no metrics."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import dagster as dg
import psycopg
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from dagster_graphql.test.utils import define_out_of_process_context, execute_dagster_graphql
from psycopg import sql

from siphon_core import naming
from siphon_core.config import ClickHouseTargetConfig, SnowflakeTargetConfig, load_config
from siphon_core.queue import JetStreamQueue, QueueError, StreamSettings
from siphon_dagster import source
from siphon_dagster.definitions import build_definitions, build_resources
from siphon_dagster.partitions import ranges_for
from siphon_dagster.specs import table_specs
from siphon_dagster.targets.base import TargetError
from siphon_dagster.targets.clickhouse import ClickHouseTarget
from siphon_dagster.targets.snowflake import SnowflakeTarget
from siphon_stack import stack
from siphon_stack.process import free_port
from tests.helpers.instance import instance_for_test
from tests.helpers.producer import ProducerProcess, wait_until
from tests.integration.test_end_to_end import run_stream_jobs, source_rows, target_rows

ROWS = 3000
GRAPHQL_QUERY = """
{
  runsOrError { ... on Runs { results { runId status runConfigYaml tags { key value } } } }
  repositoriesOrError { ... on RepositoryConnection { nodes { name
    allTopLevelResourceDetails { name configuredValues { key value type } } } } }
}
"""


@pytest.fixture(scope="module")
def secure_stack(shared_tmp_dir: Path) -> Iterator[dict[str, str]]:
    """The stack exactly as `siphon-stack up --secure --no-snowflake` starts it; its environment."""
    state = stack.up(shared_tmp_dir / "secure-stack", with_snowflake=False, secure=True)
    try:
        yield dict(state.environment)
    finally:
        stack.down(Path(state.directory))


@pytest.fixture
def secret_environment(secure_stack: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The stack's passwords, and a Snowflake one, as the variables siphon.yaml names."""
    values = {key: secure_stack[key] for key in ("SIPHON_PG_PASSWORD", "SIPHON_NATS_PRODUCER_PASSWORD",
                                                  "SIPHON_NATS_DAGSTER_PASSWORD", "SIPHON_CLICKHOUSE_PASSWORD")}
    values["SIPHON_SNOWFLAKE_PASSWORD"] = secrets.token_urlsafe(18)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


def secure_config(env: dict[str, str], identifier: str, nats_user: str, **clickhouse: str) -> dict:
    """A siphon.yaml for one side: every secret a `${VAR}` reference, TLS settings as keys."""
    ca = env["SIPHON_STACK_CA_FILE"]
    return {
        "application_identifier": identifier,
        "source": {"dsn": f"postgresql://postgres:${{SIPHON_PG_PASSWORD}}@127.0.0.1:{env['SIPHON_PG_PORT']}/siphon",
                   "sslmode": "verify-full", "sslrootcert": ca},
        "queue": {"url": env["SIPHON_NATS_URL"], "tls_ca_file": ca, "user": nats_user,
                  "password": f"${{SIPHON_NATS_{nats_user.upper()}_PASSWORD}}"},
        "producer": {"flush_interval_seconds": 0.3, "metrics_port": free_port(), "status_interval_seconds": 0.5,
                     "connect_retries": 1},
        "tables": [{"name": f"{identifier}.items", "blocks_per_partition": 8, "targets": ["clickhouse"]}],
        "targets": {"clickhouse": {"url": env["SIPHON_CLICKHOUSE_URL"], "ca_file": ca, "database": identifier,
                                   "username": env["SIPHON_CLICKHOUSE_USER"],
                                   "password": "${SIPHON_CLICKHOUSE_PASSWORD}", **clickhouse},
                    # Configured (its resource lands in every job's snapshot), not loaded by this test:
                    # fakesnow has no TLS, and the secure stack does not start it.
                    "snowflake": {"account": "canary", "user": "siphon", "password": "${SIPHON_SNOWFLAKE_PASSWORD}"}},
        "streaming": {"batch_max_wait_seconds": 0.3},
    }


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def forms(secret: str) -> list[bytes]:
    """The ways a secret could be written down: as is, percent-encoded, in base64 (alone or as the
    `user:password` of a basic authentication header)."""
    found = [secret.encode(), quote(secret, safe="").encode(), base64.b64encode(secret.encode())]
    for user in ("postgres", "producer", "dagster", "siphon"):
        found.append(base64.b64encode(f"{user}:{secret}".encode()))
    return found


def leaks(secrets_: dict[str, str], places: dict[str, bytes]) -> list[str]:
    return [f"{variable} found in {where}" for where, data in places.items() for variable, value in secrets_.items()
            if any(form in data for form in forms(value))]


def test_pipeline_through_tls_and_authentication_leaks_no_secret(secure_stack, secret_environment, unique_name,
                                                                   tmp_path, monkeypatch):
    env = secure_stack
    producer_config = secure_config(env, unique_name, "producer")
    dagster_path = write_config(tmp_path / "siphon.yaml", secure_config(env, unique_name, "dagster"))
    config = load_config(dagster_path)
    dsn = config.source.conninfo()
    with psycopg.connect(dsn, autocommit=True) as connection:
        assert connection.execute("select ssl from pg_stat_ssl where pid = pg_backend_pid()").fetchone() == (True,)
        connection.execute(sql.SQL("create schema {}").format(sql.Identifier(unique_name)))
        connection.execute(sql.SQL("create table {} (id bigint primary key, title text, qty integer, price "
                                   "numeric(10, 2), tags text[], at timestamptz)").format(
            sql.Identifier(unique_name, "items")))
        connection.execute(sql.SQL("insert into {} select g, 'item ' || g, mod(g, 97), g / 7.0, array['a', 'b' || g], "
                                   "'2026-01-01'::timestamptz + g * interval '1 minute' from generate_series(1, %s::int) g"
                                   ).format(sql.Identifier(unique_name, "items")), (ROWS,))
    producer = ProducerProcess(tmp_path / "producer", producer_config).start(timeout=60)
    places: dict[str, bytes] = {}
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    try:
        defs = build_definitions(config)
        resources = build_resources(config)
        specs = table_specs(config)
        with instance_for_test(temp_dir=str(dagster_home)) as instance:
            with source.connect(dsn) as connection:
                for spec in specs:
                    size = source.table_size(connection, spec.table)
                    keys = [r.key for r in ranges_for(size.blocks, spec.table.blocks_per_partition)]
                    instance.add_dynamic_partitions(spec.partitions_def_name, keys)
                    for key in keys:
                        asset = defs.resolve_assets_def(spec.target_key("clickhouse"))
                        assert dg.materialize([asset], partition_key=key, instance=instance).success
            # Every change after the snapshots reaches ClickHouse through the stream only.
            items = sql.Identifier(unique_name, "items")
            with psycopg.connect(dsn, autocommit=True) as connection:
                connection.execute(sql.SQL("update {} set qty = qty + 1000 where id % 10 = 0").format(items))
                connection.execute(sql.SQL("delete from {} where id % 33 = 0").format(items))
                connection.execute(sql.SQL("insert into {} select g, 'late ' || g, 1, 1.5, null, now() "
                                           "from generate_series(%s::int, %s::int) g").format(items), (ROWS + 1, ROWS + 200))
                end = naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])

            def caught_up() -> bool:
                with psycopg.connect(dsn) as connection:
                    row = connection.execute(
                        "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s",
                        (naming.slot_name(unique_name),)).fetchone()
                return bool(row and row[0]) and naming.parse_lsn(row[0]) >= end

            wait_until(caught_up, 120, "producer caught up")
            run_stream_jobs(defs, specs, instance, drain=True)

            # A snapshot whose ClickHouse cannot be reached fails, and its failure is stored.
            unreachable = load_config(write_config(tmp_path / "unreachable.yaml", secure_config(
                env, unique_name, "dagster", url=f"https://127.0.0.1:{free_port()}")))
            asset = build_definitions(unreachable).resolve_assets_def(table_specs(unreachable)[0].target_key("clickhouse"))
            failed = dg.materialize([asset], partition_key=keys[0], instance=instance, raise_on_error=False)
            assert not failed.success
            failure = next(event for event in failed.all_events if event.is_step_failure)
            assert "cannot reach https://127.0.0.1" in str(failure.event_specific_data)

            # What the UI would show: the runs and the resources' configured values, by GraphQL.
            monkeypatch.setenv("SIPHON_CONFIG", str(dagster_path))
            location = tmp_path / "location.py"
            location.write_text("from siphon_dagster.definitions import load_definitions\n\ndefs = load_definitions()\n")
            with define_out_of_process_context(str(location), "defs", instance) as context:
                answer = execute_dagster_graphql(context, GRAPHQL_QUERY)
            assert not answer.errors, answer.errors
            places["GraphQL answer"] = json.dumps(answer.data).encode()
            assert len(answer.data["runsOrError"]["results"]) >= 3
            # The resources are listed, built from siphon.yaml: no setting of theirs, reference or value.
            details = answer.data["repositoriesOrError"]["nodes"][0]["allTopLevelResourceDetails"]
            assert {"clickhouse_target", "queue", "source"} <= {detail["name"] for detail in details}
            assert all(detail["configuredValues"] == [] for detail in details), details

        table = source.table_schema(psycopg.connect(dsn), config.tables[0])
        target = resources["clickhouse_target"].open_target()
        try:
            expected, actual = source_rows(dsn, table), target_rows(target, table)
        finally:
            target.close()
        assert len(expected) == ROWS + 200 - ROWS // 33
        assert actual == expected

        with urllib.request.urlopen(f"{producer.metrics_url}/metrics", timeout=5) as response:
            places["producer /metrics"] = response.read()
    finally:
        assert producer.stop() == 0

    # A producer whose NATS password is wrong stops at once, saying so.
    wrong = ProducerProcess(tmp_path / "wrong", {**producer_config, "queue": {
        **producer_config["queue"], "password": "${SIPHON_CLICKHOUSE_PASSWORD}"}}, name="wrong-nats")
    wrong.start(wait_streaming=False)
    assert wrong.wait(60) == 3
    assert "refused the login" in wrong.log()

    for root in (tmp_path, dagster_home, Path(env["SIPHON_STACK_CA_FILE"]).parents[1]):
        for path in root.rglob("*"):
            if path.is_file() and path.name not in ("stack.env", "stack.json", "nats.conf") and \
                    path.suffix not in (".yaml",) and "data" not in path.relative_to(root).parts[:2]:
                places[str(path)] = path.read_bytes()
    assert any("dagster_home" in where for where in places), "no Dagster storage was searched"
    assert any(where.endswith("nats.log") for where in places) and any(where.endswith("postgres.log")
                                                                        for where in places)
    assert any(where.endswith(".db") for where in places), "no Dagster storage file was searched"
    assert not leaks(secret_environment, places)
    # The search finds a secret where one is written on purpose.
    stack_env = Path(env["SIPHON_STACK_CA_FILE"]).parents[1] / "stack.env"
    assert leaks(secret_environment, {"stack.env": stack_env.read_bytes()})


def test_a_tls_url_against_a_plain_nats_server_fails_without_plain_fallback(nats_url: str) -> None:
    queue = JetStreamQueue(nats_url.replace("nats://", "tls://"), StreamSettings("plain.refused"))
    started = time.monotonic()
    with pytest.raises(QueueError, match="offers no TLS"):
        asyncio.run(asyncio.wait_for(queue.connect(connect_timeout=2.0), 20))
    assert time.monotonic() - started < 15  # refused at once, not retried


def test_a_wrong_clickhouse_password_names_the_url_without_the_password(secure_stack: dict[str, str]) -> None:
    url = secure_stack["SIPHON_CLICKHOUSE_URL"]
    wrong = "wrong-" + secrets.token_hex(8)
    target = ClickHouseTarget(ClickHouseTargetConfig(url=url, ca_file=secure_stack["SIPHON_STACK_CA_FILE"],
                                                     username=secure_stack["SIPHON_CLICKHOUSE_USER"], password=wrong))
    with pytest.raises(TargetError) as refused:
        target._connect()
    message = str(refused.value)
    assert url in message and "Authentication failed" in message
    assert wrong not in message
    # With the right password, over https with the stack's CA, it answers.
    right = ClickHouseTarget(ClickHouseTargetConfig(url=url, ca_file=secure_stack["SIPHON_STACK_CA_FILE"],
                                                    username=secure_stack["SIPHON_CLICKHOUSE_USER"],
                                                    password=secure_stack["SIPHON_CLICKHOUSE_PASSWORD"]))
    try:
        assert right._connect().query("select 1").result_rows == [(1,)]
    finally:
        right.close()


def test_the_secure_postgres_refuses_tcp_logins_without_tls(secure_stack: dict[str, str]) -> None:
    port = secure_stack["SIPHON_PG_PORT"]
    with pytest.raises(psycopg.OperationalError, match="no pg_hba.conf entry"):
        psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=siphon sslmode=disable "
                        f"password={secure_stack['SIPHON_PG_PASSWORD']}", connect_timeout=5)
    assert os.stat(Path(secure_stack["SIPHON_STACK_CA_FILE"]).parents[1] / "stack.env").st_mode & 0o077 == 0


def test_snowflake_key_pair_login(snowflake_env: dict[str, str], tmp_path: Path, unique_name: str) -> None:
    """An encrypted PKCS#8 key opens the target (fakesnow accepts the connector's key-pair login)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path = tmp_path / "rsa_key.p8"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.BestAvailableEncryption(b"key passphrase")))
    target = SnowflakeTarget(SnowflakeTargetConfig(
        account=snowflake_env["SIPHON_SNOWFLAKE_ACCOUNT"], user=snowflake_env["SIPHON_SNOWFLAKE_USER"],
        private_key_file=str(path), private_key_passphrase="key passphrase", database=unique_name.upper(),
        host="127.0.0.1", port=int(snowflake_env["SIPHON_SNOWFLAKE_PORT"]), protocol="http"))
    try:
        assert target._connect().cursor().execute("select 1").fetchone() == (1,)
    finally:
        target.close()
