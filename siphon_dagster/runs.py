"""Snapshot and resync runs started from Python or the CLI, recorded by the Dagster instance.

Assets are selected by `AssetKey` objects, never by selection text: a table name holding a quote,
a space or a dot is one key path element here, where `--select` syntax cannot spell it.
"""

from __future__ import annotations

from dataclasses import dataclass

import dagster as dg

from siphon_core.config import SiphonConfig
from siphon_dagster import source
from siphon_dagster.definitions import build_definitions
from siphon_dagster.partitions import parse_key
from siphon_dagster.resync import resync_op_name
from siphon_dagster.sensors import add_partitions, key_count, partition_requests
from siphon_dagster.specs import TableSpec, table_specs

# The tags `dagster asset materialize --partition-range` sets: one run walks the range.
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"


class SelectionError(ValueError):
    """A table, target or partition the configuration does not have; the message lists what it has."""


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    success: bool
    first_partition: str | None = None
    last_partition: str | None = None
    error: str | None = None  # why the run failed, in one line


# A command prints one line per run: Dagster's console lines (every event, a failure's stack trace)
# would bury it, and the instance keeps each run's whole log.
QUIET_CONSOLE = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def failure_reason(result: dg.ExecuteInProcessResult) -> str | None:
    """The first failed step's error (the exception the step raised, not Dagster's wrapper), in one line."""
    for event in result.all_events:
        if event.is_step_failure or event.is_run_failure:
            error = getattr(event.event_specific_data, "error", None)
            if error is None:
                continue
            if error.cls_name.startswith("Dagster") and error.cause is not None:
                error = error.cause
            # The message starts with the exception's (qualified) class name, as Python prints it.
            head, colon, rest = error.message.strip().partition(": ")
            text = rest if colon and head.rsplit(".", 1)[-1] == error.cls_name else error.message.strip()
            return f"{error.cls_name}: " + " ".join(line.strip() for line in text.splitlines() if line.strip())
    return None


def find_spec(config: SiphonConfig, table: str) -> TableSpec:
    specs = table_specs(config)
    for spec in specs:
        if spec.qualified_name == table:
            return spec
    raise SelectionError(f"table {table!r} is not in the configuration of {config.application_identifier}; "
                         f"its tables are: {', '.join(repr(s.qualified_name) for s in specs)}")


def choose_targets(spec: TableSpec, target: str | None) -> list[str]:
    if target is None:
        return list(spec.targets)
    if target not in spec.targets:
        raise SelectionError(f"{spec.qualified_name} does not go to target {target!r}; its targets are: "
                             f"{', '.join(spec.targets)}")
    return [target]


def refresh_partitions(instance: dg.DagsterInstance, config: SiphonConfig, specs: list[TableSpec]) -> int:
    """Adds the partitions of the tables' current sizes to the instance (what the sensor does)."""
    with source.connect(config.source.conninfo(), autocommit=True) as connection:
        requests, _ = partition_requests(instance, connection, specs)
    return key_count(add_partitions(instance, requests))


def partition_spans(instance: dg.DagsterInstance, spec: TableSpec, selection: str) -> list[tuple[str, str]]:
    """`all`, `A...B` or one key, as (first, last) spans of existing partitions, in the table's order."""
    keys = instance.get_dynamic_partitions(spec.partitions_def_name)
    if not keys:
        raise SelectionError(f"{spec.qualified_name} has no partitions yet; run `siphon-dagster partitions refresh`")
    if selection == "all":
        return [(keys[0], keys[-1])]
    first, separator, last = selection.partition("...")
    if not separator:
        last = first
    for key in (first, last):
        try:
            parse_key(key, spec.table.blocks_per_partition)
        except ValueError as error:
            raise SelectionError(f"{spec.qualified_name}: {error}") from None
        if key not in keys:
            raise SelectionError(f"{spec.qualified_name} has no partition {key} (its partitions run from "
                                 f"{keys[0]} to {keys[-1]})")
    if keys.index(first) > keys.index(last):
        raise SelectionError(f"{spec.qualified_name}: partition range {selection} ends before it starts")
    return [(first, last)]


def contiguous_spans(instance: dg.DagsterInstance, spec: TableSpec, wanted: list[str]) -> list[tuple[str, str]]:
    """Partition keys grouped into runs of neighbours, so that one run loads each group."""
    keys = instance.get_dynamic_partitions(spec.partitions_def_name)
    positions = sorted({keys.index(key) for key in wanted})
    spans: list[tuple[str, str]] = []
    start = previous = None
    for position in positions:
        if start is None:
            start = previous = position
        elif position == previous + 1:
            previous = position
        else:
            spans.append((keys[start], keys[previous]))
            start = previous = position
    if start is not None:
        spans.append((keys[start], keys[previous]))
    return spans


def snapshot(config: SiphonConfig, spec: TableSpec, target: str, spans: list[tuple[str, str]],
             instance: dg.DagsterInstance) -> list[RunOutcome]:
    """One run of the target asset per span of partitions; each run reads its ranges one by one."""
    definitions = build_definitions(config)
    asset = definitions.resolve_assets_def(spec.target_key(target))
    outcomes = []
    for first, last in spans:
        tags = {RANGE_START_TAG: first, RANGE_END_TAG: last}
        result = dg.materialize([asset], instance=instance, tags=tags, raise_on_error=False, run_config=QUIET_CONSOLE)
        outcomes.append(RunOutcome(result.run_id, result.success, first, last, failure_reason(result)))
    return outcomes


def resync(config: SiphonConfig, spec: TableSpec, targets: list[str] | None,
           instance: dg.DagsterInstance) -> RunOutcome:
    definitions = build_definitions(config)
    job = definitions.resolve_job_def(spec.resync_job_name)
    run_config = {"ops": {resync_op_name(spec): {"config": {"targets": targets}}}} if targets else {}
    result = job.execute_in_process(run_config={**run_config, **QUIET_CONSOLE}, instance=instance,
                                    raise_on_error=False)
    return RunOutcome(result.run_id, result.success, error=failure_reason(result))
