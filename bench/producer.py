"""Producer throughput, memory and ack latency, beside pg_recvlogical reading the same WAL.

    python bench/producer.py [--changes 500000]

1. A notes-shaped table (30 columns, ~750-byte rows) gets N changes (inserts, updates, deletes) in
   transactions of 1 to 100 rows while three slots wait at the same LSN: then pg_recvlogical
   (pgoutput to /dev/null), siphon-producer (decoded, packaged, published, acked) and
   pg_recvlogical again each read the same WAL, one after the other. The reference is the faster
   pg_recvlogical pass. The producer is timed from the moment it streams until the slot confirms
   the end of the WAL; besides wall-clock rates, the CPU time per event of the producer and of
   each walsender is read from /proc (on a shared machine, wall-clock rates move with the load).
2. A single 1,000,000-row transaction passes through the producer: peak resident memory.
3. A steady 10,000 changes/s: publish-to-ack p99 from the producer's own histogram.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psycopg
import yaml
from common import (
    NOTES_INSERT_SELECT,
    create_notes_table,
    peak_rss_mb,
    print_json,
    print_table,
    services,
    stop_on_signals,
    wait_for,
)

from siphon_core import naming
from siphon_stack.process import free_port, start_process, stop_pid

APPLICATION = "bench.producer"
WORKLOAD = """
do $$
declare
    total bigint := 0; i bigint := 0; k integer; n bigint; next_id bigint;
begin
    select coalesce(max(id), 0) + 1 into next_id from notes;
    while total < {changes} loop
        i := i + 1;
        k := least(1 + (i * 37) % 100, {changes} - total);
        if i % 10 < 6 then
            insert into notes (note, noteable_type, author_id, project_id, commit_id, noteable_id, note_html, type)
            select repeat('a useful comment about the change ', 6) || g, 'MergeRequest', g % 5000, g % 700,
                   md5(g::text), g % 90000, '<p>comment ' || g || '</p>', 'DiffNote'
            from generate_series(next_id, next_id + k - 1) g;
            next_id := next_id + k;
        elsif i % 10 < 9 then
            update notes set updated_at = now(), note = note || '!'
            where id in (select id from notes where id >= (i * 7919) % next_id order by id limit k);
        else
            delete from notes where id in (select id from notes where id >= (i * 104729) % next_id order by id limit k);
        end if;
        get diagnostics n = row_count;
        total := total + n;
        commit;
    end loop;
    create table if not exists bench_total (changes bigint);
    insert into bench_total values (total);
    commit;
