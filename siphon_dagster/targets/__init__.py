"""Analytical targets behind one interface (`base.Target`); the rest of Siphon builds them here."""

from __future__ import annotations

from siphon_core.config import SiphonConfig
from siphon_dagster.targets.base import Target, TargetError


def build_target(name: str, config: SiphonConfig) -> Target:
    """The target called `name` ("clickhouse" or "snowflake") as configured in siphon.yaml."""
    if name == "clickhouse" and config.targets.clickhouse is not None:
        # Imported here so that configuring one target never needs the other's driver at import.
        from siphon_dagster.targets.clickhouse import ClickHouseTarget

        return ClickHouseTarget(config.targets.clickhouse)
    if name == "snowflake" and config.targets.snowflake is not None:
        from siphon_dagster.targets.snowflake import SnowflakeTarget

        return SnowflakeTarget(config.targets.snowflake)
    configured = ", ".join(config.targets.configured()) or "none"
    raise TargetError(
        f"target '{name}' is not configured for {config.application_identifier} (configured: {configured}); "
        f"add it under targets: in siphon.yaml"
    )


__all__ = ["Target", "TargetError", "build_target"]
