"""Resync cost and reader availability: a notes table rebuilt in the embedded ClickHouse, beside a
snapshot of every partition of the same table.

    python bench/resync.py [--rows 500000] [--blocks-per-partition 8192]

1. A notes-shaped table (30 columns) of N rows.
2. Reference: every partition snapshotted into the live table in one Dagster run (`runs.snapshot`).
3. `resync_notes` through Dagster (`runs.resync`): shadow table, every range into it, swap, then
   the rebuilt table's checks, as every resync ends. The producer runs throughout, as it does
   wherever a table is resynced: the checks settle against the position it has stored. The
   rebuild (up to the swap) and the checks are timed apart, from the run's events. A rebuild first
   waits, by design, until every streaming run has seen the resync table
   (`streaming.shadow_lookup_seconds` and a margin); the rate is also given without that wait.
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
from pathlib import Path

import dagster as dg
import psycopg
import yaml
from common import NOTES_INSERT_SELECT, create_notes_table, print_json, print_table, services, stop_on_signals
from producer import Producer

from siphon_core.config import SiphonConfig, parse_config
from siphon_dagster import runs, source
from siphon_dagster.resync import SHADOW_SETTLE_MARGIN_SECONDS
from siphon_dagster.specs import TableSpec
from siphon_dagster.targets import build_target

APPLICATION = "bench.resync"


class ResyncProducer(Producer):
    """bench/producer.py's helper with this benchmark's application."""

    def __init__(self, directory: Path, dsn: str, nats_url: str) -> None:
        super().__init__(directory, dsn, nats_url)
        self.config.write_text(yaml.safe_dump({
            "application_identifier": APPLICATION,
            "source": {"dsn": dsn},
            "queue": {"url": nats_url},
            "producer": {"metrics_port": self.metrics_port, "status_interval_seconds": 0.2},
            "tables": [{"name": "public.notes"}],
        }))


def rebuild_seconds(instance: dg.DagsterInstance, run_id: str) -> float:
    """From the run's start to its last materialization: the rebuild, swap included."""
    records = instance.all_logs(run_id)
    started = next(r.timestamp for r in records if r.dagster_event_type == dg.DagsterEventType.RUN_START)
    swapped = max(r.timestamp for r in records if r.dagster_event_type == dg.DagsterEventType.ASSET_MATERIALIZATION)
    return swapped - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--blocks-per-partition", type=int, default=8192)
    args = parser.parse_args()
    stop_on_signals()
    with services(nats=True, clickhouse=True) as stack:
        dsn = stack.postgres.dsn
        create_notes_table(dsn)
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(NOTES_INSERT_SELECT.format(name="notes", first=1, last=args.rows))
            connection.execute("vacuum (freeze, analyze) notes")
        config = parse_config({
            "application_identifier": APPLICATION,
            "source": {"dsn": dsn},
            "queue": {"url": stack.nats.url},
            "tables": [{"name": "public.notes", "blocks_per_partition": args.blocks_per_partition}],
            "targets": {"clickhouse": {"url": stack.clickhouse_url, "database": "bench"}},
        })
        spec = runs.find_spec(config, "public.notes")
        os.environ.setdefault("DAGSTER_HOME", str(stack.directory))
        producer = ResyncProducer(stack.directory, dsn, stack.nats.url)
        producer.start()
        try:
            figures = measure(config, spec, dsn)
        finally:
            producer.stop()
    snapshot_seconds, rebuild, resync_seconds, counts = figures
    wait = spec.streaming.shadow_lookup_seconds + SHADOW_SETTLE_MARGIN_SECONDS
    print_table(f"resync of {args.rows:,} notes rows into the embedded ClickHouse", [
        ("snapshot of every partition (s)", f"{snapshot_seconds:.1f}", "reference"),
        ("resync: shadow, every range, swap (s)", f"{rebuild:.1f}", f"{rebuild / snapshot_seconds:.2f}x the snapshot"),
        ("  of which the wait for streaming runs to see the resync table (s)", f"{wait:.1f}",
         "streaming.shadow_lookup_seconds + margin"),
        ("resync rows/s, without that wait", f"{args.rows / (rebuild - wait):,.0f}",
         f"{args.rows / snapshot_seconds:,.0f} snapshot"),
        ("the whole run, the rebuilt table's checks included (s)", f"{resync_seconds:.1f}", ""),
        ("view reads during the resync", f"{len(counts):,}", "all see every row"),
        ("smallest count a reader saw", f"{min(counts):,}", f"{args.rows:,}"),
    ])
    print_json({"rows": args.rows, "snapshot_seconds": snapshot_seconds, "rebuild_seconds": rebuild,
                "shadow_wait_seconds": wait,
                "resync_seconds": resync_seconds, "view_reads": len(counts), "min_view_count": min(counts)})


def measure(config: SiphonConfig, spec: TableSpec, dsn: str) -> tuple[float, float, float, list[int]]:
    """The snapshot of every partition, then the resync with a reader counting the view throughout:
    (snapshot seconds, rebuild seconds, the resync run's seconds, the counts the reader saw)."""
    with dg.instance_for_test() as instance:
        runs.refresh_partitions(instance, config, [spec])
        spans = runs.partition_spans(instance, spec, "all")
        started = time.monotonic()
        outcomes = runs.snapshot(config, spec, "clickhouse", spans, instance)
        failed = [o.error for o in outcomes if not o.success]
        if failed:
            raise SystemExit(f"the snapshot failed: {failed[0]}")
        snapshot_seconds = time.monotonic() - started

        target = build_target("clickhouse", config)
        with source.connect(dsn) as connection:
            table_schema = source.table_schema(connection, spec.table)
        counts: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            reader = build_target("clickhouse", config)
            try:
                while not stop.is_set():
                    counts.append(reader.count_current(table_schema))
            finally:
                reader.close()

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        try:
            outcome = runs.resync(config, spec, None, instance)
        finally:
            stop.set()
            sampler.join()
        resync_seconds = time.monotonic() - started
        if not outcome.success:
            raise SystemExit(f"the resync failed: {outcome.error}")
        rebuild = rebuild_seconds(instance, outcome.run_id)
        final = target.count_current(table_schema)
        target.close()
    expected = count_source(dsn)
    if final != expected or min(counts) != expected:
        raise SystemExit(f"the view held {final:,} rows after the resync and a reader saw {min(counts):,} at least; "
                         f"the source has {expected:,}")
    return snapshot_seconds, rebuild, resync_seconds, counts


def count_source(dsn: str) -> int:
    with psycopg.connect(dsn) as connection:
        return connection.execute("select count(*) from notes").fetchone()[0]


if __name__ == "__main__":
    main()
