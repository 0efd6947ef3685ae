"""Streaming apply: sustained rate beside the producer's on the same workload, and freshness under load.

    python bench/streaming.py [--changes 2000000] [--warm-changes 50000] [--steady-rate 5000]
                               [--steady-seconds 60] [--flush-seconds 0.2] [--batch-wait-seconds 0.5]

1. Sustained apply rate. An empty notes-shaped table (30 columns, ~750-byte rows) gets N changes
   (inserts, updates, deletes in transactions of 1 to 100 rows, the workload of bench/producer.py)
   while the producer's slot waits. The real producer (`python -m producer_service.cli run`) then
   publishes the backlog; its rate is timed from the moment it streams until the slot confirms the
   end of the WAL, as in bench/producer.py. It is stopped, and a `StreamConsumer` (local Spark,
   batches cut by the default batch limits) applies the whole stream into the embedded ClickHouse with
   `stop_when_drained=True`. Apply events/s = events / wall time of that run. The backlog is long
   enough for several batches (about 230,000 changes each at the default limits), so the figure is
   the rate of a run in its stride: with two batches, as 450,000 changes make, it is mostly the
   first batch, whose Spark work overlaps no write, and the last, whose write overlaps no Spark
   work. The rate in its stride is also printed: the events of the batches after the first over
   the time between the first batch's ack and the last's, the pipeline full, as in a run that
   keeps up with a live producer. A streaming run is
   long-lived, so the timed backlog meets a warm one: the Spark session is started before (its
   start-up is reported on its own line) and a first, smaller backlog (--warm-changes) is
   published and applied the same way, untimed; `--warm-changes 0` times a cold run instead. The
   reference is the producer's rate: the apply must keep up with it, or lag grows without bound.
   Afterwards the `_current` view must hold the source's row count, every row must be identical
   (compared by digests of their text, as the row-parity check does), and sampled rows (present
   and deleted) must match.
2. Freshness. With the producer and a long-running `StreamConsumer` (a thread of this process)
   running on low-latency settings, a writer (a PL/pgSQL loop inside PostgreSQL, so a client's
   speed does not limit it) commits a steady load: every 100 ms, rate/100 transactions (50 at
   5,000/s) of one update, one delete and eight inserts, each insert stamping `resolved_at =
   clock_timestamp()` just before its commit; the achieved rate is reported. A poller
   asks the `_current` view for the greatest visible id every 200 ms through clickhouse-connect;
   ids are assigned in commit order and batches apply in stream order, so every new id up to it
   became visible by then: its freshness is (time the poll returned) - (its commit time). p50 and
   p95 over every inserted key (an upper bound: a poll adds up to its interval plus its duration).
CPU is read from /proc for this process (the driver), the Spark JVM, Spark's Python workers and the
embedded ClickHouse server. On a shared machine wall-clock figures move with the load: the load
average is printed beside them. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import clickhouse_connect
import psycopg
import yaml
from common import create_notes_table, print_json, print_table, services, stop_on_signals
from nats.js.errors import NotFoundError
from producer import WORKLOAD, Producer, SlotWatch, cpu_seconds, current_lsn

from siphon_core import naming
from siphon_core.config import ClickHouseTargetConfig, SparkConfig, StreamingConfig, TableConfig
from siphon_core.queue import JetStreamQueue, StreamSettings
from siphon_dagster import source
from siphon_dagster.checks import source_digest
from siphon_dagster.checks.digest import bucket_digits, mismatched_buckets
from siphon_dagster.streaming.consumer import StreamConsumer
from siphon_dagster.streaming.report import BatchReport
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.streaming.spark_session import get_spark_session, stop_spark_session
from siphon_dagster.targets.clickhouse import ClickHouseTarget

APPLICATION = "bench.streaming"
DATABASE = "bench"
TABLE = TableConfig(name="public.notes")
BACKLOG_BATCHES = StreamingConfig(batch_max_wait_seconds=0.5)  # a user's runs' limits by default
# Low-latency settings of the freshness run.
FRESH_FLUSH_SECONDS = 0.2  # producer: flush_interval_seconds
FRESH_STATUS_SECONDS = 0.2  # producer: status_interval_seconds
FRESH_BATCH_WAIT_SECONDS = 0.5  # consumer: batch_max_wait_seconds
FRESH_BATCH_MESSAGES = 2_000  # consumer: batch_max_messages (the wait, not the count, cuts batches here)
POLL_SECONDS = 0.2
TICK_SECONDS = 0.1

# A steady writer: every tick, `per_tick` transactions of one update (an id inserted ~1000 earlier),
# one delete (the next surviving row of the backlog phase) and eight inserts stamped with
# clock_timestamp(), committed at once.
STEADY_WRITER = """
do $$
declare
    started timestamptz := clock_timestamp(); next_tick timestamptz := clock_timestamp();
    changes bigint := 0; transactions bigint := 0; n bigint; last_id bigint; victim bigint := 0; gone bigint;
    first_new bigint;