end $$;
"""


def current_lsn(dsn: str) -> int:
    with psycopg.connect(dsn) as connection:
        return naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])


def confirmed_lsn(dsn: str, slot: str) -> int:
    with psycopg.connect(dsn) as connection:
        return SlotWatch(connection, slot).confirmed()


class SlotWatch:
    """Polls a slot's confirmed position over one connection (a new one per poll costs a fork)."""

    def __init__(self, connection: psycopg.Connection, slot: str) -> None:
        self._connection = connection
        self._slot = slot

    def confirmed(self) -> int:
        row = self._connection.execute(
            "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (self._slot,)).fetchone()
        return naming.parse_lsn(row[0]) if row and row[0] else 0

    def wait_until(self, lsn: int, timeout: float, what: str) -> float:
        return wait_for(lambda: self.confirmed() >= lsn, timeout, interval=0.01, what=what)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class WalsenderCpu:
    """CPU time of the walsender serving `application_name`, sampled until it exits."""

    def __init__(self, dsn: str, application_name: str) -> None:
        self.seconds = float("nan")
        self._dsn = dsn
        self._application_name = application_name
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        pid = None
        with psycopg.connect(self._dsn, autocommit=True) as connection:
            deadline = time.monotonic() + 120
            while pid is None and time.monotonic() < deadline:
                row = connection.execute("select pid from pg_stat_activity where backend_type = 'walsender' "
                                         "and application_name like %s", (self._application_name,)).fetchone()
                pid = row[0] if row else None
                time.sleep(0.005)
        while pid is not None:
            seconds = cpu_seconds(pid)
            if seconds != seconds:  # gone
                return
            self.seconds = seconds
            time.sleep(0.02)

    def result(self) -> float:
        self._thread.join(120)
        return self.seconds


def recvlogical_binary(bindir: Path) -> str:
    for candidate in (bindir / "pg_recvlogical", shutil.which("pg_recvlogical")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise SystemExit("pg_recvlogical not found (package postgresql-client)")


class Producer:
    def __init__(self, directory: Path, dsn: str, nats_url: str) -> None:
        self.metrics_port = free_port()
        self.config = directory / "siphon.yaml"
        self.config.write_text(yaml.safe_dump({
            "application_identifier": APPLICATION,
            "source": {"dsn": dsn},
            "queue": {"url": nats_url},
            "producer": {"flush_interval_seconds": 0.5, "metrics_port": self.metrics_port,
                         "status_interval_seconds": 0.2},
            "tables": [{"name": "public.notes"}],
            "targets": {"clickhouse": {"url": "http://127.0.0.1:1"}},
        }))
        self.log = directory / "producer.log"
        self.pid: int | None = None

    def start(self) -> None:
        process = start_process("siphon-producer", [sys.executable, "-m", "producer_service.cli", "run", "--config",
                                                    str(self.config)], self.log)
        self.pid = process.pid
        wait_for(self.streaming, 60, interval=0.01, what="producer streaming")

    def streaming(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/healthz", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def metric_lines(self) -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode().splitlines()

    def ack_p99_ms(self) -> float:
        """p99 of publish-to-ack, linearly interpolated inside the histogram bucket that holds it."""
        buckets = []
        for line in self.metric_lines():
            if line.startswith("siphon_producer_publish_ack_seconds_bucket"):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                buckets.append((float("inf") if bound == "+Inf" else float(bound), float(line.rsplit(" ", 1)[1])))
        total = buckets[-1][1]
        rank = 0.99 * total
        previous_bound, previous_count = 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if bound == float("inf"):
                    return previous_bound * 1000
                share = (rank - previous_count) / max(count - previous_count, 1e-9)
                return (previous_bound + share * (bound - previous_bound)) * 1000
            previous_bound, previous_count = bound, count
        return float("nan")

    def counter(self, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in self.metric_lines() if line.startswith(name))

    def stop(self) -> float:
        rss = peak_rss_mb(self.pid) if self.pid else float("nan")
        if self.pid:
            stop_pid(self.pid, timeout=60)
        self.pid = None
        return rss


def recvlogical(binary: str, dsn: str, slot: str, publication: str, end_lsn: int) -> tuple[float, float]:
    """Seconds to read the slot up to `end_lsn` with pg_recvlogical, and its walsender's CPU seconds."""
    walsender = WalsenderCpu(dsn, "pg_recvlogical%")
    started = time.monotonic()
    subprocess.run([binary, "-d", dsn, "--slot", slot, "--start", "--no-loop", "-E", naming.format_lsn(end_lsn),
                    "-o", "proto_version=1", "-o", f"publication_names={publication}", "-f", "/dev/null"], check=True)
    return time.monotonic() - started, walsender.result()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=500_000)
    parser.add_argument("--big-transaction-rows", type=int, default=1_000_000)
    parser.add_argument("--steady-rate", type=int, default=10_000)
    parser.add_argument("--steady-seconds", type=int, default=20)
    args = parser.parse_args()
    stop_on_signals()
    load_before = os.getloadavg()[0]

    with services(nats=True) as stack:
        dsn = stack.dsn
        slot = naming.slot_name(APPLICATION)
        create_notes_table(dsn)
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(NOTES_INSERT_SELECT.format(name="notes", first=1, last=100_000))
            publication = naming.publication_name(APPLICATION)
            connection.execute(f'create publication "{publication}" for table notes')
            connection.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            for reference in ("bench_recvlogical_1", "bench_recvlogical_2"):
                connection.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (reference,))
        print(f"writing {args.changes:,} changes in transactions of 1 to 100 rows...", flush=True)
        started = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(WORKLOAD.format(changes=args.changes))
            changes = connection.execute("select changes from bench_total").fetchone()[0]
        end_lsn = current_lsn(dsn)
        print(f"  {changes:,} changes written in {time.monotonic() - started:.1f}s", flush=True)
        watch_connection = psycopg.connect(dsn, autocommit=True)
        watch = SlotWatch(watch_connection, slot)

        # pg_recvlogical: the physical reference, pgoutput to /dev/null; before and after the producer.
        recv = recvlogical_binary(stack.postgres.bindir)
        recv_seconds_1, recv_cpu_1 = recvlogical(recv, dsn, "bench_recvlogical_1", publication, end_lsn)

        producer = Producer(stack.directory, dsn, stack.nats.url)
        walsender = WalsenderCpu(dsn, f"siphon-producer {APPLICATION}")
        producer.start()  # timed from the moment it streams, so start-up is not counted
        assert producer.pid is not None
        cpu_before = cpu_seconds(producer.pid)
        producer_seconds = watch.wait_until(end_lsn, 600, "producer caught up")
        producer_cpu = cpu_seconds(producer.pid) - cpu_before
        producer_rate = changes / producer_seconds
        producer.stop()
        producer_walsender_cpu = walsender.result()
        recv_seconds_2, recv_cpu_2 = recvlogical(recv, dsn, "bench_recvlogical_2", publication, end_lsn)
        recv_rate = changes / min(recv_seconds_1, recv_seconds_2)

        # One large transaction: memory must stay bounded.
        print(f"one transaction of {args.big_transaction_rows:,} rows...", flush=True)
        with psycopg.connect(dsn, autocommit=True) as connection:
            first = connection.execute("select max(id) + 1 from notes").fetchone()[0]
            connection.execute(NOTES_INSERT_SELECT.format(name="notes", first=first,
                                                          last=first + args.big_transaction_rows - 1))
        big_end = current_lsn(dsn)
        producer.start()
        big_seconds = watch.wait_until(big_end, 900, "large transaction acked")
        big_rss = producer.stop()

        # Steady load: publish-to-ack latency.
        print(f"steady {args.steady_rate:,} changes/s for {args.steady_seconds}s...", flush=True)
        producer.start()
        stop = threading.Event()

        def steady() -> None:
            with psycopg.connect(dsn, autocommit=True) as connection:
                next_id = connection.execute("select max(id) + 1 from notes").fetchone()[0]
                per_tick = args.steady_rate // 10
                deadline = time.monotonic() + args.steady_seconds
                while time.monotonic() < deadline and not stop.is_set():
                    tick = time.monotonic()
                    for _ in range(max(1, per_tick // 100)):
                        connection.execute(NOTES_INSERT_SELECT.format(name="notes", first=next_id, last=next_id + 99))
                        next_id += 100
                    time.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))

        writer = threading.Thread(target=steady)
        writer.start()
        writer.join()
        steady_end = current_lsn(dsn)
        watch.wait_until(steady_end, 120, "steady acked")
        p99 = producer.ack_p99_ms()
        packages = producer.counter("siphon_producer_packages_total")
        producer.stop()
        watch_connection.close()

    per_event = 1e6 / changes
    print_table("siphon-producer vs pg_recvlogical on the same WAL", [
        ("changes", f"{changes:,}", ""),
        ("load average before the run", f"{load_before:.1f}", "2 cores"),
        ("pg_recvlogical events/s (before, after)",
         f"{changes / recv_seconds_1:,.0f}, {changes / recv_seconds_2:,.0f}", "reference: the faster"),
        ("siphon-producer events/s", f"{producer_rate:,.0f}", f">= {0.8 * recv_rate:,.0f} and >= 40,000"),
        ("ratio", f"{producer_rate / recv_rate:.2f}", ">= 0.80"),
        ("producer CPU per event (us)", f"{producer_cpu * per_event:.2f}", ""),
        ("walsender CPU per event (us): recvlogical, producer",
         f"{recv_cpu_1 * per_event:.2f}, {producer_walsender_cpu * per_event:.2f}", ""),
        (f"peak RSS, {args.big_transaction_rows:,}-row txn (MB)", f"{big_rss:,.0f}", "<= 300"),
        ("large txn events/s", f"{args.big_transaction_rows / big_seconds:,.0f}", ""),
        (f"publish-to-ack p99 at {args.steady_rate:,}/s (ms)", f"{p99:,.1f}", "<= 500"),
        (f"packages/s at {args.steady_rate:,}/s", f"{packages / args.steady_seconds:,.0f}", ""),
    ])
    print_json({"events_per_s": producer_rate, "pg_recvlogical_events_per_s": recv_rate,
                "ratio": producer_rate / recv_rate, "producer_cpu_us_per_event": producer_cpu * per_event,
                "max_rss_mb_1m_txn": big_rss, "ack_p99_ms": p99, "load_average": load_before})
    return 0


if __name__ == "__main__":
    sys.exit(main())
