"""Row parity's cost: bucket digests of a notes table computed in PostgreSQL and in the embedded
ClickHouse, then the rows of the mismatched buckets, beside `SELECT count(*)` and COPY to /dev/null.

    python bench/row_parity.py [--rows 1000000] [--drift 20]

1. A notes-shaped table (30 columns) of N rows, snapshotted whole into the embedded ClickHouse.
2. `--drift` rows deleted by hand at the target, so the narrowing step has buckets to read.
3. The steps of row_parity.find_divergent_rows without the stream wait (nothing is streaming): the
   source's bucket digests in one REPEATABLE READ transaction, the target's, the diff, the rows of the
   mismatched buckets at both ends, and the classification. Each step is timed; the digests are
   compared with a `SELECT count(*)` and a COPY of the same table to /dev/null (the cost of reading
   every value once), and the peak memory of the ClickHouse server during the digest is reported.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import time

from common import peak_rss_mb, print_json, print_table, services, stop_on_signals
from snapshot import (
    TABLE,
    Destination,
    copy_with_psycopg,
    load_notes,
    prepare,
    snapshot_partition,
    source_count,
)

from siphon_core.config import ClickHouseTargetConfig
from siphon_dagster import source
from siphon_dagster.checks import source_digest
from siphon_dagster.checks.digest import bucket_digits, classify, mismatched_buckets
from siphon_dagster.partitions import BlockRange
from siphon_dagster.targets.clickhouse import ClickHouseTarget


def timed(what, *args):
    started = time.monotonic()
    value = what(*args)
    return value, time.monotonic() - started


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--drift", type=int, default=20, help="rows deleted by hand at the target")
    args = parser.parse_args()
    stop_on_signals()
    with services(nats=False, clickhouse=True) as stack:
        dsn, clickhouse_pid = stack.dsn, stack.clickhouse_pid or 0
        print(f"loading {args.rows:,} notes rows...", flush=True)
        blocks = load_notes(dsn, args.rows)
        rows = source_count(dsn)
        destination = Destination(dsn, stack.clickhouse_url, "bench_parity", blocks)
        prepare(destination)
        print("snapshot into ClickHouse...", flush=True)
        snapshot_partition(destination, BlockRange(0, blocks - 1).key)
        target = ClickHouseTarget(ClickHouseTargetConfig(url=stack.clickhouse_url, database="bench_parity"))
        with source.connect(dsn) as connection:
            table = source.table_schema(connection, TABLE)
        client = target._connect()
        client.command("OPTIMIZE TABLE `bench_parity`.`public__notes` FINAL")
        client.command(f"ALTER TABLE `bench_parity`.`public__notes` DELETE WHERE id % {rows // max(args.drift, 1)} = 0 "
                       "SETTINGS mutations_sync = 1")
        drifted = rows - target.count_current(table)

        print("references: count(*), COPY to /dev/null...", flush=True)
        copy_with_psycopg(dsn)  # warm-up
        _, count_seconds = timed(source_count, dsn)
        copy_seconds = min(copy_with_psycopg(dsn)[0] for _ in range(2))

        print("row parity steps...", flush=True)
        digits = bucket_digits(rows)
        with source_digest.snapshot_read(dsn) as read:
            connection = read.connection
            source_rows, source_count_seconds = timed(source_digest.count_rows, connection, table)
            source_digest.snapshot_lsn(connection)  # as row parity reads it (nothing streams here)
            source_digests, source_seconds = timed(source_digest.bucket_digests, connection, table, digits)
            rss_before = rss_mb(clickhouse_pid)
            target_digests, target_seconds = timed(target.bucket_digests, table, digits)
            rss_after = rss_mb(clickhouse_pid)
            buckets = mismatched_buckets(source_digests, target_digests)
            source_bucket_rows, source_rows_seconds = timed(source_digest.bucket_rows, connection, table, digits,
                                                            buckets)
        target_bucket_rows, target_rows_seconds = timed(target.bucket_rows, table, digits, buckets)
        divergent, in_flight = classify(source_bucket_rows.keys() | target_bucket_rows.keys(), source_bucket_rows,
                                        target_bucket_rows, read.version_before, TABLE.blocks_per_partition)
        target.close()
        assert source_rows == rows and len(divergent) == drifted and not in_flight, (len(divergent), drifted)
        total = source_count_seconds + source_seconds + target_seconds + source_rows_seconds + target_rows_seconds
        clickhouse_peak = peak_rss_mb(clickhouse_pid)
    figures = [
        ("rows, bucket digits, buckets", f"{rows:,}, {digits}, {len(source_digests):,}", ""),
        ("SELECT count(*) s", f"{count_seconds:.2f}", "reference"),
        ("COPY to /dev/null s", f"{copy_seconds:.2f}", "reference"),
        ("source bucket digests s (PostgreSQL)", f"{source_seconds:.2f}", ""),
        ("  ratio to COPY", f"{source_seconds / copy_seconds:.2f}", ""),
        ("target bucket digests s (ClickHouse)", f"{target_seconds:.2f}", ""),
        ("  ClickHouse RSS before / after MB", f"{rss_before:,.0f} / {rss_after:,.0f}", ""),
        ("  ClickHouse peak RSS MB (whole run)", f"{clickhouse_peak:,.0f}", ""),
        ("mismatched buckets, divergent keys", f"{len(buckets)}, {len(divergent)}", f"{drifted} deleted"),
        ("rows of mismatched buckets s (source + target)", f"{source_rows_seconds:.2f} + {target_rows_seconds:.2f}",
         ""),
        ("row parity total s (no stream wait)", f"{total:.2f}", "hourly: << 3600"),
        ("  per million rows s", f"{total / rows * 1e6:.2f}", ""),
        ("  10M rows, extrapolated s", f"{total / rows * 1e7:.0f}", ""),
        ("load average", f"{os.getloadavg()[0]:.1f}", ""),
    ]
    print_table("Row parity of a notes table, PostgreSQL vs the embedded ClickHouse", figures)
    print_json({"rows": rows, "count_seconds": count_seconds, "copy_seconds": copy_seconds,
                "source_digest_seconds": source_seconds, "target_digest_seconds": target_seconds,
                "narrowing_seconds": source_rows_seconds + target_rows_seconds, "total_seconds": total,
                "divergent": len(divergent), "clickhouse_rss_after_mb": rss_after,
                "extrapolated_10m_seconds": total / rows * 1e7})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
