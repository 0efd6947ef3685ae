"""What every check gets (the table, one target, the source, the stream) and returns.

A check never raises to report a problem: `run_guarded` turns any error into a failed outcome that
names the cause, with the target's address and never its credentials.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
)

from siphon_core.config import ChecksConfig
from siphon_dagster.checks.stream_position import StreamWatch
from siphon_dagster.specs import TableSpec
from siphon_dagster.table_state import NOT_COMPARED
from siphon_dagster.targets.base import Target

ERROR = dg.AssetCheckSeverity.ERROR
WARN = dg.AssetCheckSeverity.WARN
_LISTED_RUNS = 3


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


def loading(runs: Sequence[dg.DagsterRun]) -> Outcome:
    """A data check's outcome while block ranges are being written into the table: its rows are
    partly there, so a count or a digest would report the load as drift. A warning that says so,
    recorded as not compared (`NOT_COMPARED`), which no status counts as a failure."""
    listed = ", ".join(f"{run.run_id[:8]} ({_what(run)})" for run in runs[:_LISTED_RUNS])
    more = f" and {len(runs) - _LISTED_RUNS} more" if len(runs) > _LISTED_RUNS else ""
    return Outcome(False, f"not compared: the table is being loaded by {len(runs)} snapshot run(s), {listed}{more}; "
                          "it is compared at the next check after they end",
                   {NOT_COMPARED: "loading", "snapshot_runs": [run.run_id for run in runs]}, WARN)


def _what(run: dg.DagsterRun) -> str:
    tags = run.tags
    if PARTITION_NAME_TAG in tags:
        return f"partition {tags[PARTITION_NAME_TAG]}"
    return f"partitions {tags.get(ASSET_PARTITION_RANGE_START_TAG)} to {tags.get(ASSET_PARTITION_RANGE_END_TAG)}"


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


def result(check_name: str, asset_key: dg.AssetKey, outcome: Outcome) -> dg.AssetCheckResult:
    metadata = {key: dg.MetadataValue.json(value) if isinstance(value, (list, dict)) else value
                for key, value in outcome.metadata.items() if value is not None}
    metadata["summary"] = outcome.summary
    return dg.AssetCheckResult(asset_key=asset_key, check_name=check_name, passed=outcome.passed,
                               severity=outcome.severity, description=outcome.summary, metadata=metadata)
