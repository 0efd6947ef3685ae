"""`siphon-dagster partitions refresh|list` and `siphon-dagster target drop`.

`partitions refresh` adds the partitions of every table's current size to the Dagster instance
(what the partitions sensor does every minute), so a fresh instance can materialize from the CLI at
once. `target drop` drops a table, its view and its helper tables at one target: the first step of
rebuilding a table whose target cannot follow the source's schema (the snapshot of every partition
then creates it again).
"""

from __future__ import annotations

import argparse
import sys

import dagster as dg

from siphon_core import naming
from siphon_core.config import ConfigError, SiphonConfig, load_config, load_config_from_environment
from siphon_dagster import source
from siphon_dagster.sensors import partition_requests
from siphon_dagster.specs import TableSpec, table_specs
from siphon_dagster.targets import build_target
from siphon_dagster.targets.base import TableSchema


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config) if args.config else load_config_from_environment()
    except ConfigError as error:
        print(f"siphon-dagster: {error}", file=sys.stderr)
        return 2
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
        with source.connect(config.source.conninfo(), autocommit=True) as connection:
            requests, _ = partition_requests(instance, connection, specs)
        for request in requests:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        added = sum(len(r.partition_keys) for r in requests)
        print(f"added {added} partitions")
    for spec in specs:
        keys = instance.get_dynamic_partitions(spec.partitions_def_name)
        print(f"{spec.qualified_name}: {len(keys)} partitions" + ("" if args.action == "refresh" else ""))
        if args.action == "list":
            for key in keys:
                print(f"  {key}")
    return 0


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
    print(f"dropped {spec.qualified_name} at {target}; materialize every partition of asset "
          f"{naming.asset_path_text(target, spec.schema, spec.name)} to load it again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
