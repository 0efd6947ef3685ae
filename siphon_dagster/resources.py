"""Dagster resources: the source PostgreSQL, the queue, the targets and Spark.

Each resource holds one section of siphon.yaml as settings (`SiphonConfig.settings`) and builds the
section's pydantic model from them where it is used: every setting and default is declared once,
in siphon_core.config, and a value written as `${VAR}` travels as that reference, so Dagster's run
storage, event log and UI hold the variable's name, never the secret. Heavy clients are opened on
use, never at import, so loading the code location stays cheap. Every target resource offers
`open_target()`, the only way assets reach a target.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
import psycopg

from siphon_core.config import (
    ClickHouseTargetConfig,
    QueueConfig,
    SnowflakeTargetConfig,
    SourceConfig,
    SparkConfig,
    expand_settings,
)
from siphon_core.queue import JetStreamQueue
from siphon_dagster import source
from siphon_dagster.snapshot.load import SnapshotSettings
from siphon_dagster.targets.base import Target


class PostgresResource(dg.ConfigurableResource):
    """The source database (`source:`); `snapshot_dsn` (a standby on PostgreSQL 16+) is where block
    ranges are read."""

    settings: dict[str, Any]
    # The producer's publication: a range is read only once its table is in it (see
    # snapshot.load.check_published). Empty: not checked.
    publication: str = ""

    @property
    def config(self) -> SourceConfig:
        return SourceConfig.model_validate(expand_settings(self.settings, "source"))

    @property
    def dsn(self) -> str:
        """The connection string with the section's TLS settings applied (`SourceConfig.conninfo`)."""
        return self.config.conninfo()

    @property
    def snapshot_source_dsn(self) -> str:
        return self.config.conninfo(snapshot=True)

    @property
    def snapshot_spool_directory(self) -> str | None:
        return self.config.snapshot_spool_directory

    @property
    def snapshot_spool_max_bytes(self) -> int:
        return self.config.snapshot_spool_max_bytes

    @property
    def snapshot_wait_limit_seconds(self) -> float:
        return self.config.snapshot_wait_limit_seconds

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return source.connect(self.dsn, autocommit=True, **kwargs)

    def snapshot_settings(self) -> SnapshotSettings:
        return SnapshotSettings(dsn=self.snapshot_source_dsn, spool_directory=self.snapshot_spool_directory,
                                spool_max_bytes=self.snapshot_spool_max_bytes,
                                wait_limit_seconds=self.snapshot_wait_limit_seconds,
                                retry_seconds=self.config.snapshot_retry_seconds,
                                publication=self.publication or None)


class NatsResource(dg.ConfigurableResource):
    """The application's JetStream stream (`queue:`)."""

    settings: dict[str, Any]
    application_identifier: str

    @property
    def config(self) -> QueueConfig:
        return QueueConfig.model_validate(expand_settings(self.settings, "queue"))

    def queue(self, client_name: str = "siphon-dagster") -> JetStreamQueue:
        return JetStreamQueue.from_config(self.config, self.application_identifier, name=client_name)


class ClickHouseResource(dg.ConfigurableResource):
    """ClickHouse over HTTP (`targets.clickhouse:`): the embedded local server or a real ClickHouse."""

    settings: dict[str, Any]

    def open_target(self) -> Target:
        from siphon_dagster.targets.clickhouse import ClickHouseTarget

        return ClickHouseTarget(ClickHouseTargetConfig.model_validate(
            expand_settings(self.settings, "targets.clickhouse")))


class SnowflakeResource(dg.ConfigurableResource):
    """Snowflake (`targets.snowflake:`)."""

    settings: dict[str, Any]

    def open_target(self) -> Target:
        from siphon_dagster.targets.snowflake import SnowflakeTarget

        return SnowflakeTarget(SnowflakeTargetConfig.model_validate(
            expand_settings(self.settings, "targets.snowflake")))


class SparkResource(dg.ConfigurableResource):
    """Local Spark by default; `remote` (sc://host:port) uses a Spark Connect server instead (`spark:`).

    The session is built on first use by a dagster-pyspark `LazyPySparkResource` given the
    section's Spark properties (siphon_dagster.streaming.spark_session), and shared by every table
    of the run. Composed rather than inherited: a subclass would import pyspark with the code
    location, which every run and sensor process loads, most of them never touching Spark.
    """

    settings: dict[str, Any]

    def session(self) -> Any:
        """One Spark session per run process, reused across micro-batches."""
        from siphon_dagster.streaming.spark_session import get_spark_session

        return get_spark_session(SparkConfig.model_validate(expand_settings(self.settings, "spark")))

    @property
    def remote(self) -> bool:
        """Whether Spark is a Spark Connect server (`spark.remote`), not a local session."""
        return bool(SparkConfig.model_validate(expand_settings(self.settings, "spark")).remote)

    def stop_if_idle(self) -> bool:
        """Stops a local session idle for `spark.idle_stop_seconds`; whether it did."""
        from siphon_dagster.streaming.spark_session import stop_if_idle

        return stop_if_idle(SparkConfig.model_validate(expand_settings(self.settings, "spark")).idle_stop_seconds)
