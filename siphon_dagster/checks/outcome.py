"""What every check gets (the table, one target, the source, the stream) and returns.

A check never raises to report a problem: `run_guarded` turns any error into a failed outcome that
names the cause, with the target's address and never its credentials.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from siphon_core.config import ChecksConfig
from siphon_dagster.checks.stream_position import StreamWatch
from siphon_dagster.specs import TableSpec
from siphon_dagster.targets.base import Target

ERROR = dg.AssetCheckSeverity.ERROR
WARN = dg.AssetCheckSeverity.WARN


@dataclass
class CheckContext:
    spec: TableSpec
    target: Target
    source_dsn: str
    watch: StreamWatch
    settings: ChecksConfig
    instance: dg.DagsterInstance | None = None
    secrets: tuple[str, ...] = ()  # never shown in a message (the target's password, URLs with it)

    @property
    def asset_key(self) -> dg.AssetKey:
        return self.spec.target_key(self.target.name)

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            if secret:
                text = text.replace(secret, "***")
        return text


@dataclass
class Outcome:
    passed: bool
    summary: str
    metadata: dict[str, Any] = field(default_factory=dict)
    severity: dg.AssetCheckSeverity = ERROR


def run_guarded(name: str, check: Callable[[CheckContext], Outcome], context: CheckContext,
                severity: dg.AssetCheckSeverity) -> Outcome:
    started = time.monotonic()
    try:
        outcome = check(context)
    except Exception as error:  # any failure to check is a failed check, never a crashed step
        cause = context.redact(f"{type(error).__name__}: {error}")
        outcome = Outcome(False, f"{name} could not run: {cause} (target {context.target.location})",
                          {"target": context.target.location, "error": cause}, severity)
    outcome.metadata["seconds"] = round(time.monotonic() - started, 3)
    return outcome


def result(check_name: str, context: CheckContext, outcome: Outcome) -> dg.AssetCheckResult:
    metadata = {key: dg.MetadataValue.json(value) if isinstance(value, (list, dict)) else value
                for key, value in outcome.metadata.items() if value is not None}
    metadata["summary"] = outcome.summary
    return dg.AssetCheckResult(asset_key=context.asset_key, check_name=check_name, passed=outcome.passed,
                               severity=outcome.severity, description=outcome.summary, metadata=metadata)
