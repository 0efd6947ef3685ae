"""`siphon-dagster snapshot|resync|repair`: runs through Dagster, recorded by the $DAGSTER_HOME instance.

`repair --table T` without `--keys-file` repairs what row parity finds (siphon_dagster.parity_repair)
and runs the table's checks again, printing one line per check as `check` does.

Tables are named as in siphon.yaml (`--table 'public.my "odd" table'`); every name the
configuration accepts works, including those `dagster asset materialize --select` cannot spell.
Exit status: 0 done, 1 a run failed, 2 bad input (the message says what the configuration has).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import dagster as dg

from siphon_core.config import SiphonConfig
from siphon_dagster import runs
from siphon_dagster.checks.command import print_results, run_checks
from siphon_dagster.checks.definitions import check_keys
from siphon_dagster.checks.row_parity import StreamBehind
from siphon_dagster.definitions import build_definitions
from siphon_dagster.parity_repair import repair_divergent_rows
from siphon_dagster.repair import RepairError, repair_keys
from siphon_dagster.specs import TableSpec, group_name

RUN_COMMANDS = ("snapshot", "resync", "repair")


def add_run_commands(sub: argparse._SubParsersAction) -> None:
    snapshot = sub.add_parser("snapshot", help="snapshot block-range partitions of a table again")
    snapshot.add_argument("--table", required=True, help="schema.table, as in siphon.yaml")
    snapshot.add_argument("--target", help="clickhouse or snowflake (default: every target of the table)")
    snapshot.add_argument("--partitions", default="all",
                          help="all (default), FIRST...LAST, or one key such as 00000000-00008191")
    resync = sub.add_parser("resync", help="rebuild a table at its targets (the resync_<table> job)")
    resync.add_argument("--table", required=True, help="schema.table, as in siphon.yaml")
    resync.add_argument("--target", help="clickhouse or snowflake (default: every target of the table)")
    repair = sub.add_parser("repair", help="bring rows back to the source's: those row parity names, or keys given")
    repair.add_argument("--table", required=True, help="schema.table, as in siphon.yaml")
    repair.add_argument("--target", help="clickhouse or snowflake (default: every target of the table)")
    repair.add_argument("--keys-file",
                        help="CSV, one key a line: the primary key's columns in the table's column order, "
                             "as PostgreSQL prints them (default: the keys row parity finds, then the table's "
                             "checks run again)")


def read_keys(path: str) -> list[tuple[str, ...]]:
    try:
        with Path(path).open(newline="") as file:
            return [tuple(row) for row in csv.reader(file) if row]
    except OSError as error:
        raise runs.SelectionError(f"cannot read keys file {path}: {error}") from None


def report(what: str, outcome: runs.RunOutcome) -> None:
    """One line per run: done on stdout; failed, with the reason, on stderr."""
    if outcome.success:
        print(f"{what}: done (run {outcome.run_id})")
    else:
        print(f"siphon-dagster: {what}: FAILED (run {outcome.run_id}): {outcome.error or 'see the run'}",
              file=sys.stderr)


def run_command(args: argparse.Namespace, config: SiphonConfig) -> int:
    try:
        spec = runs.find_spec(config, args.table)
        targets = runs.choose_targets(spec, args.target)
        keys = read_keys(args.keys_file) if args.command == "repair" and args.keys_file else []
        instance = dg.DagsterInstance.get()
        if args.command == "snapshot":
            added = runs.refresh_partitions(instance, config, [spec])
            if added:
                print(f"added {added} partitions of {spec.qualified_name}")
            spans = runs.partition_spans(instance, spec, args.partitions)
            ok = True
            for target in targets:
                for outcome in runs.snapshot(config, spec, target, spans, instance):
                    ok &= outcome.success
                    report(f"{spec.qualified_name} at {target}, partitions {outcome.first_partition}..."
                           f"{outcome.last_partition}", outcome)
            return 0 if ok else 1
        if args.command == "resync":
            outcome = runs.resync(config, spec, [args.target] if args.target else None, instance)
            report(f"resync of {spec.qualified_name} at {', '.join(targets)}", outcome)
            return 0 if outcome.success else 1
        if not args.keys_file:
            return repair_from_parity(config, spec, targets, instance)
        ok = True
        for target in targets:
            summary = repair_keys(config, spec, target, keys, instance)
            print(summary.text(), file=sys.stdout if summary.success else sys.stderr)
            ok &= summary.success
        return 0 if ok else 1
    except (runs.SelectionError, RepairError) as error:
        print(f"siphon-dagster: {error}", file=sys.stderr)
        return 2


def repair_from_parity(config: SiphonConfig, spec: TableSpec, targets: list[str], instance: dg.DagsterInstance) -> int:
    """`repair --table T` without keys: row parity names what to repair at each target, then the
    table's checks run again through Dagster. Exit 1 when a run failed or an ERROR check failed."""
    ok = True
    for target in targets:
        try:
            repair = repair_divergent_rows(config, spec, target, instance, log=print)
        except StreamBehind as error:
            print(f"{spec.qualified_name} at {target}: not repaired, row parity could not run: {error}")
            ok = False
            continue
        for line in repair.lines():
            print(line)
        ok &= repair.success
    keys = [key for target in targets for key in check_keys(spec, target)]
    evaluations = run_checks(build_definitions(config), group_name(config.application_identifier), keys, instance)
    ok &= print_results(keys, evaluations)
    return 0 if ok else 1
