"""Resync cost and reader availability: a notes table rebuilt in the embedded ClickHouse, beside a
snapshot of every partition of the same table.

    python bench/resync.py [--rows 500000] [--blocks-per-partition 8192]

1. A notes-shaped table (30 columns) of N rows.
2. Reference: every partition snapshotted into the live table in one Dagster run (`runs.snapshot`).
3. `resync_notes` through Dagster (`runs.resync`): shadow table, every range into it, swap.
4. Meanwhile a thread counts the `_current` view over and over: the smallest count it saw must be
   the table's (never empty, never partial), and it reports how many reads it made.
Runs are in process, against a temporary instance: Dagster's per-run overhead is included. Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import dagster as dg
import psycopg
from common import NOTES_INSERT_SELECT, create_notes_table, print_json, print_table, services, stop_on_signals

from siphon_core.config import parse_config
from siphon_dagster import runs, source
from siphon_dagster.targets import build_target


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--blocks-per-partition", type=int, default=8192)
    args = parser.parse_args()
    stop_on_signals()
    with services(nats=False, clickhouse=True) as stack:
        dsn = stack.postgres.dsn
        create_notes_table(dsn)
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(NOTES_INSERT_SELECT.format(name="notes", first=1, last=args.rows))
            connection.execute("vacuum (freeze, analyze) notes")
        config = parse_config({
            "application_identifier": "bench.resync",
            "source": {"dsn": dsn},
            "tables": [{"name": "public.notes", "blocks_per_partition": args.blocks_per_partition}],
            "targets": {"clickhouse": {"url": stack.clickhouse_url, "database": "bench"}},
        })
        spec = runs.find_spec(config, "public.notes")
        os.environ.setdefault("DAGSTER_HOME", str(stack.directory))
        with dg.instance_for_test() as instance:
            runs.refresh_partitions(instance, config, [spec])
            spans = runs.partition_spans(instance, spec, "all")
            started = time.monotonic()
            assert all(o.success for o in runs.snapshot(config, spec, "clickhouse", spans, instance))
            snapshot_seconds = time.monotonic() - started

            target = build_target("clickhouse", config)
            with source.connect(dsn) as connection:
                table_schema = source.table_schema(connection, spec.table)
            counts: list[int] = []
            stop = threading.Event()

            def sample() -> None:
                reader = build_target("clickhouse", config)
                while not stop.is_set():
                    counts.append(reader.count_current(table_schema))
                reader.close()

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            assert runs.resync(config, spec, None, instance).success
            resync_seconds = time.monotonic() - started
            stop.set()
            sampler.join()
            final = target.count_current(table_schema)
            target.close()
    assert final == args.rows and min(counts) == args.rows, (final, min(counts))
    print_table(f"resync of {args.rows:,} notes rows into the embedded ClickHouse", [
        ("snapshot of every partition (s)", f"{snapshot_seconds:.1f}", "reference"),
        ("resync: shadow, every range, swap (s)", f"{resync_seconds:.1f}",
         f"{resync_seconds / snapshot_seconds:.2f}x the snapshot"),
        ("resync rows/s", f"{args.rows / resync_seconds:,.0f}", f"{args.rows / snapshot_seconds:,.0f} snapshot"),
        ("view reads during the resync", f"{len(counts):,}", "all see every row"),
        ("smallest count a reader saw", f"{min(counts):,}", f"{args.rows:,}"),
    ])
    print_json({"rows": args.rows, "snapshot_seconds": snapshot_seconds, "resync_seconds": resync_seconds,
                "view_reads": len(counts), "min_view_count": min(counts)})


if __name__ == "__main__":
    main()
