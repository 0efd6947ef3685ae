"""Snapshot throughput and memory: every block range of a notes table into the embedded ClickHouse,
beside COPY of the same table to /dev/null.

    python bench/snapshot.py [--rows 2000000] [--blocks-per-partition 8192] [--repeat 1]

1. A notes-shaped table (30 columns) of N rows, vacuumed, frozen and read once so that every
   reader finds it in memory.
2. Reference: `COPY (SELECT * FROM notes) TO STDOUT` drained to nothing, by psql's `\\copy ... to
   '/dev/null'` and by psycopg; the faster of the two is the reference.
3. Every block-range partition of the table snapshotted into the embedded ClickHouse through the
   calls the partition asset makes (source.table_schema, ensure_table, spool.spooled_range,
   ClickHouseTarget.apply_copy_text), each worker a process of its own like a Dagster
   run: two at a time (the local `siphon_snapshot_clickhouse` pool limit), and one worker taking
   the partitions one after another. Dagster's own per-run overhead (launching the run, the event
   log) is not counted. Each load is repeated `--repeat` times; the best is reported.
   Beside the 2-at-a-time pass, the same partitions in one Dagster run, as a backfill from the UI
   or `siphon-dagster snapshot --partitions all` makes it, with the repository's dagster.yaml: the
   run reads as many partitions at a time as the pool lets it (its rate is the run's own, from its
   materialization; the whole command, Dagster's start-up included, is printed beside it). The run is compared with
   the 2-at-a-time pass loaded right beside it, in rounds (--repeat) where the two take turns at
   going first, before the 1-at-a-time pass: on a shared host the server's writes can cost it
   several times the kernel time from one load to the next (1.1 s, then 4 - 7 s, for the same
   2,000,000 rows) whichever way the ranges were read, and a load that always came later would
   pay for it.
4. One partition covering the whole table: the peak RSS of its process must not grow with the range.
After each load the `_current` view must hold exactly the source's rows. On a shared machine the
figures move with the load of other processes, so every load is timed from an idle server (no
merge and no change of its parts for QUIET_SECONDS: the merges an earlier load set off are done),
right after its own COPY reference (timed again by the reference's client), and printed with the
load average at its start and the server's CPU time, of it in the kernel. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import clickhouse_connect
import psycopg
from common import (
    NOTES_INSERT_SELECT,
    create_notes_table,
    peak_rss_mb,
    print_json,
    print_table,
    services,
    stop_on_signals,
)

from siphon_core import naming
from siphon_core.config import ClickHouseTargetConfig, TableConfig
from siphon_dagster import source
from siphon_dagster.partitions import BlockRange, parse_key, ranges_for
from siphon_dagster.resources import ClickHouseResource
from siphon_dagster.snapshot.reader import SnapshotProgress
from siphon_dagster.snapshot.spool import spooled_range
from siphon_dagster.targets.clickhouse import ClickHouseTarget

ROOT = Path(__file__).resolve().parent.parent
TABLE = TableConfig(name="public.notes")
POOL_LIMIT = 2  # dagster.yaml: concurrency.pools.default_limit, which each `siphon_snapshot_<target>` pool gets
LOAD_BATCH_ROWS = 250_000


@dataclass(frozen=True)
class Destination:
    dsn: str
    clickhouse_url: str
    database: str
    blocks_per_partition: int


@dataclass
class Run:
    rows: int
    seconds: float
    worker_peak_rss_mb: float
    partitions: int
    cpu_seconds: dict[str, float]  # by process: postgres, partition processes, siphon-clickhouse
    server_kernel_seconds: float  # of siphon-clickhouse's, in the kernel
    copy_rows_per_s: float = 0.0  # the COPY reference timed just before this load
    load_average: float = 0.0  # 1-minute, at the start of this load

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds

    @property
    def ratio(self) -> float:
        return self.rows_per_s / self.copy_rows_per_s


# -- the table and the reference -------------------------------------------------------------------


def load_notes(dsn: str, rows: int) -> int:
    """Creates and fills the table; returns its size in blocks."""
    create_notes_table(dsn)
    with psycopg.connect(dsn, autocommit=True) as connection:
        for first in range(1, rows + 1, LOAD_BATCH_ROWS):
            last = min(rows, first + LOAD_BATCH_ROWS - 1)
            connection.execute(NOTES_INSERT_SELECT.format(name="notes", first=first, last=last))
        # Frozen and hinted, so no reader pays for setting hint bits the first reader would set.
        connection.execute("vacuum (freeze, analyze) notes")
        connection.execute("checkpoint")
        return connection.execute("select pg_relation_size('notes') / current_setting('block_size')::int").fetchone()[0]


def source_count(dsn: str) -> int:
    with psycopg.connect(dsn) as connection:
        return connection.execute("select count(*) from notes").fetchone()[0]


def copy_with_psql(psql: str, dsn: str) -> float:
    started = time.monotonic()
    subprocess.run([psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-c",
                    "\\copy (select * from notes) to '/dev/null'"], check=True)
    return time.monotonic() - started


def copy_with_psycopg(dsn: str) -> tuple[float, int]:
    started = time.monotonic()
    size = 0
    with psycopg.connect(dsn) as connection, connection.cursor().copy("COPY (SELECT * FROM notes) TO STDOUT") as copy:
        while data := copy.read():
            size += len(data)
    return time.monotonic() - started, size


def psql_binary(bindir: Path) -> str | None:
    for candidate in (bindir / "psql", shutil.which("psql")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


# -- the snapshot, as a partition run does it ------------------------------------------------------


def snapshot_partition(destination: Destination, key: str) -> int:
    """The body of the partition asset (siphon_dagster.assets.build_target_asset), minus Dagster."""
    block_range = parse_key(key, destination.blocks_per_partition)
    target = ClickHouseResource(settings={"url": destination.clickhouse_url, "database": destination.database}).open_target()
    progress = SnapshotProgress()
    try:
        with source.connect(destination.dsn, autocommit=True) as catalog:
            table = source.table_schema(catalog, TABLE)
            target.ensure_table(table)
            with spooled_range(destination.dsn, table.schema, table.table, block_range,
                               lambda: source.table_schema(catalog, TABLE), progress) as reading:
                target.apply_copy_text(reading.table, reading.chunks(),
                                       naming.row_version(reading.consistent_point, 0))
    finally:
        target.close()
    return progress.rows


def _worker(destination: Destination, keys: multiprocessing.Queue, results: multiprocessing.Queue) -> None:
    # A run process has the code location loaded: count its imports in the worker's memory too.
    import siphon_dagster.assets  # noqa: F401

    try:
        results.put(("ready", None, None))
        cpu = cpu_seconds_self()
        while (key := keys.get()) is not None:
            results.put(("partition", key, snapshot_partition(destination, key)))
        results.put(("done", None, (peak_rss_mb(os.getpid()), cpu_seconds_self() - cpu)))
    except BaseException as error:
        results.put(("failed", None, f"{type(error).__name__}: {error}"))
        raise


def cpu_seconds_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name, from the state on."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int, children: bool = False) -> float:
    """CPU time of a process; with `children`, also of its exited children (PostgreSQL's backends)."""
    ticks = sum(int(value) for value in _stat_fields(pid)[11:15 if children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


def kernel_seconds(pid: int) -> float:
    """The part of a process's CPU time spent in the kernel (its writes, page faults)."""
    return int(_stat_fields(pid)[12]) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def snapshot_all(destination: Destination, block_ranges: list[BlockRange], workers: int, postgres_pid: int,
                 clickhouse_pid: int) -> Run:
    context = multiprocessing.get_context("spawn")
    keys, results = context.Queue(), context.Queue()
    processes = [context.Process(target=_worker, args=(destination, keys, results), name=f"snapshot-{i}", daemon=True)
                 for i in range(workers)]
    for process in processes:
        process.start()
    # Start-up (interpreter and imports) belongs to a run, not to the snapshot: the clock starts
    # once every worker is ready.
    rows, peaks, worker_cpu, ready = 0, [], 0.0, 0
    started = time.monotonic()
    server_cpu = postgres_cpu = server_kernel = 0.0
    while len(peaks) < workers:
        kind, _key, value = results.get(timeout=900)
        if kind == "failed":
            raise SystemExit(f"a snapshot worker failed: {value}")
        if kind == "ready":
            ready += 1
            if ready == workers:
                server_cpu, postgres_cpu = cpu_seconds(clickhouse_pid), cpu_seconds(postgres_pid, children=True)
                server_kernel = kernel_seconds(clickhouse_pid)
                started = time.monotonic()
                for block_range in block_ranges:
                    keys.put(block_range.key)
                for _ in processes:
                    keys.put(None)
        elif kind == "partition":
            rows += value
        else:
            peaks.append(value[0])
            worker_cpu += value[1]
    seconds = time.monotonic() - started
    cpu = {"postgres": cpu_seconds(postgres_pid, children=True) - postgres_cpu, "partition processes": worker_cpu,
           "siphon-clickhouse": cpu_seconds(clickhouse_pid) - server_cpu}
    for process in processes:
        process.join()
    return Run(rows, seconds, max(peaks), len(block_ranges), cpu, kernel_seconds(clickhouse_pid) - server_kernel)


def check_target(destination: Destination, expected: int) -> int:
    target = ClickHouseTarget(ClickHouseTargetConfig(url=destination.clickhouse_url, database=destination.database))
    try:
        with source.connect(destination.dsn) as connection:
            table = source.table_schema(connection, TABLE)
        counted = target.count_current(table)
    finally:
        target.close()
    if counted != expected:
        raise SystemExit(f"{destination.database}: the _current view holds {counted:,} rows, the source {expected:,}")
    return counted


def prepare(destination: Destination) -> None:
    """Creates the table once, as the first partition run would, so parallel workers do not race."""
    with source.connect(destination.dsn) as connection:
        table = source.table_schema(connection, TABLE)
    target = ClickHouseTarget(ClickHouseTargetConfig(url=destination.clickhouse_url, database=destination.database))
    try:
        target.ensure_table(table)
    finally:
        target.close()


# The embedded server's tables look for merges every 5 s when idle (siphon_stack.clickhouse.engine),
# so the merges of a load that just ended may not have started yet: the server counts as idle once
# it has run no merge and its parts stayed as they were for longer than that.
QUIET_SECONDS = 6.0


def wait_for_merges(clickhouse_url: str, timeout: float = 120.0) -> None:
    """Until the server has run no merge and changed no part for QUIET_SECONDS: a load must not pay
    for the merges of the load before it."""
    url = urlparse(clickhouse_url)
    client = clickhouse_connect.get_client(host=url.hostname, port=url.port)
    try:
        deadline = time.monotonic() + timeout
        quiet_since, last_parts = time.monotonic(), None
        while time.monotonic() < deadline:
            merges, parts = client.query(
                "SELECT (SELECT count() FROM system.merges), (SELECT count() FROM system.parts WHERE active)").result_rows[0]
            if merges or parts != last_parts:
                quiet_since, last_parts = time.monotonic(), parts
            elif time.monotonic() - quiet_since >= QUIET_SECONDS:
                return
            time.sleep(0.5)
    finally:
        client.close()


@dataclass
class DagsterRun:
    rows: int
    seconds: float  # the run's own load of every range (its materialization's `seconds`)
    command_seconds: float  # the command, Dagster's start-up and event log included
    parallel_line: str  # what the run said of its parallel reads
    server_cpu_seconds: float = 0.0  # siphon-clickhouse's during the command
    server_kernel_seconds: float = 0.0  # of it in the kernel
    copy_rows_per_s: float = 0.0  # the COPY reference timed just before it

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds


def dagster_backfill(stack: object, directory: Path, database: str, blocks_per_partition: int) -> DagsterRun:
    """Every partition in one Dagster run, as a backfill from the UI (single-run policy) or
    `siphon-dagster snapshot --partitions all` makes it, with the repository's dagster.yaml (its
    snapshot pool's limit of 2)."""
    import dagster as dg
    import yaml

    config_path = directory / "siphon-dagster.yaml"
    config_path.write_text(yaml.safe_dump({
        "application_identifier": "bench.snapshot", "source": {"dsn": stack.dsn},
        "queue": {"url": stack.nats.url},
        "tables": [{"name": TABLE.name, "blocks_per_partition": blocks_per_partition}],
        "targets": {"clickhouse": {"url": stack.clickhouse_url, "database": database}},
    }))
    home = directory / "dagster_home_backfill"
    home.mkdir(exist_ok=True)
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "siphon_dagster.cli", "--config", str(config_path)]
    subprocess.run([*command, "partitions", "refresh"], env=env, check=True, capture_output=True)
    started = time.monotonic()
    done = subprocess.run([*command, "snapshot", "--table", TABLE.name, "--partitions", "all"], env=env,
                          capture_output=True, text=True)
    command_seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"the Dagster snapshot run failed:\n{done.stdout}\n{done.stderr}")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        key = dg.AssetKey(["clickhouse", *TABLE.name.split(".")])
        event = instance.get_latest_materialization_event(key)
        metadata = event.asset_materialization.metadata
        (run,) = instance.get_runs()
        said = [e.user_message for e in instance.all_logs(run.run_id) if "at a time" in (e.user_message or "")]
    return DagsterRun(int(metadata["dagster/row_count"].value), float(metadata["seconds"].value), command_seconds,
                      said[0] if said else "read one partition at a time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--blocks-per-partition", type=int, default=TABLE.blocks_per_partition)
    parser.add_argument("--repeat", type=int, default=1, help="loads per worker count; the best is reported")
    parser.add_argument("--skip-whole-table", action="store_true", help="skip the one-partition memory check")
    args = parser.parse_args()
    stop_on_signals()
    load_before = os.getloadavg()[0]

    with services(nats=True, clickhouse=True) as stack:
        dsn, clickhouse_pid = stack.dsn, stack.clickhouse_pid or 0
        print(f"loading {args.rows:,} notes rows...", flush=True)
        started = time.monotonic()
        blocks = load_notes(dsn, args.rows)
        rows = source_count(dsn)
        print(f"  {rows:,} rows, {blocks:,} blocks in {time.monotonic() - started:.1f}s", flush=True)

        print("COPY to /dev/null (psql, psycopg)...", flush=True)
        copy_with_psycopg(dsn)  # warm-up: every later reader finds the table in memory
        psycopg_seconds, copy_bytes = min(copy_with_psycopg(dsn) for _ in range(2))
        psql = psql_binary(stack.postgres.bindir)
        postgres_cpu = cpu_seconds(stack.postgres_pid, children=True)
        psql_seconds = min(copy_with_psql(psql, dsn) for _ in range(2)) if psql else float("inf")
        copy_cpu = (cpu_seconds(stack.postgres_pid, children=True) - postgres_cpu) / (2 if psql else 1)
        copy_seconds = min(psql_seconds, psycopg_seconds)
        reference = "psql \\copy" if psql_seconds <= psycopg_seconds else "psycopg copy.read()"
        copy_rate = rows / copy_seconds

        def copy_reference() -> float:
            """COPY rows/s right now, by the reference's own client."""
            if psql and psql_seconds <= psycopg_seconds:
                return rows / min(copy_with_psql(psql, dsn) for _ in range(2))
            return rows / min(copy_with_psycopg(dsn)[0] for _ in range(2))

        server_rss_idle = rss_mb(clickhouse_pid)
        runs: dict[int, list[Run]] = {}
        block_ranges = ranges_for(blocks, args.blocks_per_partition)

        def load_pass(workers: int, database: str) -> Run:
            destination = Destination(dsn, stack.clickhouse_url, database, args.blocks_per_partition)
            prepare(destination)
            print(f"snapshot of {len(block_ranges)} partitions of {args.blocks_per_partition} blocks, "
                  f"{workers} at a time...", flush=True)
            wait_for_merges(stack.clickhouse_url)
            reference_now = copy_reference()
            load = os.getloadavg()[0]
            run = snapshot_all(destination, block_ranges, workers, stack.postgres_pid, clickhouse_pid)
            run.copy_rows_per_s, run.load_average = reference_now, load
            check_target(destination, rows)
            cpu = ", ".join(f"{run.cpu_seconds[name]:.1f}" for name in ("postgres", "partition processes",
                                                                       "siphon-clickhouse"))
            print(f"  {run.rows_per_s:,.0f} rows/s, {run.seconds:.1f}s, COPY {reference_now:,.0f} rows/s, "
                  f"ratio {run.ratio:.2f}, CPU s (postgres, partitions, server) {cpu} (the server's in the kernel "
                  f"{run.server_kernel_seconds:.1f}), load average {load:.1f}; current rows verified", flush=True)
            return run

        def dagster_pass(attempt: int) -> DagsterRun:
            print("one Dagster run of every partition (a backfill from the UI, `siphon-dagster snapshot`)...",
                  flush=True)
            database = f"bench_snapshot_dagster_{attempt}"
            home = stack.directory / f"dagster_{attempt}"
            home.mkdir()
            wait_for_merges(stack.clickhouse_url)
            run_reference = copy_reference()
            server_before = cpu_seconds(clickhouse_pid), kernel_seconds(clickhouse_pid)
            run = dagster_backfill(stack, home, database, args.blocks_per_partition)
            run.server_cpu_seconds = cpu_seconds(clickhouse_pid) - server_before[0]
            run.server_kernel_seconds = kernel_seconds(clickhouse_pid) - server_before[1]
            run.copy_rows_per_s = run_reference
            check_target(Destination(dsn, stack.clickhouse_url, database, args.blocks_per_partition), rows)
            print(f"  {run.rows_per_s:,.0f} rows/s ({run.parallel_line}), {run.command_seconds:.1f}s for the whole "
                  f"command, COPY {run_reference:,.0f} rows/s, the server's CPU s {run.server_cpu_seconds:.1f} (in "
                  f"the kernel {run.server_kernel_seconds:.1f}); current rows verified", flush=True)
            return run

        # Each round loads the Dagster run and the 2-at-a-time pass it is compared with side by side,
        # taking turns at going first, then 1 at a time.
        backfills: list[DagsterRun] = []
        for attempt in range(args.repeat):
            if attempt % 2:
                backfills.append(dagster_pass(attempt))
            runs.setdefault(POOL_LIMIT, []).append(load_pass(POOL_LIMIT, f"bench_snapshot_{POOL_LIMIT}_{attempt}"))
            if not attempt % 2:
                backfills.append(dagster_pass(attempt))
            runs.setdefault(1, []).append(load_pass(1, f"bench_snapshot_1_{attempt}"))
        runs = {workers: runs[workers] for workers in (1, POOL_LIMIT)}
        server_rss = peak_rss_mb(clickhouse_pid)
        backfill = max(backfills, key=lambda run: run.rows_per_s)
        pairs = list(zip(backfills, runs[POOL_LIMIT], strict=True))

        whole: Run | None = None
        if not args.skip_whole_table:
            destination = Destination(dsn, stack.clickhouse_url, "bench_snapshot_whole", blocks)
            prepare(destination)
            print(f"one partition of the whole table ({blocks:,} blocks)...", flush=True)
            wait_for_merges(stack.clickhouse_url)
            whole = snapshot_all(destination, [BlockRange(0, blocks - 1)], 1, stack.postgres_pid, clickhouse_pid)
            check_target(destination, rows)
            print(f"  {whole.rows_per_s:,.0f} rows/s, current rows verified", flush=True)
        server_rss_whole = peak_rss_mb(clickhouse_pid)
    load_after = os.getloadavg()[0]

    cores = len(os.sched_getaffinity(0))
    best = {workers: max(attempts, key=lambda run: run.ratio) for workers, attempts in runs.items()}
    overall = max(best.values(), key=lambda run: run.ratio)
    every_run = [run for attempts in runs.values() for run in attempts]
    worker_rss = max(run.worker_peak_rss_mb for run in [*every_run, *([whole] if whole else [])])
    figures = [
        ("rows", f"{rows:,}", ""),
        ("COPY text (MB, bytes/row)", f"{copy_bytes / 1e6:,.0f}, {copy_bytes / rows:,.0f}", ""),
        ("psql \\copy to /dev/null rows/s", f"{rows / psql_seconds:,.0f}" if psql else "n/a", ""),
        ("psycopg copy.read() drained rows/s", f"{rows / psycopg_seconds:,.0f}", ""),
        (f"COPY rows/s ({reference})", f"{copy_rate:,.0f}", "reference"),
        ("  postgres CPU s for one COPY", f"{copy_cpu:.1f}", ""),
    ]
    for workers, run in best.items():
        cpu = run.cpu_seconds
        total = sum(cpu.values())
        figures += [
            (f"snapshot rows/s, {workers} at a time ({run.partitions} partitions)", f"{run.rows_per_s:,.0f}",
             f">= {0.5 * run.copy_rows_per_s:,.0f}"),
            ("  COPY rows/s just before it", f"{run.copy_rows_per_s:,.0f}", "reference"),
            ("  ratio to COPY", f"{run.ratio:.2f}", ">= 0.50"),
            ("  peak RSS of a partition process (MB)", f"{run.worker_peak_rss_mb:,.0f}", "< 1,024"),
            ("  CPU s: postgres, partition processes, server",
             ", ".join(f"{cpu[name]:.1f}" for name in ("postgres", "partition processes", "siphon-clickhouse")), ""),
            (f"  CPU-bound ceiling on {cores} cores (rows/s)", f"{rows * cores / total:,.0f}",
             "all CPU time / cores"),
            ("  load average at its start", f"{run.load_average:.1f}", f"{cores} cores"),
        ]
        if len(runs[workers]) > 1:
            figures.append(("  every run's ratio (load average)",
                            " ".join(f"{r.ratio:.2f}({r.load_average:.1f})" for r in runs[workers]), ""))
    # Compared within each round, side by side, then averaged over the rounds.
    backfill_ratio = statistics.mean(run.rows_per_s / beside.rows_per_s for run, beside in pairs)
    figures += [
        ("one Dagster run of every partition: rows/s (best)", f"{backfill.rows_per_s:,.0f}",
         f"~ {best[POOL_LIMIT].rows_per_s:,.0f} ({POOL_LIMIT} at a time above)"),
        (f"  ratio to {POOL_LIMIT} at a time beside it (mean over {len(pairs)} rounds)", f"{backfill_ratio:.2f}",
         ">= 1.00"),
        ("  each round: the run / beside it, rows/s (the server's kernel CPU s)",
         "; ".join(f"{run.rows_per_s:,.0f} ({run.server_kernel_seconds:.1f}) / {beside.rows_per_s:,.0f} "
                   f"({beside.server_kernel_seconds:.1f}){', the run first' if i % 2 else ''}"
                   for i, (run, beside) in enumerate(pairs)), ""),
        ("  how it read them", backfill.parallel_line, ""),
        ("  the whole command (s), Dagster's start-up included", f"{backfill.command_seconds:.1f}", ""),
        ("  COPY rows/s just before it", f"{backfill.copy_rows_per_s:,.0f}", "reference"),
    ]
    if whole:
        figures += [
            (f"one partition of all {blocks:,} blocks: rows/s", f"{whole.rows_per_s:,.0f}", ""),
            ("  peak RSS of its process (MB)", f"{whole.worker_peak_rss_mb:,.0f}", "< 1,024"),
        ]
    figures += [
        ("RSS of siphon-clickhouse before the snapshots (MB)", f"{server_rss_idle:,.0f}", "reported"),
        ("peak RSS of siphon-clickhouse (MB), partitions", f"{server_rss:,.0f}", "reported"),
        ("  and after the whole-table partition", f"{server_rss_whole:,.0f}", "reported"),
        ("load average before, after (other processes)", f"{load_before:.1f}, {load_after:.1f}", f"{cores} cores"),
    ]
    print_table("Snapshot of every block range into the embedded ClickHouse vs COPY to /dev/null", figures)
    print_json({"rows_per_s": overall.rows_per_s, "copy_rows_per_s": overall.copy_rows_per_s, "ratio": overall.ratio,
                "peak_rss_mb": worker_rss, "load_average": overall.load_average,
                "dagster_run_rows_per_s": backfill.rows_per_s, "dagster_run_ratio": backfill_ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
