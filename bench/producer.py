"""Producer throughput, memory and ack latency, beside pg_recvlogical reading the same WAL.

    python bench/producer.py [--changes 500000]

1. A notes-shaped table (30 columns, ~750-byte rows) gets N changes (inserts, updates, deletes) in
   transactions of 1 to 100 rows while two slots wait at the same LSN: then pg_recvlogical
   (pgoutput to /dev/null) and siphon-producer (decoded, packaged, published, acked) each read
   the same WAL, one after the other.
2. A single 1,000,000-row transaction passes through the producer: peak resident memory.
3. A steady 10,000 changes/s: publish-to-ack p99 from the producer's own histogram.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
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
    wait_for,
)

from siphon_core import naming
from siphon_stack.process import free_port, start_process, stop_pid

APPLICATION = "bench.producer"
WORKLOAD = """
do $$
declare
    total bigint := 0; i integer := 0; k integer; n bigint; next_id bigint;
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
        row = connection.execute("select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s",
                                 (slot,)).fetchone()
    return naming.parse_lsn(row[0]) if row and row[0] else 0


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
        wait_for(self.streaming, 60, what="producer streaming")

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

    def stop(self) -> float:
        rss = peak_rss_mb(self.pid) if self.pid else float("nan")
        if self.pid:
            stop_pid(self.pid, timeout=60)
        self.pid = None
        return rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=500_000)
    parser.add_argument("--big-transaction-rows", type=int, default=1_000_000)
    parser.add_argument("--steady-rate", type=int, default=10_000)
    parser.add_argument("--steady-seconds", type=int, default=20)
    args = parser.parse_args()

    with services(nats=True) as stack:
        dsn = stack.dsn
        create_notes_table(dsn)
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(NOTES_INSERT_SELECT.format(name="notes", first=1, last=100_000))
            publication = naming.publication_name(APPLICATION)
            connection.execute(f'create publication "{publication}" for table notes')
            connection.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')",
                               (naming.slot_name(APPLICATION),))
            connection.execute("select pg_create_logical_replication_slot('bench_recvlogical', 'pgoutput')")
        print(f"writing {args.changes:,} changes in transactions of 1 to 100 rows...", flush=True)
        started = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(WORKLOAD.format(changes=args.changes))
            changes = connection.execute("select changes from bench_total").fetchone()[0]
        end_lsn = current_lsn(dsn)
        print(f"  {changes:,} changes written in {time.monotonic() - started:.1f}s", flush=True)

        # pg_recvlogical: the physical reference, pgoutput to /dev/null.
        recv = recvlogical_binary(stack.postgres.bindir)
        started = time.monotonic()
        subprocess.run([recv, "-d", dsn, "--slot", "bench_recvlogical", "--start", "--no-loop",
                        "-E", naming.format_lsn(end_lsn), "-o", "proto_version=1",
                        "-o", f"publication_names={publication}", "-f", "/dev/null"], check=True)
        recv_seconds = time.monotonic() - started
        recv_rate = changes / recv_seconds

        producer = Producer(stack.directory, dsn, stack.nats.url)
        producer.start()  # timed from the moment it streams, so start-up is not counted
        producer_seconds = wait_for(lambda: confirmed_lsn(dsn, naming.slot_name(APPLICATION)) >= end_lsn, 600,
                                    interval=0.05, what="producer caught up")
        producer_rate = changes / producer_seconds
        producer.stop()

        # One large transaction: memory must stay bounded.
        print(f"one transaction of {args.big_transaction_rows:,} rows...", flush=True)
        with psycopg.connect(dsn, autocommit=True) as connection:
            first = connection.execute("select max(id) + 1 from notes").fetchone()[0]
            connection.execute(NOTES_INSERT_SELECT.format(name="notes", first=first,
                                                          last=first + args.big_transaction_rows - 1))
        big_end = current_lsn(dsn)
        producer.start()
        big_seconds = wait_for(lambda: confirmed_lsn(dsn, naming.slot_name(APPLICATION)) >= big_end, 900,
                               interval=0.2, what="large transaction acked")
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
        wait_for(lambda: confirmed_lsn(dsn, naming.slot_name(APPLICATION)) >= steady_end, 120, what="steady acked")
        p99 = producer.ack_p99_ms()
        producer.stop()

    print_table("siphon-producer vs pg_recvlogical on the same WAL", [
        ("changes", f"{changes:,}", ""),
        ("pg_recvlogical events/s", f"{recv_rate:,.0f}", "reference"),
        ("siphon-producer events/s", f"{producer_rate:,.0f}", f">= {0.8 * recv_rate:,.0f} and >= 40,000"),
        ("ratio", f"{producer_rate / recv_rate:.2f}", ">= 0.80"),
        (f"peak RSS, {args.big_transaction_rows:,}-row txn (MB)", f"{big_rss:,.0f}", "<= 300"),
        ("large txn events/s", f"{args.big_transaction_rows / big_seconds:,.0f}", ""),
        (f"publish-to-ack p99 at {args.steady_rate:,}/s (ms)", f"{p99:,.1f}", "<= 500"),
    ])
    print_json({"events_per_s": producer_rate, "pg_recvlogical_events_per_s": recv_rate,
                "ratio": producer_rate / recv_rate, "max_rss_mb_1m_txn": big_rss, "ack_p99_ms": p99})
    return 0


if __name__ == "__main__":
    sys.exit(main())
