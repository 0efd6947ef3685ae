"""Snowflake load paths: notes-shaped rows into the fakesnow server through INSERT ... VALUES and
through a temporary stage (Parquet, PUT, COPY INTO), as change batches and as one snapshot range.

    python bench/snowflake_load.py [--rows 100000] [--batch-rows 10000] [--insert-rows 10000]
                                   [--small-batches 100] [--small-batch-rows 10]

1. A notes-shaped table (30 columns) of N rows in PostgreSQL, read once as COPY text (under the
   session settings the producer pins) and parsed into change batches of `--batch-rows` rows,
   laid out as the streaming engine hands them to `apply_rows`.
2. For each path (`stage_min_rows` set so that every batch takes it), a schema of its own on one
   fakesnow server: the change batches through `SnowflakeTarget.apply_rows`, then the whole table
   again as one snapshot range through `apply_copy_text` (a newer version, so every row is
   rewritten), each timed, with the statements each load ran. The target must hold every row.
   The INSERT path takes only the first `--insert-rows` rows (one batch by default): fakesnow runs
   a 500-row INSERT of 32 columns in seconds, so 100,000 rows that way would take most of an hour.
3. Small change batches, as a run serving many tables mostly writes (`--small-batches` of
   `--small-batch-rows` rows): sent as the VALUES of their MERGE, one statement, against the same
   batches through a staging table filled by INSERT.
The reference is the other path on the same server in the same run. fakesnow runs each statement
in an embedded DuckDB on this machine, so its times are not Snowflake's; the statements per batch
are the same on Snowflake, where each costs a round trip and a warehouse's compile. Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import psycopg
import pyarrow as pa
from common import NOTES_INSERT_SELECT, create_notes_table, print_json, print_table, services, stop_on_signals

from siphon_core.config import SnowflakeTargetConfig, TableConfig
from siphon_dagster import source
from siphon_dagster.targets import snowflake as snowflake_target
from siphon_dagster.targets.base import TableSchema, change_batch_schema
from siphon_dagster.targets.copy_text import iter_copy_rows
from siphon_dagster.targets.snowflake import SnowflakeTarget
from siphon_stack.process import free_port
from siphon_stack.snowflake import FakesnowServer

SESSION_SETTINGS = {"DateStyle": "ISO", "IntervalStyle": "postgres", "TimeZone": "UTC", "extra_float_digits": "3",
                    "bytea_output": "hex"}
PATHS = {"insert": 10**12, "stage": 0}  # stage_min_rows that sends every batch one way


@dataclass
class Load:
    rows: int
    seconds: float
    statements: list[int]

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds

    @property
    def statements_text(self) -> str:
        low, high = min(self.statements), max(self.statements)
        return str(low) if low == high else f"{low} - {high}"


def read_source(dsn: str, rows: int, insert_rows: int) -> tuple[TableSchema, list[bytes], list[bytes]]:
    """The table, its COPY text, and the COPY text of its first `insert_rows` rows."""
    create_notes_table(dsn)
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(NOTES_INSERT_SELECT.format(name="notes", first=1, last=rows))
        for name, value in SESSION_SETTINGS.items():
            connection.execute("SELECT set_config(%s, %s, false)", (name, value))
        table = source.table_schema(connection, TableConfig(name="public.notes"))
        texts = []
        for limit in (rows, insert_rows):
            query = f"COPY (SELECT * FROM public.notes WHERE id <= {int(limit)} ORDER BY id) TO STDOUT"
            with connection.cursor().copy(query) as copy:
                texts.append([bytes(data) for data in copy])
    return table, texts[0], texts[1]


def change_batches(table: TableSchema, chunks: list[bytes], batch_rows: int) -> list[pa.Table]:
    schema = change_batch_schema(table)
    rows = list(iter_copy_rows(chunks))
    batches = []
    for start in range(0, len(rows), batch_rows):
        part = rows[start : start + batch_rows]
        arrays = [pa.array([r[i] for r in part], pa.string()) for i in range(len(table.columns))]
        arrays.append(pa.array(range(10 + start, 10 + start + len(part)), schema.field(len(arrays)).type))
        arrays.append(pa.array([False] * len(part)))
        batches.append(pa.Table.from_arrays(arrays, schema=schema))
    return batches


def apply_batches(target: SnowflakeTarget, table: TableSchema, batches: list[pa.Table], path: str) -> Load:
    statements = []
    started = time.perf_counter()
    for batch in batches:
        batch_started = time.perf_counter()
        target.apply_rows(table, batch)
        assert target.last_load_path == path, target.last_load_path
        print(f"{path}: {batch.num_rows} rows in {time.perf_counter() - batch_started:.2f}s", file=sys.stderr)
        statements.append(target.last_load_statements)
    return Load(sum(b.num_rows for b in batches), time.perf_counter() - started, statements)


def measure_small(config: SnowflakeTargetConfig, table: TableSchema, batches: list[pa.Table], path: str) -> Load:
    """Small change batches as VALUES (path `values`) or through a staging table (`insert`)."""
    values_max_rows = snowflake_target.VALUES_MAX_ROWS
    if path == "insert":
        snowflake_target.VALUES_MAX_ROWS = 0
    target = SnowflakeTarget(config.model_copy(update={"schema_": f"BENCH_SMALL_{path.upper()}"}))
    try:
        target.ensure_table(table)
        load = apply_batches(target, table, batches, path)
        assert target.count_current(table) == load.rows, "the target lost rows"
        return load
    finally:
        target.close()
        snowflake_target.VALUES_MAX_ROWS = values_max_rows


def measure(config: SnowflakeTargetConfig, table: TableSchema, batches: list[pa.Table], chunks: list[bytes],
            path: str) -> tuple[Load, Load]:
    target = SnowflakeTarget(config)
    try:
        target.ensure_table(table)
        stream = apply_batches(target, table, batches, path)
        started = time.perf_counter()
        count = target.apply_copy_text(table, iter(chunks), version=10**15)
        snapshot = Load(count, time.perf_counter() - started, [target.last_load_statements])
        assert target.last_load_path == path, target.last_load_path
        assert target.count_current(table) == stream.rows == count, "the target lost rows"
        return stream, snapshot
    finally:
        target.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch-rows", type=int, default=10_000)
    parser.add_argument("--insert-rows", type=int, default=10_000)
    parser.add_argument("--small-batches", type=int, default=100)
    parser.add_argument("--small-batch-rows", type=int, default=10)
    args = parser.parse_args()
    stop_on_signals()
    with services(nats=False) as started:
        table, chunks, insert_chunks = read_source(started.dsn, args.rows, min(args.rows, args.insert_rows))
        inputs = {"stage": (change_batches(table, chunks, args.batch_rows), chunks),
                  "insert": (change_batches(table, insert_chunks, args.batch_rows), insert_chunks)}
        server = FakesnowServer(started.directory / "fakesnow", free_port())
        pid = server.start()
        try:
            results = {}
            for path, min_rows in PATHS.items():
                env = server.environment()
                config = SnowflakeTargetConfig(
                    account=env["SIPHON_SNOWFLAKE_ACCOUNT"], user=env["SIPHON_SNOWFLAKE_USER"],
                    password=env["SIPHON_SNOWFLAKE_PASSWORD"], host=env["SIPHON_SNOWFLAKE_HOST"],
                    port=int(env["SIPHON_SNOWFLAKE_PORT"]), protocol=env["SIPHON_SNOWFLAKE_PROTOCOL"],
                    schema=f"BENCH_{path.upper()}", stage_min_rows=min_rows)
                load_average = os.getloadavg()[0]
                results[path] = (*measure(config, table, *inputs[path], path), load_average)
            small_rows = min(args.rows, args.small_batches * args.small_batch_rows)
            small_batches = change_batches(table, insert_chunks, args.small_batch_rows)[:args.small_batches]
            small = {path: measure_small(config.model_copy(update={"stage_min_rows": 1000}), table, small_batches,
                                         path) for path in ("values", "insert")}
        finally:
            FakesnowServer.stop(pid)
    (insert_stream, insert_snapshot, insert_load), (stage_stream, stage_snapshot, stage_load) = results.values()
    print_table(
        f"Snowflake loads into fakesnow: notes-shaped rows ({len(table.columns)} columns), {stage_stream.rows:,} by "
        f"stage and {insert_stream.rows:,} by INSERT, as change batches of {args.batch_rows:,} and as one snapshot "
        f"range (load average {insert_load:.1f} / {stage_load:.1f})",
        [
            ("change batches: statements per batch, stage", stage_stream.statements_text,
             f"insert: {insert_stream.statements_text}"),
            ("change batches: rows/s, stage", f"{stage_stream.rows_per_s:,.0f}",
             f"insert: {insert_stream.rows_per_s:,.0f}"),
            ("change batches: stage / insert", f"{stage_stream.rows_per_s / insert_stream.rows_per_s:.2f}", ""),
            ("snapshot range: statements, stage", stage_snapshot.statements_text,
             f"insert: {insert_snapshot.statements_text}"),
            ("snapshot range: rows/s, stage", f"{stage_snapshot.rows_per_s:,.0f}",
             f"insert: {insert_snapshot.rows_per_s:,.0f}"),
            ("snapshot range: stage / insert", f"{stage_snapshot.rows_per_s / insert_snapshot.rows_per_s:.2f}", ""),
            (f"{len(small_batches)} batches of {args.small_batch_rows}: statements per batch, values",
             small["values"].statements_text, f"insert: {small['insert'].statements_text}"),
            (f"{len(small_batches)} batches of {args.small_batch_rows}: batches/s, values",
             f"{len(small_batches) / small['values'].seconds:,.1f}",
             f"insert: {len(small_batches) / small['insert'].seconds:,.1f}"),
            ("small batches: values / insert", f"{small['insert'].seconds / small['values'].seconds:.2f}", ""),
        ],
    )
    print_json({
        "rows": args.rows, "insert_rows": insert_stream.rows, "batch_rows": args.batch_rows,
        "stage_batch_statements": max(stage_stream.statements), "insert_batch_statements": max(insert_stream.statements),
        "stage_batch_rows_per_s": stage_stream.rows_per_s, "insert_batch_rows_per_s": insert_stream.rows_per_s,
        "stage_snapshot_statements": stage_snapshot.statements[0],
        "insert_snapshot_statements": insert_snapshot.statements[0],
        "stage_snapshot_rows_per_s": stage_snapshot.rows_per_s, "insert_snapshot_rows_per_s": insert_snapshot.rows_per_s,
        "small_batches": len(small_batches), "small_rows": small_rows,
        "values_batch_statements": max(small["values"].statements),
        "small_insert_batch_statements": max(small["insert"].statements),
        "values_batches_per_s": len(small_batches) / small["values"].seconds,
        "small_insert_batches_per_s": len(small_batches) / small["insert"].seconds,
        "load_average": max(insert_load, stage_load),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
