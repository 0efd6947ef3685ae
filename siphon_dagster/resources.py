"""Dagster resources: the source PostgreSQL, the queue, the targets and Spark.

Heavy clients are opened on use, never at import, so loading the code location stays cheap.
Every target resource offers `open_target()`, the only way assets reach a target.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
import psycopg

from siphon_core.config import ClickHouseTargetConfig, SnowflakeTargetConfig
from siphon_core.queue import JetStreamQueue, StreamSettings
from siphon_dagster import source
from siphon_dagster.targets.base import Target


class PostgresResource(dg.ConfigurableResource):
    """The source database; `snapshot_dsn` (a standby on PostgreSQL 16+) is where block ranges are read."""

    dsn: str
    snapshot_dsn: str | None = None
    snapshot_spool_directory: str | None = None
    snapshot_spool_max_bytes: int = 2 << 30

    @property
    def snapshot_source_dsn(self) -> str:
        return self.snapshot_dsn or self.dsn

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return source.connect(self.dsn, autocommit=True, **kwargs)


class NatsResource(dg.ConfigurableResource):
    url: str
    application_identifier: str
    duplicate_window_seconds: int = 600
    replicas: int = 1
    max_message_bytes: int = 1_048_576

    def queue(self, client_name: str = "siphon-dagster") -> JetStreamQueue:
        settings = StreamSettings(self.application_identifier, self.duplicate_window_seconds, self.replicas,
                                  self.max_message_bytes)
        return JetStreamQueue(self.url, settings, name=client_name)


class ClickHouseResource(dg.ConfigurableResource):
    """ClickHouse over HTTP: the embedded local server or a real ClickHouse, by URL."""

    url: str
    database: str = "siphon"
    username: str = "default"
    password: str = ""

    def open_target(self) -> Target:
        from siphon_dagster.targets.clickhouse import ClickHouseTarget

        return ClickHouseTarget(ClickHouseTargetConfig(url=self.url, database=self.database,
                                                       username=self.username, password=self.password))


class SnowflakeResource(dg.ConfigurableResource):
    account: str
    user: str
    password: str = ""
    database: str = "SIPHON"
    schema_name: str = "PUBLIC"
    warehouse: str | None = None
    role: str | None = None
    host: str | None = None
    port: int | None = None
    protocol: str | None = None

    def open_target(self) -> Target:
        from siphon_dagster.targets.snowflake import SnowflakeTarget

        return SnowflakeTarget(SnowflakeTargetConfig(
            account=self.account, user=self.user, password=self.password, database=self.database,
            schema=self.schema_name, warehouse=self.warehouse, role=self.role, host=self.host, port=self.port,
            protocol=self.protocol))


class SparkResource(dg.ConfigurableResource):
    """Local Spark by default; `remote` (sc://host:port) uses a Spark Connect server instead."""

    master: str = "local[2]"
    remote: str | None = None
    conf: dict[str, str] = {}
    max_python_workers: int | None = None

    def session(self) -> Any:
        """One Spark session per run process, reused across micro-batches (and tables)."""
        from siphon_core.config import SparkConfig
        from siphon_dagster.streaming.spark_session import get_spark_session

        return get_spark_session(SparkConfig(master=self.master, remote=self.remote, conf=self.conf,
                                             max_python_workers=self.max_python_workers))
