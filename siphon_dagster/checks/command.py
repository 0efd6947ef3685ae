"""`siphon-dagster check [--table T] [--target X]`: runs checks through Dagster and prints one line each.

The checks run as a run of the checks job on the instance of DAGSTER_HOME, so every result is
recorded on its asset as if the schedule or the UI had run it. Exit 0 when no ERROR check failed,
1 when one did, 2 on bad input.
"""

from __future__ import annotations

import sys

import dagster as dg

from siphon_core.config import SiphonConfig
from siphon_dagster.checks.definitions import check_keys, checks_job_name
from siphon_dagster.specs import TableSpec, group_name, table_specs
from siphon_dagster.table_state import NOT_COMPARED


def selected_keys(config: SiphonConfig, table: str | None, target: str | None) -> list[dg.AssetCheckKey]:
    """The checks of the named table and target (default: all); ValueError names what is unknown."""
    specs = table_specs(config)
    if table is not None:
        specs = [s for s in specs if s.qualified_name == table]
        if not specs:
            raise ValueError(f"table {table} is not in the configuration; its tables are: "
                             f"{', '.join(s.qualified_name for s in table_specs(config))}")
    configured = config.targets.configured()
    if target is not None and target not in configured:
        raise ValueError(f"target {target} is not configured; the configured targets are: {', '.join(configured)}")
    pairs: list[tuple[TableSpec, str]] = [(s, t) for s in specs for t in s.targets if target in (None, t)]
    if not pairs:
        raise ValueError(f"table {table} is not replicated to target {target} (its targets: "
                         f"{', '.join(specs[0].targets)})")
    return [key for spec, name in pairs for key in check_keys(spec, name)]


def run_checks(definitions: dg.Definitions, group: str, keys: list[dg.AssetCheckKey],
               instance: dg.DagsterInstance, quiet: bool = False) -> list[dg.AssetCheckEvaluation]:
    """Runs the checks `keys` as one run of the code location's checks job (`definitions`); `quiet`
    keeps the run's events off the console (the command prints a line per check; the instance keeps
    the run's log)."""
    job = definitions.resolve_job_def(checks_job_name(group))
    run_config = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}} if quiet else None
    result = job.get_subset(asset_check_selection=set(keys)).execute_in_process(
        instance=instance, raise_on_error=False, run_config=run_config)
    return list(result.get_asset_check_evaluations())


def status_line(evaluation: dg.AssetCheckEvaluation) -> str:
    if evaluation.passed:
        status = "PASS"
    elif NOT_COMPARED in evaluation.metadata:
        status = "SKIP"
    else:
        status = "FAIL" if evaluation.severity == dg.AssetCheckSeverity.ERROR else "WARN"
    summary = (evaluation.description or "").replace("\n", " ")
    return f"{status}  {evaluation.asset_key.to_user_string()}  {evaluation.check_name}  {summary}"


def main(config: SiphonConfig, definitions: dg.Definitions, table: str | None, target: str | None) -> int:
    try:
        keys = selected_keys(config, table, target)
    except ValueError as error:
        print(f"siphon-dagster check: {error}", file=sys.stderr)
        return 2
    evaluations = run_checks(definitions, group_name(config.application_identifier), keys,
                             dg.DagsterInstance.get(), quiet=True)
    return 0 if print_results(keys, evaluations) else 1


def print_results(keys: list[dg.AssetCheckKey], evaluations: list[dg.AssetCheckEvaluation]) -> bool:
    """One line per check of `keys`, in their order; True when none of ERROR severity failed (or did not run)."""
    by_key = {(e.asset_key, e.check_name): e for e in evaluations}
    passed = True
    for key in keys:
        evaluation = by_key.get((key.asset_key, key.name))
        if evaluation is None:
            print(f"FAIL  {key.asset_key.to_user_string()}  {key.name}  did not run (see the run's log)")
            passed = False
            continue
        print(status_line(evaluation))
        passed = passed and (evaluation.passed or evaluation.severity != dg.AssetCheckSeverity.ERROR)
    return passed