begin
    select coalesce(max(id), 0) + 1 into first_new from notes;
    last_id := first_new - 1;
    while clock_timestamp() < started + make_interval(secs => {seconds}) loop
        for j in 1..{per_tick} loop
            update notes set updated_at = now(), note = note || '!' where id = last_id - 997 and id >= first_new;
            get diagnostics n = row_count; changes := changes + n;
            delete from notes where id = (select id from notes where id > victim and id < first_new order by id limit 1)
                returning id into gone;
            get diagnostics n = row_count; changes := changes + n;
            victim := coalesce(gone, victim);
            insert into notes (note, noteable_type, author_id, project_id, commit_id, noteable_id, note_html, type,
                               resolved_at)
            select repeat('a fresh comment about the change ', 6) || g, 'MergeRequest', g % 5000, g % 700, md5(g::text),
                   g % 90000, '<p>fresh ' || g || '</p>', 'DiffNote', clock_timestamp()
            from generate_series(1, 8) g;
            get diagnostics n = row_count; changes := changes + n;
            last_id := currval('notes_id_seq');
            commit;
            transactions := transactions + 1;
        end loop;
        -- An absolute schedule keeps the mean rate; a writer more than a second late starts afresh.
        next_tick := greatest(next_tick + interval '{tick_ms} milliseconds', clock_timestamp() - interval '1 second');
        perform pg_sleep(greatest(0, extract(epoch from next_tick - clock_timestamp())));
    end loop;
    create table if not exists bench_steady (changes bigint, transactions bigint, first_id bigint, seconds float8);
    insert into bench_steady values (changes, transactions, first_new, extract(epoch from clock_timestamp() - started));
    commit;
