"""`siphon-dagster partitions refresh|list`, `target drop`, `check`, `status`, and `snapshot|resync|repair` (see cli_runs).

`partitions refresh` adds the partitions of every table's current size to the Dagster instance
(what the partitions sensor does every minute), so a fresh instance can materialize from the CLI at
once. `target drop` drops a table, its view and its helper tables at one target: the first step of
rebuilding a table whose target cannot follow the source's schema (the snapshot of every partition
then creates it again).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import dagster as dg
import psycopg
from dagster._core.errors import DagsterHomeNotSetError

from siphon_core import naming
from siphon_core.config import ConfigError, SiphonConfig, load_config, load_config_from_environment
from siphon_core.redaction import redact_dsn
from siphon_dagster import source
from siphon_dagster.cli_errors import SERVICE_ERRORS, one_line, quiet_libraries
from siphon_dagster.cli_runs import RUN_COMMANDS, add_run_commands, run_command  # snapshot, resync, repair
from siphon_dagster.runs import refresh_partitions
from siphon_dagster.specs import TableSpec, table_specs
from siphon_dagster.targets import build_target
from siphon_dagster.targets.base import TableSchema


# --- a failing service or login is one line, never a traceback ----------------------------------
def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    try:
        return _main(argv)
    except SERVICE_ERRORS as error:
        print(f"siphon-dagster: {one_line(error)}", file=sys.stderr)
        return 1
    except DagsterHomeNotSetError:
        print("siphon-dagster: DAGSTER_HOME is not set; point it at the Dagster instance's directory (the "
              "one `dagster dev` uses), where runs and check results are recorded", file=sys.stderr)
        return 2
# --- end of the failure handling -------------------------------------------------------------------


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="siphon-dagster", description=__doc__)
    parser.add_argument("--config", help="siphon.yaml (default: $SIPHON_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)
    partitions = sub.add_parser("partitions", help="block-range partitions")
    partitions.add_argument("action", choices=("refresh", "list"))
    partitions.add_argument("--table", help="schema.table (default: every table)")
    target = sub.add_parser("target", help="a table at one target")
    target.add_argument("action", choices=("drop",))
    target.add_argument("--target", required=True, help="clickhouse or snowflake")
    target.add_argument("--table", required=True, help="schema.table, as in siphon.yaml")
    add_run_commands(sub)
    # -- checks ----------------------------------------------------------------------------------
    checks = sub.add_parser("check", help="run the asset checks through Dagster and print one line per check")
    checks.add_argument("--table", help="schema.table (default: every table)")
    checks.add_argument("--target", help="clickhouse or snowflake (default: every target of the table)")
    # -- status ----------------------------------------------------------------------------------
    status = sub.add_parser("status", help="every table at every target in a line: streaming, lag, snapshot state, "
                                           "checks; exit 1 when one needs attention")
    status.add_argument("--table", help="schema.table (default: every table)")
    status.add_argument("--target", help="clickhouse or snowflake (default: every target of the table)")
    status.add_argument("--problems", action="store_true", help="only the tables that need attention")
    status.add_argument("--max-lag-seconds", type=float, default=300.0,
                        help="a table whose latest batch was further behind the source needs attention (default 300)")
    status.add_argument("--json", action="store_true", help="a JSON object per table instead of columns")
    # -------------------------------------------------------------------------------------------
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config) if args.config else load_config_from_environment()
    except ConfigError as error:
        print(f"siphon-dagster: {error}", file=sys.stderr)
        return 2
    if args.command == "check":
        from siphon_dagster.checks.command import main as check_main
        from siphon_dagster.definitions import build_definitions

        return check_main(config, build_definitions(config), args.table, args.target)
    if args.command in RUN_COMMANDS:
        return run_command(args, config)
    if args.command == "status":
        return _status(config, args)
    specs = table_specs(config)
    if args.table:
        specs = [s for s in specs if s.qualified_name == args.table]
        if not specs:
            print(f"siphon-dagster: table {args.table} is not in the configuration", file=sys.stderr)
            return 2
    if args.command == "target":
        return _drop_target_table(config, specs[0], args.target)
    instance = dg.DagsterInstance.get()
    if args.action == "refresh":
        try:
            added = refresh_partitions(instance, config, specs)
        except source.SourceError as error:
            print(f"siphon-dagster: {error}", file=sys.stderr)
            return 2
        except psycopg.OperationalError as error:
            print(f"siphon-dagster: cannot reach the source at {redact_dsn(config.source.dsn)}: "
                  f"{one_line(error).removeprefix('PostgreSQL: ')}", file=sys.stderr)
            return 1
        print(f"added {added} partitions")
    for spec in specs:
        keys = instance.get_dynamic_partitions(spec.partitions_def_name)
        print(f"{spec.qualified_name}: {len(keys)} partitions" + ("" if args.action == "refresh" else ""))
        if args.action == "list":
            for key in keys:
                print(f"  {key}")
    return 0


def _status(config: SiphonConfig, args: argparse.Namespace) -> int:
    from siphon_dagster.checks.command import selected_keys
    from siphon_dagster.status import read_statuses, render_json, render_lines, summary_line

    try:
        selected_keys(config, args.table, args.target)  # names an unknown table or target
    except ValueError as error:
        print(f"siphon-dagster: {error}", file=sys.stderr)
        return 2
    if args.max_lag_seconds <= 0:
        print(f"siphon-dagster: --max-lag-seconds must be above 0, not {args.max_lag_seconds:g}", file=sys.stderr)
        return 2
    specs = [s for s in table_specs(config) if args.table in (None, s.qualified_name)]
    now = time.time()
    statuses = read_statuses(dg.DagsterInstance.get(), specs, None if args.target is None else [args.target],
                             max_lag_seconds=args.max_lag_seconds, now=now)
    shown = [s for s in statuses if not s.ok] if args.problems else statuses
    for line in render_json(shown) if args.json else [*render_lines(shown, now), summary_line(statuses)]:
        print(line)
    return 0 if all(s.ok for s in statuses) else 1


def _drop_target_table(config: SiphonConfig, spec: TableSpec, target: str) -> int:
    if target not in spec.targets:
        print(f"siphon-dagster: {spec.qualified_name} is not replicated to target {target} (its targets: "
              f"{', '.join(spec.targets)})", file=sys.stderr)
        return 2
    destination = build_target(target, config)
    try:
        destination.drop_table(TableSchema(spec.schema, spec.name, ()))
    finally:
        destination.close()
    print(f"dropped {spec.qualified_name} at {target}")
    return _tell_snapshot_sensor(config, spec, target)


# --- the snapshot sensor loads a dropped table again ----------------------------------------------
def _tell_snapshot_sensor(config: SiphonConfig, spec: TableSpec, target: str) -> int:
    asset = naming.asset_path_text(target, spec.schema, spec.name)
    try:
        instance = dg.DagsterInstance.get()
    except Exception as error:  # no Dagster home here: the operator loads it
        print(f"no Dagster instance to record the drop in ({error}); load it again with siphon-dagster "
              f"snapshot --table {shlex.quote(spec.qualified_name)} --target {target}")
        return 0
    from siphon_dagster.snapshot_sensor import record_drop

    record_drop(instance, spec.target_key(target), f"{spec.qualified_name} at {target}")
    if config.snapshots.auto_load:
        print(f"the snapshot sensor loads every partition of asset {asset} again at its next tick")
    else:
        print(f"load it again with siphon-dagster snapshot --table {shlex.quote(spec.qualified_name)} --target "
              f"{target} (snapshots.auto_load is off)")
    return 0
# --- end of the snapshot sensor's part ------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main())
