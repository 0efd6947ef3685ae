"""The production instance's storage (deploy/dagster.production.yaml, as the Helm values render it)
against a real PostgreSQL: a run is created, its events are stored (each NOTIFYs the run's
listeners) and read back, with the libraries the project pins."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import psycopg
import pytest
import yaml
from dagster._core.events import DagsterEventType
from dagster_postgres.utils import pg_url_from_config

from siphon_stack.postgres import PostgresServer
from tests.helpers.instance import instance_for_test

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@dg.op
def _noop() -> None:
    pass


@dg.job
def _probe() -> None:
    _noop()


@pytest.fixture
def instance_database(postgres_server: PostgresServer, unique_name: str) -> str:
    with psycopg.connect(postgres_server.dsn, autocommit=True) as connection:
        connection.execute(f'create database "{unique_name}"')
    return unique_name


def production_storage(server: PostgresServer, database: str) -> dict:
    """The production file's storage section, pointed at the test's PostgreSQL (its address, user
    and database in place of the environment's; no TLS on loopback), every other key as shipped."""
    storage = yaml.safe_load((DEPLOY / "dagster.production.yaml").read_text())["storage"]
    db = storage["postgres"]["postgres_db"]
    db.update(hostname="127.0.0.1", port=server.port, username="postgres", password="", db_name=database)
    db.pop("params", None)
    return storage


def test_the_production_storage_stores_and_reads_a_runs_events(postgres_server: PostgresServer,
                                                              instance_database: str) -> None:
    storage = production_storage(postgres_server, instance_database)
    assert pg_url_from_config(storage["postgres"]).startswith("postgresql+psycopg2://")
    with instance_for_test(overrides={"storage": storage}) as instance:
        run = instance.create_run_for_job(_probe)
        instance.report_engine_event("the storage holds this run's events", run)
        instance.report_run_canceled(run)
        logs = instance.all_logs(run.run_id)
        assert [e.message for e in logs if e.message == "the storage holds this run's events"]
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.CANCELED
        assert any(e.dagster_event_type == DagsterEventType.RUN_CANCELED for e in logs)