end $$;
"""


# -- processes and their CPU -----------------------------------------------------------------------


class StreamingProducer(Producer):
    """bench/producer.py's helper with this benchmark's application and flush settings."""

    def __init__(self, directory: Path, dsn: str, nats_url: str, flush_interval_seconds: float,
                 status_interval_seconds: float) -> None:
        super().__init__(directory, dsn, nats_url)
        self.flush_interval_seconds = flush_interval_seconds
        self.config.write_text(yaml.safe_dump({
            "application_identifier": APPLICATION,
            "source": {"dsn": dsn},
            "queue": {"url": nats_url},
            "producer": {"flush_interval_seconds": flush_interval_seconds, "metrics_port": self.metrics_port,
                         "status_interval_seconds": status_interval_seconds},
            "tables": [{"name": TABLE.name}],
        }))


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
            tree.setdefault(parent, []).append(int(entry))
    return tree


def tree_cpu_seconds(pid: int | None, seen: dict[int, tuple[bool, float]] | None = None) -> tuple[float, float]:
    """CPU seconds of a process and its descendants: of the processes that are not Python, and of
    those that are (Spark's Python workers). With `seen` (pid -> (is Python, CPU seconds)), a
    process that has exited since an earlier call still counts with what it had used then: Spark
    stops idle Python workers, and a sum over the live ones only would fall between two samples."""
    if not pid:
        return float("nan"), float("nan")
    seen = {} if seen is None else seen
    tree, todo = _children(), [pid]
    while todo:
        current = todo.pop()
        seconds = cpu_seconds(current)
        try:
            with open(f"/proc/{current}/comm") as comm:
                is_python = comm.read().startswith("python")
        except FileNotFoundError:
            continue
        if seconds == seconds:
            seen[current] = (is_python, max(seconds, seen.get(current, (is_python, 0.0))[1]))
        todo += tree.get(current, [])
    python = sum(used for is_python, used in seen.values() if is_python)
    return sum(used for is_python, used in seen.values() if not is_python), python


@dataclass(frozen=True)
class CpuSample:
    driver: float  # this process: the driver's Python side (and, in the freshness run, the poller)
    jvm: float  # the Spark JVM
    workers: float  # Spark's Python workers (the decode)
    clickhouse: float  # the embedded ClickHouse server

    @property
    def consumer(self) -> float:
        return self.driver + self.jvm + self.workers

    def __sub__(self, other: CpuSample) -> CpuSample:
        return CpuSample(self.driver - other.driver, self.jvm - other.jvm, self.workers - other.workers,
                         self.clickhouse - other.clickhouse)

    def per_event_us(self, events: int) -> str:
        scale = 1e6 / max(1, events)
        return (f"{self.consumer * scale:.1f} = {self.driver * scale:.1f}+{self.jvm * scale:.1f}+"
                f"{self.workers * scale:.1f}, {self.clickhouse * scale:.1f}")


@dataclass
class ConsumerCpu:
    """CPU of the streaming run's processes and of the embedded ClickHouse server beside it."""

    spark_pid: int | None
    clickhouse_pid: int | None
    _spark_seen: dict[int, tuple[bool, float]] = field(default_factory=dict)
    _clickhouse_seen: dict[int, tuple[bool, float]] = field(default_factory=dict)

    def sample(self) -> CpuSample:
        jvm, workers = tree_cpu_seconds(self.spark_pid, self._spark_seen)
        clickhouse = sum(tree_cpu_seconds(self.clickhouse_pid, self._clickhouse_seen))
        return CpuSample(cpu_seconds(os.getpid()), jvm, workers, clickhouse)


def spark_jvm_pid(spark) -> int | None:
    gateway = getattr(spark.sparkContext, "_gateway", None)
    process = getattr(gateway, "proc", None)
    return getattr(process, "pid", None)


# -- queue --------------------------------------------------------------------------------------------


def stream_messages(nats_url: str) -> int:
    """Messages in the application's stream (0 before the producer created it)."""

    async def run() -> int:
        queue = JetStreamQueue(nats_url, StreamSettings(APPLICATION), name="bench")
        await queue.connect()
        try:
            info = await queue.js.stream_info(queue.settings.stream)
            return int(info.state.messages)
        except NotFoundError:
            return 0
        finally:
            await queue.close()

    return asyncio.run(run())


def make_consumer(nats_url: str, clickhouse_url: str, dsn: str, spark, streaming: StreamingConfig,
                  ) -> tuple[StreamConsumer, ClickHouseTarget]:
    target = ClickHouseTarget(ClickHouseTargetConfig(url=clickhouse_url, database=DATABASE))
    consumer = StreamConsumer(JetStreamQueue(nats_url, StreamSettings(APPLICATION), name="bench-streaming"),
                              target, TABLE, spark, streaming, source=SourceRowReader(dsn))
    return consumer, target


@dataclass
class Batches:
    """The `on_batch` callback: keeps every BatchReport."""

    reports: list[BatchReport] = field(default_factory=list)
    verbose: bool = False
    reported_at: list[float] = field(default_factory=list)  # time.monotonic() of each report

    def __call__(self, report: BatchReport) -> None:
        self.reports.append(report)
        self.reported_at.append(time.monotonic())
        if self.verbose:
            steps = " ".join(f"{name} {seconds:.2f}" for name, seconds in report.seconds.items())
            early = ", prepared while the batch before was written" if report.prepared_early else ""
            print(f"    batch {len(self.reports)}: {report.messages} messages, {report.events:,} events, "
                  f"{report.latency_seconds:.2f}s ({steps}), lag {report.lag_newest_seconds:.1f}s{early}", flush=True)

    @property
    def events(self) -> int:
        return sum(r.events for r in self.reports)

    @property
    def rows_written(self) -> int:
        return sum(r.rows_applied for r in self.reports)

    def seconds(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for report in self.reports:
            for name, seconds in report.seconds.items():
                totals[name] = totals.get(name, 0.0) + seconds
        return totals

    def breakdown(self, per_batch: bool = False) -> str:
        totals = self.seconds()
        count = max(1, len(self.reports)) if per_batch else 1
        order = ["pull", "schema", "spark", "merge", "toast", "apply", "ack"]
        return " ".join(f"{name} {totals[name] / count:.{2 if per_batch else 1}f}"
                        for name in order + sorted(set(totals) - set(order)) if name in totals)


# -- phase 1: the backlog ----------------------------------------------------------------------------


@dataclass
class Backlog:
    changes: int
    write_seconds: float
    producer_seconds: float
    producer_cpu: float
    messages: int
    batch_limits: str
    spark_start_seconds: float
    apply_seconds: float
    batches: Batches
    cpu: CpuSample
    source_rows: int
    target_rows: int
    sampled: int
    mismatches: list[str]
    buckets: tuple[int, int]  # every row compared by digests: (buckets, buckets that differ)
    warm_changes: int = 0
    load_average: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-minute, as the phase ends

    @property
    def producer_rate(self) -> float:
        return self.changes / self.producer_seconds

    @property
    def apply_rate(self) -> float:
        return self.batches.events / self.apply_seconds

    @property
    def stride_rate(self) -> float | None:
        """Events of the batches after the first over the time between the first batch's ack and
        the last's: the rate with the pipeline full (each batch's Spark work overlapped the write
        before it), which a long-running run keeps. None with fewer than 3 batches."""
        reports, acked = self.batches.reports, self.batches.reported_at
        if len(reports) < 3 or acked[-1] <= acked[0]:
            return None
        return sum(r.events for r in reports[1:]) / (acked[-1] - acked[0])


def publish_backlog(stack, slot: str, changes_wanted: int) -> tuple[int, float, float, float]:
    """Writes the workload while the slot waits, then lets the producer publish it; returns the
    changes, the seconds to write them, the producer's seconds and CPU seconds."""
    dsn = stack.dsn
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("drop table if exists bench_total")
        connection.execute(WORKLOAD.format(changes=changes_wanted))
        changes = connection.execute("select changes from bench_total").fetchone()[0]
    end_lsn = current_lsn(dsn)
    write_seconds = time.monotonic() - started
    producer = StreamingProducer(stack.directory, dsn, stack.nats.url, 0.5, 0.2)
    try:
        with psycopg.connect(dsn, autocommit=True) as watch_connection:
            producer.start()
            assert producer.pid is not None
            cpu_before = cpu_seconds(producer.pid)
            producer_seconds = SlotWatch(watch_connection, slot).wait_until(end_lsn, 600, "producer caught up")
            producer_cpu = cpu_seconds(producer.pid) - cpu_before
    finally:
        producer.stop()
    return changes, write_seconds, producer_seconds, producer_cpu


def run_backlog(stack, spark, spark_start_seconds: float, changes_wanted: int, warm_changes: int,
                limits: StreamingConfig = BACKLOG_BATCHES) -> Backlog:
    dsn = stack.dsn
    create_notes_table(dsn)
    slot = naming.slot_name(APPLICATION)
    with psycopg.connect(dsn, autocommit=True) as connection:
        # A vacuum of the backlog's dead rows would land at random in one timed phase or the other,
        # on the same 2 cores: both are timed without it.
        connection.execute("alter table notes set (autovacuum_enabled = false)")
        connection.execute(f'create publication "{naming.publication_name(APPLICATION)}" for table notes')
        connection.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    consumer, target = make_consumer(stack.nats.url, stack.clickhouse_url, dsn, spark, limits)
    if warm_changes:
        # A streaming run is a long-lived process: the timed backlog meets a consumer that has
        # applied batches before (its Python workers, JVM, schema and target table warm).
        print(f"warming up: {warm_changes:,} changes published and applied first (not timed)...", flush=True)
        publish_backlog(stack, slot, warm_changes)
        consumer.run(stop_when_drained=True)
    messages_before = stream_messages(stack.nats.url)
    print(f"writing {changes_wanted:,} changes in transactions of 1 to 100 rows; then the producer publishes them...",
          flush=True)
    changes, write_seconds, producer_seconds, producer_cpu = publish_backlog(stack, slot, changes_wanted)
    messages = stream_messages(stack.nats.url) - messages_before
    batch_limits = f"{limits.batch_max_messages} messages / {limits.batch_max_bytes / 1e6:g} MB"
    print(f"  {changes:,} changes written in {write_seconds:.1f}s, published in {producer_seconds:.1f}s "
          f"({changes / producer_seconds:,.0f} events/s), {messages:,} messages; applying in batches of at most "
          f"{batch_limits}...", flush=True)

    cpu = ConsumerCpu(spark_jvm_pid(spark), stack.clickhouse_pid)
    batches = Batches(verbose=True)
    try:
        cpu_before = cpu.sample()
        started = time.monotonic()
        consumer.run(stop_when_drained=True, on_batch=batches)
        apply_seconds = time.monotonic() - started
        last_acked = batches.reported_at[-1] - started if batches.reported_at else 0.0
        cpu_used = cpu.sample() - cpu_before
        print(f"  applied {batches.events:,} events in {apply_seconds:.2f}s ({len(batches.reports)} batches, the last "
              f"acked at {last_acked:.2f}s); verifying...", flush=True)
        source_rows, target_rows, sampled, mismatches = verify(dsn, target)
        buckets = compare_every_row(dsn, target)
    finally:
        target.close()
    return Backlog(changes, write_seconds, producer_seconds, producer_cpu, messages, batch_limits,
                   spark_start_seconds, apply_seconds, batches, cpu_used, source_rows, target_rows, sampled, mismatches,
                   buckets, warm_changes=warm_changes)


def compare_every_row(dsn: str, target: ClickHouseTarget) -> tuple[int, int]:
    """Every row of the source against the `_current` view, as the row-parity check compares them
    (an md5 of each row's PostgreSQL text, summed per bucket of keys): (buckets, buckets that
    differ). The source is quiet by then, so a difference is a wrong row, not one in flight."""
    with source.connect(dsn) as connection:
        schema = source.table_schema(connection, TABLE)
    with source_digest.snapshot_read(dsn) as read:
        digits = bucket_digits(source_digest.count_rows(read.connection, schema))
        at_source = source_digest.bucket_digests(read.connection, schema, digits)
    at_target = target.bucket_digests(schema, digits)
    return len(at_source.keys() | at_target.keys()), len(mismatched_buckets(at_source, at_target))


def verify(dsn: str, target: ClickHouseTarget, samples: int = 200) -> tuple[int, int, int, list[str]]:
    """Row counts of source and `_current` view, and sampled rows compared as PostgreSQL text:
    surviving rows must be equal, deleted ids must be absent."""
    with source.connect(dsn) as connection:
        schema = source.table_schema(connection, TABLE)
        source_rows = connection.execute("select count(*) from public.notes").fetchone()[0]
        top = connection.execute("select max(id) from public.notes").fetchone()[0] or 0
    target_rows = target.count_current(schema)
    rng = random.Random(7)
    keys = [(str(k),) for k in sorted(rng.sample(range(1, top + 1), min(samples, top)))]
    columns = [c.name for c in schema.columns if not c.primary_key]
    reader = SourceRowReader(dsn)
    try:
        expected = reader.read_rows(schema, keys, columns)
    finally:
        reader.close()
    found = target.read_current_values(schema, keys, columns)
    mismatches = []
    for key in keys:
        want, got = expected.get(key), found.get(key)
        if want != got:
            differing = sorted(c for c in columns if (want or {}).get(c) != (got or {}).get(c))
            mismatches.append(f"id {key[0]}: " + ("present only in the source" if got is None else
                                                  "deleted in the source, present in the target" if want is None
                                                  else f"columns {differing} differ"))
    return source_rows, target_rows, len(keys), mismatches


# -- phase 2: freshness ----------------------------------------------------------------------------------


@dataclass
class Freshness:
    flush_seconds: float
    batch_wait_seconds: float
    asked_rate: int
    changes: int
    transactions: int
    seconds: float
    latencies: list[float]
    polls: list[tuple[float, int, float]]  # (returned at, greatest visible id, query seconds)
    batches: Batches
    drain_seconds: float
    cpu: CpuSample
    producer_cpu: float
    source_rows: int
    target_rows: int
    sampled: int
    mismatches: list[str]
    load_average: float = field(default_factory=lambda: os.getloadavg()[0])

    @property
    def rate(self) -> float:
        return self.changes / self.seconds

    def percentile(self, share: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class Poller:
    """Greatest visible id of the `_current` view every POLL_SECONDS, from a thread of its own."""

    def __init__(self, clickhouse_url: str, after_id: int) -> None:
        host, port = clickhouse_url.rsplit("//", 1)[1].split(":")
        self._client = clickhouse_connect.get_client(host=host, port=int(port))
        self._view = f"{DATABASE}.public__notes_current"
        self.visible = after_id
        self.polls: list[tuple[float, int, float]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            next_poll = time.monotonic()
            while not self._stop.is_set():
                asked = time.monotonic()
                top = self._client.query(f"SELECT max(id) FROM {self._view} WHERE id > {{after:Int64}}",
                                         parameters={"after": self.visible}).result_rows[0][0]
                returned = time.time()
                self.polls.append((returned, int(top or 0), time.monotonic() - asked))
                if top and top > self.visible:
                    self.visible = int(top)
                next_poll = max(next_poll + POLL_SECONDS, time.monotonic())
                self._stop.wait(next_poll - time.monotonic())
        except BaseException as error:  # reported by the main thread
            self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._client.close()


def run_freshness(stack, spark, rate: int, seconds: int, flush_seconds: float, batch_wait_seconds: float,
                  ) -> Freshness:
    dsn = stack.dsn
    producer = StreamingProducer(stack.directory, dsn, stack.nats.url, flush_seconds, FRESH_STATUS_SECONDS)
    consumer, target = make_consumer(
        stack.nats.url, stack.clickhouse_url, dsn, spark,
        StreamingConfig(batch_max_messages=FRESH_BATCH_MESSAGES, batch_max_wait_seconds=batch_wait_seconds))
    batches = Batches()
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            consumer.run(on_batch=batches)
        except BaseException as error:
            failure.append(error)

    cpu = ConsumerCpu(spark_jvm_pid(spark), stack.clickhouse_pid)
    thread = threading.Thread(target=consume, name="stream-consumer", daemon=True)
    poller: Poller | None = None
    per_tick = max(1, round(rate * TICK_SECONDS / 10))
    try:
        producer.start()
        assert producer.pid is not None
        thread.start()
        with psycopg.connect(dsn, autocommit=True) as connection:
            first_id = connection.execute("select coalesce(max(id), 0) + 1 from notes").fetchone()[0]
        poller = Poller(stack.clickhouse_url, first_id - 1)
        print(f"steady writer: {per_tick} transactions of 10 changes every {TICK_SECONDS * 1000:.0f} ms for "
              f"{seconds}s (producer flush {flush_seconds}s, consumer batch wait {batch_wait_seconds}s)...",
              flush=True)
        cpu_before = cpu.sample()
        producer_before = cpu_seconds(producer.pid)
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(STEADY_WRITER.format(seconds=seconds, per_tick=per_tick,
                                                    tick_ms=round(TICK_SECONDS * 1000)))
            changes, transactions, first_new, written_seconds = connection.execute(
                "select changes, transactions, first_id, seconds from bench_steady").fetchone()
            commits = dict(connection.execute(
                "select id, extract(epoch from resolved_at)::float8 from notes where id >= %s", (first_new,)).fetchall())
        last_id = max(commits) if commits else first_new - 1
        written_at = time.monotonic()
        while poller.visible < last_id:
            if failure or poller.error or not thread.is_alive():
                raise RuntimeError(f"freshness run failed: {(failure or [poller.error])[0]!r}")
            if time.monotonic() - written_at > 180:
                raise TimeoutError(f"id {last_id} not visible 180 s after the writer stopped")
            time.sleep(0.05)
        drain_seconds = time.monotonic() - written_at
        cpu_used = cpu.sample() - cpu_before
        producer_cpu = cpu_seconds(producer.pid) - producer_before
        # The newest id is visible; the rest of its transaction may sit in the next batch.
        checker = ClickHouseTarget(ClickHouseTargetConfig(url=stack.clickhouse_url, database=DATABASE))
        try:
            deadline = time.monotonic() + 30
            while True:
                verified = verify(dsn, checker)
                if (verified[0] == verified[1] and not verified[3]) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        finally:
            checker.close()
    finally:
        if poller is not None:
            poller.stop()
        consumer.stop()
        thread.join(120)
        target.close()
        producer.stop()
    if failure:
        raise RuntimeError("the streaming run failed") from failure[0]
    latencies, previous = [], first_new - 1
    for returned, top, _ in poller.polls:
        if top > previous:
            latencies += [returned - commits[i] for i in range(previous + 1, top + 1) if i in commits]
            previous = top
    return Freshness(flush_seconds, batch_wait_seconds, rate, changes, transactions, written_seconds,
                     latencies, poller.polls, batches, drain_seconds, cpu_used, producer_cpu, *verified)


# -- report ------------------------------------------------------------------------------------------------


def report(backlog: Backlog, fresh: Freshness, load_before: float) -> None:
    per_event = 1e6 / backlog.changes
    reports = backlog.batches.reports
    first = reports[0] if reports else None
    verdict = "ok" if backlog.source_rows == backlog.target_rows and not backlog.mismatches else "MISMATCH"
    busy = fresh.batches.reports
    applied_busy = [r for r in busy if r.events]
    poll_seconds = [p[2] for p in fresh.polls]
    mean = statistics.fmean
    stride = backlog.stride_rate
    print_table("streaming apply: backlog rate beside the producer, freshness under steady load", [
        ("load average: before, after backlog, after freshness",
         f"{load_before:.1f}, {backlog.load_average:.1f}, {fresh.load_average:.1f}", "2 cores"),
        ("backlog: changes (events)", f"{backlog.changes:,}", ""),
        ("producer events/s (same workload)", f"{backlog.producer_rate:,.0f}", "reference"),
        ("producer CPU per event (us)", f"{backlog.producer_cpu * per_event:.1f}", ""),
        ("Spark session start-up (s)", f"{backlog.spark_start_seconds:.1f}", "not counted below"),
        ("apply: changes applied before, untimed (a running run)", f"{backlog.warm_changes:,}", ""),
        ("apply: events applied", f"{backlog.batches.events:,}", f"= {backlog.changes:,}"),
        ("apply: stream messages, batch limits", f"{backlog.messages:,}, {backlog.batch_limits}",
         "the default"),
        ("apply: batches, first batch (s)", f"{len(reports)}, {first.latency_seconds if first else 0:.1f}", ""),
        ("apply: rows written (after each batch's fold)",
         f"{backlog.batches.rows_written:,}", ""),
        ("apply events/s (whole run)", f"{backlog.apply_rate:,.0f}", f">= {backlog.producer_rate:,.0f}"),
        ("apply / producer", f"{backlog.apply_rate / backlog.producer_rate:.2f}", ">= 1.00"),
        ("apply events/s in its stride (batches after the first, between acks)",
         f"{stride:,.0f}" if stride else "n/a", f">= {backlog.producer_rate:,.0f}"),
        ("apply in its stride / producer", f"{stride / backlog.producer_rate:.2f}" if stride else "n/a", ">= 1.00"),
        ("apply seconds by step (sum over batches)", backlog.batches.breakdown(), f"of {backlog.apply_seconds:.1f} s"),
        ("apply CPU us/event: all = driver+JVM+workers, ClickHouse", backlog.cpu.per_event_us(backlog.changes), ""),
        ("rows: source, _current view", f"{backlog.source_rows:,}, {backlog.target_rows:,}", "equal"),
        ("every row compared (md5 of its text, buckets of keys that differ)",
         f"{backlog.buckets[1]} of {backlog.buckets[0]:,}", "0"),
        ("sampled ids compared (present and deleted)", f"{backlog.sampled - len(backlog.mismatches)}/{backlog.sampled}",
         f"{verdict}"),
        ("freshness: producer flush_interval_seconds", f"{fresh.flush_seconds}", ""),
        ("freshness: consumer batch_max_wait_seconds", f"{fresh.batch_wait_seconds}", ""),
        ("freshness: writer changes/s (achieved)", f"{fresh.rate:,.0f}", f"{fresh.asked_rate:,} asked"),
        ("freshness: writer transactions/s", f"{fresh.transactions / fresh.seconds:,.0f}", ""),
        ("freshness: keys measured", f"{len(fresh.latencies):,}", ""),
        ("freshness p50 (s)", f"{fresh.percentile(0.50):.2f}", ""),
        ("freshness p95 (s)", f"{fresh.percentile(0.95):.2f}", "<= 5"),
        ("freshness max (s)", f"{max(fresh.latencies, default=float('nan')):.2f}", ""),
        ("freshness: batches, events/batch, batch seconds (mean)",
         f"{len(applied_busy)}, {mean([r.events for r in applied_busy]) if applied_busy else 0:,.0f}, "
         f"{mean([r.latency_seconds for r in applied_busy]) if applied_busy else 0:.2f}", ""),
        ("freshness: batch seconds by step (mean)", fresh.batches.breakdown(per_batch=True), ""),
        ("freshness: poll query ms (mean, max)",
         f"{mean(poll_seconds) * 1000 if poll_seconds else 0:.0f}, {max(poll_seconds, default=0) * 1000:.0f}",
         f"every {POLL_SECONDS * 1000:.0f} ms"),
        ("freshness: rows after it: source, _current view; sampled ids",
         f"{fresh.source_rows:,}, {fresh.target_rows:,}; {fresh.sampled - len(fresh.mismatches)}/{fresh.sampled}",
         "ok" if fresh.source_rows == fresh.target_rows and not fresh.mismatches else "MISMATCH"),
        ("freshness: CPU cores used: consumer, ClickHouse, producer",
         f"{fresh.cpu.consumer / fresh.seconds:.2f}, {fresh.cpu.clickhouse / fresh.seconds:.2f}, "
         f"{fresh.producer_cpu / fresh.seconds:.2f}", "of 2"),
    ])
    for mismatch in (backlog.mismatches + fresh.mismatches)[:10]:
        print(f"  mismatch: {mismatch}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=2_000_000)
    parser.add_argument("--warm-changes", type=int, default=50_000,
                        help="changes applied before the timed backlog (0: time a cold run)")
    parser.add_argument("--steady-rate", type=int, default=5_000)
    parser.add_argument("--steady-seconds", type=int, default=60)
    parser.add_argument("--flush-seconds", type=float, default=FRESH_FLUSH_SECONDS,
                        help="producer flush_interval_seconds of the freshness run")
    parser.add_argument("--batch-wait-seconds", type=float, default=FRESH_BATCH_WAIT_SECONDS,
                        help="consumer batch_max_wait_seconds of the freshness run")
    parser.add_argument("--batch-max-bytes", type=int, default=BACKLOG_BATCHES.batch_max_bytes,
                        help="streaming.batch_max_bytes of the timed backlog's run (default: a user's)")
    args = parser.parse_args()
    stop_on_signals()
    load_before = os.getloadavg()[0]

    with services(nats=True, clickhouse=True) as stack:
        try:
            started = time.monotonic()
            spark = get_spark_session(SparkConfig())
            spark_start_seconds = time.monotonic() - started
            backlog = run_backlog(stack, spark, spark_start_seconds, args.changes, args.warm_changes,
                                  BACKLOG_BATCHES.model_copy(update={"batch_max_bytes": args.batch_max_bytes}))
            fresh = run_freshness(stack, spark, args.steady_rate, args.steady_seconds, args.flush_seconds,
                                  args.batch_wait_seconds)
        finally:
            stop_spark_session()

    report(backlog, fresh, load_before)
    print_json({"apply_events_per_s": backlog.apply_rate, "producer_events_per_s": backlog.producer_rate,
                "freshness_p50_s": fresh.percentile(0.50), "freshness_p95_s": fresh.percentile(0.95),
                "apply_in_stride_events_per_s": backlog.stride_rate})
    converged = all(run.source_rows == run.target_rows and not run.mismatches for run in (backlog, fresh))
    converged = converged and backlog.buckets[1] == 0
    return 0 if converged else 1


if __name__ == "__main__":
    sys.exit(main())
