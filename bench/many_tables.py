"""Many tables: 200 tables of mixed shapes streamed by `dagster dev`, as a user runs it.

    python bench/many_tables.py [--tables 200] [--rate 2000] [--seconds 120] [--zipf 1.1] [--shapes mixed|varied]
                                [--batch-wait-seconds 1.0] [--max-batches-per-second 50] [--groups 1]
                                [--idle-packages-per-second N] [--idle-min-age-seconds S] [--apply-threads N]
                                [--instance-storage sqlite|postgres] [--faults] [--change-tables] [--snowflake]
                                [--samples-out FILE]

PostgreSQL, NATS JetStream and the embedded ClickHouse start on loopback; N empty tables are
created, a third each of three shapes: narrow (4 columns), notes-shaped (20 columns, ~500-byte
rows) and wide (42 columns and a body stored out of line, a tenth of it TOASTed, that updates
leave unchanged). With --shapes varied a sixth each: those three and, under names with capitals,
spaces, a hyphen and letters outside ASCII, a table of many types (numeric, uuid, jsonb sometimes
TOASTed, arrays, interval, bytea, inet, an enum, columns named with capitals and spaces), one with
a composite primary key, and one partitioned in two. The producer starts, then `dagster dev`
(webserver, daemon, code server): the
daemon's streaming sensor starts the streaming runs, one per (target, group), here one run for
every table. From that moment a writer (one PL/pgSQL call per 100 ms tick, one transaction)
commits --rate changes/s spread over the tables Zipf-skewed (table k of a shuffled order gets
changes in proportion to 1/k^s): 70% inserts, 20% updates of recent rows, 10% deletes of the
oldest.

Figures:
- all_streaming_s: from `dagster dev`'s start until every table's first insert is visible in
  ClickHouse (each table gets one in the first tick). Printed with it: when the streaming run's
  process appeared, and when the first table's insert was visible.
- freshness_p95_s: over every tick's insert into every table after all tables stream, the time
  from its commit until a poll (one starts every 0.25 s, or when the one before returned; max(id)
  of each table with a new part) saw its id; an upper bound by up to a poll's interval. A poll
  counts from when its query began (a query reads the parts active when it starts); printed
  beside, the p95 counted when the poll returned (the looser bound) and the mean time
  a poll's queries took.
- rss_mb / processes: the peak over samples every 2 s of the summed resident memory and the
  number of processes of `dagster dev`'s whole tree (webserver, daemon, code servers, every run
  worker, its Spark JVM and Python workers if started); processes_at_peak: what they were.
  Shared pages are counted in each process.
- rows_differing: at the end, once the producer confirmed the end of the WAL and the runs
  drained, every table's rows (PostgreSQL's text of every column) against the `_current` view.
- batches_gathered_share: over the steady phase, the streaming run's batches by how they gathered
  (`siphon_stream_batches_gathered_total`): nearly all `waiting_for_turn` says the run is at its
  capacity on this machine, and freshness follows the batches a second it manages.
- cpu_cores / machine_cores: over the steady phase, the cores each part of the machine used, and
  the machine's cores left idle and taken by its host (steal); packages_per_s: the packages (queue
  messages) the producer published a second.
With --instance-storage postgres Dagster keeps its runs and events in a database of the same
PostgreSQL (as a production instance does) instead of SQLite files under DAGSTER_HOME.
With --faults the streaming runs are killed (kill -9) a third into the steady phase and the producer
two thirds in (and started again); the sensor starts the runs again, and the drain waits up to 7
minutes before every table is compared.
With --change-tables a table of 3,000 rows is created half-way through the steady phase and added to
siphon.yaml while the last table is removed from it: the producer follows the file, the code
location reloads by itself (its streaming sensor has the code server load it again; the webserver's
GraphQL API is polled until it knows the new table's asset), `siphon-dagster snapshot` loads the new
table, and every table the file lists at the end is compared.
With --snowflake every table also goes to Snowflake (a fakesnow server on loopback; a second
streaming run), the drain waits up to 15 minutes more, and rows are compared at both targets.
With --initial-rows N every table holds N rows before the producer starts: the snapshot sensor
loads them (one run per partition in each target's snapshot pool) while the streams start, and
all_loaded_s is when the Dagster instance recorded every table's partitions at every target; the
peak memory and processes then include the snapshot runs.
With --samples-out every freshness sample is written to a JSON file (commit time, table, seconds) with
each table's share of the changes: whether late changes are those of hot or cold tables, or of moments.
With --groups N the tables are dealt over N streaming runs (`streaming.groups`); the batch figures
(batches/s, phases) are then those of the one run that serves /metrics.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import clickhouse_connect
import dagster as dg
import psycopg
import yaml
from common import print_json, print_table, services, stop_on_signals
from psycopg import sql

from siphon_core import naming
from siphon_core.config import TableConfig, load_config
from siphon_dagster import source
from siphon_dagster.specs import table_specs
from siphon_dagster.targets import build_target
from siphon_stack.process import (
    free_port,
    port_accepts,
    start_process,
    stop_pid,
    wait_until,
    with_allocator_settings,
)
from siphon_stack.snowflake import FakesnowServer

ROOT = Path(__file__).resolve().parent.parent
APPLICATION = "bench.many"
DATABASE = "many"
TICK_SECONDS = 0.1
# Polls start this often (or as soon as the one before returned). A sample is counted at the start
# of the first poll that saw it, so the interval is what the figure may overstate: each poll asks only
# the tables with a new part, and polling more often asks fewer tables each time.
POLL_SECONDS = 0.25
SAMPLE_SECONDS = 2.0
TARGETS = {"rss_mb": 3000.0, "processes": 12, "freshness_p95_s": 5.0, "all_streaming_s": 90.0, "rows_differing": 0}

NARROW = "create table {name} (id bigserial primary key, k int not null, v text default md5(random()::text), " \
         "at timestamptz default clock_timestamp())"
NOTES = """create table {name} (
    id bigserial primary key, k int not null,
    note text default repeat('a useful comment about the change ', 6) || md5(random()::text),
    noteable_type varchar(255) default 'MergeRequest', author_id bigint default (random() * 5000)::bigint,
    created_at timestamptz default now(), updated_at timestamptz default clock_timestamp(),
    project_id bigint default 700, line_code varchar(255) default md5(random()::text) || '_12_14',
    commit_id varchar(255) default md5(random()::text), noteable_id bigint default 90000,
    system boolean not null default false, updated_by_id bigint, type varchar(255) default 'DiffNote',
    position text default '{{"base_sha":"' || md5(random()::text) || '","start_line":12}}',
    discussion_id varchar(255) default md5(random()::text), cached_markdown_version integer default 2072576,
    confidential boolean default false, internal boolean not null default false, namespace_id bigint default 7)"""
WIDE_TYPES = [("int", "1"), ("text", "'value'"), ("numeric(12,2)", "3.14"), ("boolean", "true"),
              ("timestamptz", "now()")]


def wide_ddl(name: str) -> str:
    columns = ", ".join(f"c{i:02d} {WIDE_TYPES[i % 5][0]} default {WIDE_TYPES[i % 5][1]}" for i in range(40))
    return (f"create table {name} (id bigserial primary key, k int not null, {columns}, body text default "
            "case when random() < 0.1 then repeat(md5(random()::text), 250) else 'short' end)")


TICK_FUNCTION = """
create or replace function bench_tick(names text[], inserts int[], updates int[], deletes int[])
returns bigint[] language plpgsql as $$
declare
    result bigint[] := '{}';
    top bigint;
begin
    for i in 1 .. coalesce(array_length(names, 1), 0) loop
        top := 0;
        if inserts[i] > 0 then
            execute format('with s as (insert into %I (k) select g from generate_series(1, $1) g returning id) '
                           'select max(id) from s', names[i]) into top using inserts[i];
        end if;
        if updates[i] > 0 then
            execute format('update %I set k = k + 1 where id in (select id from %I order by id desc limit $1)',
                           names[i], names[i]) using updates[i];
        end if;
        if deletes[i] > 0 then
            execute format('delete from %I where id in (select id from %I order by id limit $1)',
                           names[i], names[i]) using deletes[i];
        end if;
        result := result || top;
    end loop;
    return result;
end $$
"""


# --shapes varied: three more shapes, one table in six each, under names a user may well have
# (capitals, spaces, a hyphen, letters outside ASCII). Every shape keeps `id bigserial` (the
# writer's and the poller's handle, the first column the comparison keys rows by) and `k int not null`.
MOOD_TYPE = "create type bench_mood as enum ('sad', 'ok', 'happy')"
TYPED = """create table {name} (
    id bigserial primary key, k int not null,
    "Mixed Case" text default 'Ünïcödé ' || md5(random()::text),
    "with space" numeric(20,6) default (random() * 1e6)::numeric(20,6),
    amount numeric default (random() * 1e12)::numeric / 7,
    uid uuid default gen_random_uuid(),
    doc jsonb default jsonb_build_object('a', random(), 'list', jsonb_build_array(1, 'two', null),
        'big', case when random() < 0.05 then repeat(md5(random()::text), 200) else 'small' end),
    tags text[] default array['x', md5(random()::text), null],
    nums int[] default array[1, (random() * 100)::int],
    f8 double precision default random(), f4 real default random()::real,
    day date default current_date - (random() * 1000)::int, at_time time default localtime,
    naive timestamp default localtimestamp, span interval default make_interval(secs => random() * 100000),
    raw bytea default decode(md5(random()::text), 'hex'), addr inet default '10.1.2.3/24',
    mood bench_mood default 'ok', small smallint default 7, code char(3) default 'ab',
    flag boolean, nothing text)"""
COMPOSITE = """create table {name} (
    id bigserial, "Region" text not null default 'eu-' || (random() * 3)::int, k int not null,
    v varchar(64) default md5(random()::text), at timestamptz default clock_timestamp(),
    primary key ("Region", id))"""
PARTITIONED = """create table {name} (
    id bigserial primary key, k int not null, v text default md5(random()::text),
    at timestamptz default clock_timestamp()) partition by range (id)"""
SHAPES = {"mixed": ("narrow", "notes", "wide"),
          "varied": ("narrow", "notes", "wide", "typed", "composite", "partitioned")}
ODD_NAMES = {"typed": "Typed Ü {index:03d}", "composite": "Composite-Key {index:03d}",
             "partitioned": "Partitioned {index:03d}"}


def shape_of(index: int, shapes: str) -> str:
    kinds = SHAPES[shapes]
    return kinds[index % len(kinds)]


def table_names(count: int, shapes: str = "mixed") -> list[str]:
    return [ODD_NAMES.get(shape_of(i, shapes), "t{index:03d}").format(index=i) for i in range(count)]


def create_tables(dsn: str, names: list[str], shapes: str = "mixed") -> None:
    with psycopg.connect(dsn, autocommit=True) as connection:
        if shapes == "varied":
            connection.execute(MOOD_TYPE)
        for index, name in enumerate(names):
            shape = shape_of(index, shapes)
            quoted = sql.Identifier(name).as_string(connection)
            if shape == "wide":
                connection.execute(wide_ddl(quoted))
                connection.execute(f"alter table {quoted} alter column body set storage external")
            elif shape == "partitioned":
                connection.execute(PARTITIONED.format(name=quoted))
                for part, bounds in enumerate(("minvalue) to (500", "500) to (maxvalue")):
                    connection.execute(f"create table {sql.Identifier(f'{name} p{part}').as_string(connection)} "
                                       f"partition of {quoted} for values from ({bounds})")
            else:
                ddl = {"narrow": NARROW, "notes": NOTES, "typed": TYPED, "composite": COMPOSITE}[shape]
                connection.execute(ddl.format(name=quoted))
        connection.execute(TICK_FUNCTION)


def fill_tables(dsn: str, names: list[str], rows: int) -> None:
    """`rows` rows in every table (each column's default), before the producer starts: only
    snapshots bring them to the targets."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        for name in names:
            connection.execute(sql.SQL("insert into {} (k) select g from generate_series(1, %s) g").format(
                sql.Identifier(name)), (rows,))


def write_config(path: Path, dsn: str, nats_url: str, clickhouse_url: str, names: list[str], metrics_port: int,
                 run_metrics_port: int, batch_wait_seconds: float, max_batches_per_second: float,
                 driver_decode_max_bytes: int | None = None, groups: int = 1,
                 idle_packages_per_second: float | None = None, snowflake: dict | None = None,
                 idle_min_age_seconds: float | None = None, apply_threads: int | None = None,
                 materialization_interval_seconds: float = 60.0, auto_load: bool = False,
                 tables_per_load_run: int = 20) -> None:
    # Groups beyond the first take every groups-th table (a share of the hot and the quiet ones
    # each); the first group is the run of the tables no group names.
    named = {f"part{g}": [f"public.{name}" for name in names[g::groups]] for g in range(1, groups)}
    path.write_text(yaml.safe_dump({
        "application_identifier": APPLICATION,
        "source": {"dsn": dsn},
        "queue": {"url": nats_url},
        "producer": {"metrics_port": metrics_port, "status_interval_seconds": 0.5,
                     **({"idle_flush_packages_per_second": idle_packages_per_second}
                        if idle_packages_per_second else {}),
                     **({"idle_flush_min_age_seconds": idle_min_age_seconds}
                        if idle_min_age_seconds is not None else {})},
        "tables": [{"name": f"public.{name}"} for name in names],
        "targets": {"clickhouse": {"url": clickhouse_url, "database": DATABASE},
                    **({"snowflake": snowflake} if snowflake else {})},
        "streaming": {"batch_max_wait_seconds": batch_wait_seconds, "materialization_interval_seconds": materialization_interval_seconds,
                      "max_batches_per_second": max_batches_per_second, "metrics_port": run_metrics_port,
                      "driver_decode_max_bytes": driver_decode_max_bytes, **({"groups": named} if named else {}),
                      **({"apply_threads": apply_threads} if apply_threads else {})},
        # Tables created empty before the producer starts have every row in their streams and
        # nothing to snapshot (a table added mid-run is loaded by `siphon-dagster snapshot`); with
        # --initial-rows the snapshot sensor loads them. The hourly checks would land in the
        # measured minutes only when they cross an hour.
        "snapshots": {"auto_load": auto_load, "tables_per_load_run": tables_per_load_run},
        "checks": {"enabled": False},
    }, sort_keys=False))


class Writer:
    """Commits `rate` changes/s over the tables, Zipf-skewed; records each table's greatest
    inserted id per tick with the commit's wall time."""

    def __init__(self, dsn: str, names: list[str], rate: float, skew: float) -> None:
        self.dsn, self.names, self.rate = dsn, names, rate
        order = list(range(len(names)))
        random.Random(7).shuffle(order)
        self.weights = [0.0] * len(names)
        for rank, index in enumerate(order):
            self.weights[index] = 1.0 / (rank + 1) ** skew
        self.commits: list[tuple[float, dict[str, int]]] = []  # (commit time, table -> max id inserted)
        self.changes = 0
        self.started = 0.0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="writer", daemon=True)

    def _run(self) -> None:
        rnd = random.Random(11)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as connection:
                self.started = time.monotonic()
                # First tick: one insert into every table, so that each shows when it streams.
                self._tick(connection, {i: [1, 0, 0] for i in range(len(self.names))})
                next_tick = time.monotonic()
                while not self.stop.is_set():
                    budget = int(self.rate * TICK_SECONDS)
                    counts: dict[int, list[int]] = {}
                    for index in rnd.choices(range(len(self.names)), weights=self.weights, k=budget):
                        roll = rnd.random()
                        kind = 0 if roll < 0.7 else 1 if roll < 0.9 else 2
                        counts.setdefault(index, [0, 0, 0])[kind] += 1
                    self._tick(connection, counts)
                    next_tick += TICK_SECONDS
                    self.stop.wait(max(0.0, next_tick - time.monotonic()))
        except BaseException as error:  # reported by the main thread
            self.error = error

    def _tick(self, connection: psycopg.Connection, counts: dict[int, list[int]]) -> None:
        indexes = sorted(counts)
        names = [self.names[i] for i in indexes]
        tops = connection.execute("select bench_tick(%s, %s, %s, %s)",
                                  (names, [counts[i][0] for i in indexes], [counts[i][1] for i in indexes],
                                   [counts[i][2] for i in indexes])).fetchone()[0]
        committed = time.time()
        self.commits.append((committed, {name: top for name, top in zip(names, tops, strict=True) if top}))
        self.changes += sum(sum(c) for c in counts.values())


class Poller:
    """Every table's greatest visible id in ClickHouse, polled every POLL_SECONDS.

    A row becomes visible when the insert's part does, so a poll first reads each table's greatest
    block number from system.parts (a few milliseconds) and asks max(id) only of the tables that
    have a new part: one max(id) over all 200 tables cost the embedded ClickHouse about 140 ms of
    CPU, a seventh of a core at two polls a second, which the benchmark would take from the
    pipeline it measures. Asked only of new parts, max(id) costs about a millisecond per batch the
    run wrote, however often the poll runs."""

    def __init__(self, clickhouse_url: str, names: list[str]) -> None:
        host, port = clickhouse_url.rsplit("//", 1)[1].split(":")
        self._tables = [naming.target_table_name("public", name) for name in names]
        self._client = clickhouse_connect.get_client(host=host, port=int(port))
        # (when the query the poll's time is that of began, when the poll returned, what it saw)
        self.polls: list[tuple[float, float, dict[str, int]]] = []
        self.visible: dict[str, int] = {}
        self.error: BaseException | None = None
        self._blocks: dict[str, int] = {}  # table -> greatest block number seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            next_poll = time.monotonic() + POLL_SECONDS
            while not self._stop.wait(max(0.0, next_poll - time.monotonic())):
                next_poll = max(next_poll + POLL_SECONDS, time.monotonic())
                asked = time.time()
                blocks = self._client.query(
                    "SELECT table, max(max_block_number) FROM system.parts WHERE database = {d:String} AND active "
                    "AND has({t:Array(String)}, table) GROUP BY table",
                    parameters={"d": DATABASE, "t": self._tables}).result_rows
                changed = [table for table, block in blocks if self._blocks.get(table) != block]
                seen = dict(self.visible)
                if changed:
                    # A query reads the parts active when it starts: what it sees was visible then.
                    asked = time.time()
                    union = " UNION ALL ".join(f"SELECT {{t{i}:String}}, max(id) FROM `{DATABASE}`.{{n{i}:Identifier}}"
                                               for i in range(len(changed)))
                    parameters = {**{f"t{i}": table for i, table in enumerate(changed)},
                                  **{f"n{i}": table for i, table in enumerate(changed)}}
                    for table, top in self._client.query(union, parameters=parameters).result_rows:
                        seen[table.removeprefix("public__")] = int(top)
                    self._blocks.update(blocks)
                returned = time.time()
                self.visible = seen
                self.polls.append((asked, returned, seen))
        except BaseException as error:
            self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._client.close()


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def names_of(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
            out.append(" ".join(a.decode(errors="replace") for a in argv[:6])[:160])
        except OSError:
            continue
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes have used so far."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(") ", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


class Faults:
    """kill -9 of the streaming runs a third into the steady phase, of the producer two thirds in."""

    def __init__(self, seconds: float) -> None:
        self.run_at = seconds / 3
        self.producer_at = 2 * seconds / 3
        self.done: list[str] = []

    def inject(self, elapsed: float, dagster_pid: int, producer: subprocess.Popen,
               restart: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        """Does what is due at `elapsed` seconds; returns the producer process now running."""
        if elapsed >= self.run_at and not any(d.startswith("streaming run") for d in self.done):
            runs = [pid for pid in tree(dagster_pid) if role_of(pid) == "streaming run"]
            for pid in runs:
                os.kill(pid, signal.SIGKILL)
            self.done.append(f"streaming run killed at {elapsed:.0f} s (pids {runs})")
            print(f"  {self.done[-1]}", flush=True)
        if elapsed >= self.producer_at and not any(d.startswith("producer") for d in self.done):
            os.kill(producer.pid, signal.SIGKILL)
            producer.wait()
            producer = restart()
            self.done.append(f"producer killed at {elapsed:.0f} s and started again")
            print(f"  {self.done[-1]}", flush=True)
        return producer


ASSET_QUERY = "query ($path: [String!]!) { assetNodeOrError(assetKey: {path: $path}) { __typename } }"


class TableChange:
    """Half-way through the steady phase, as an operator adds and removes a table: a table with
    rows is created and added to siphon.yaml and the last table removed from it; the producer
    follows the file by itself, so does the code location (its streaming sensor has it reloaded;
    the webserver's GraphQL API is asked until it knows the new asset, no reload is sent from here)
    and `siphon-dagster snapshot` loads the new table (the benchmark's
    tables start empty, with snapshots.auto_load off); the new table gets a few changes every
    SAMPLE_SECONDS from then on."""

    ADDED = "t_added"
    ROWS = 3000

    def __init__(self, seconds: float, config_path: Path, dsn: str, webserver_port: int, env: dict[str, str],
                 log: Path) -> None:
        self.at = seconds / 2
        self.config_path, self.dsn, self.port, self.env, self.log = config_path, dsn, webserver_port, env, log
        self.snapshot: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        self.created = threading.Event()
        self.done: list[str] = []
        self.reload_seconds = float("nan")
        self.removed: str | None = None

    def step(self, elapsed: float) -> None:
        if elapsed < self.at:
            return
        if self.thread is None:  # the reload takes a while: the faults and samples go on meanwhile
            self.thread = threading.Thread(target=self._change_reporting, args=(elapsed,), name="table-change",
                                           daemon=True)
            self.thread.start()
        if self.created.is_set():
            with psycopg.connect(self.dsn, autocommit=True) as connection:
                connection.execute(f"select bench_tick(array['{self.ADDED}'], array[5], array[2], array[1])")

    def _change_reporting(self, elapsed: float) -> None:
        try:
            self._change(elapsed)
        except Exception as error:  # reported with the figures; the comparison at the end still runs
            self.done.append(f"the table change failed: {error!r}")
            print(f"  {self.done[-1]}", flush=True)

    def _change(self, elapsed: float) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as connection:
            connection.execute(NOTES.format(name=self.ADDED))
            connection.execute(f"insert into {self.ADDED} (k) select g from generate_series(1, {self.ROWS}) g")
        self.created.set()
        config = yaml.safe_load(self.config_path.read_text())
        self.removed = config["tables"].pop()["name"]
        # A group may name only configured tables: the removed one leaves its group too (the new
        # table goes to the default group).
        groups = config.get("streaming", {}).get("groups", {})
        for group in list(groups):
            groups[group] = [name for name in groups[group] if name != self.removed]
            if not groups[group]:
                del groups[group]
        config["tables"].append({"name": f"public.{self.ADDED}"})
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        started = time.monotonic()
        while not self._webserver_knows("public", self.ADDED) or self._webserver_knows("public", self.removed_bare):
            if time.monotonic() - started > 600:
                raise RuntimeError("the webserver did not show the changed table list within 600 s")
            time.sleep(2)
        self.reload_seconds = time.monotonic() - started
        self.done.append(f"at {elapsed:.0f} s public.{self.ADDED} ({self.ROWS} rows) added and {self.removed} removed; "
                         f"the webserver showed the new table list {self.reload_seconds:.0f} s later (no reload "
                         "sent: the code location reloaded itself)")
        print(f"  {self.done[-1]}", flush=True)
        self.snapshot = start_process("siphon-dagster snapshot", [
            str(Path(sys.executable).parent / "siphon-dagster"), "snapshot", "--table", f"public.{self.ADDED}"],
            self.log, env=self.env, cwd=Path(self.env["DAGSTER_HOME"]))

    @property
    def removed_bare(self) -> str:
        return (self.removed or "").split(".", 1)[-1]

    def _webserver_knows(self, schema: str, table: str) -> bool:
        """Whether the webserver's definitions have the table's target asset."""
        path = naming.asset_key_path("clickhouse", schema, table)
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/graphql", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"query": ASSET_QUERY, "variables": {"path": path}}).encode())
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answer = json.loads(response.read())
        except OSError:
            return False
        return (answer.get("data") or {}).get("assetNodeOrError", {}).get("__typename") == "AssetNode"

    def finish(self, timeout: float) -> None:
        """Waits for the reload and the snapshot command; records how they ended."""
        if self.thread is not None:
            self.thread.join(timeout)
        if self.snapshot is None:
            return
        try:
            code = self.snapshot.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_pid(self.snapshot.pid)
            code = "stopped: still running"
        self.done.append(f"siphon-dagster snapshot of public.{self.ADDED} ended: {code}")
        print(f"  {self.done[-1]}", flush=True)


class LoadWatch:
    """With --initial-rows: when every table's snapshot partitions are materialized at every
    target, as the Dagster instance records them (a table loaded stays loaded: it is not read again)."""

    # Two reads of the instance a table not yet loaded: at 200 tables, every 5 s took the benchmark's
    # process a sixth of a core from the machine it measures.
    INTERVAL_SECONDS = 15.0

    def __init__(self, dagster_home: Path, config_path: Path) -> None:
        self.instance = dg.DagsterInstance.from_config(str(dagster_home))
        self.config_path = config_path
        self.waiting = [(spec, target) for spec in table_specs(load_config(config_path)) for target in spec.targets]
        self.total = len(self.waiting)
        self.loaded_at: float | None = None
        self._looked_at = float("-inf")

    def step(self, elapsed: float) -> None:
        if self.loaded_at is not None or time.monotonic() - self._looked_at < self.INTERVAL_SECONDS:
            return
        self._looked_at = time.monotonic()
        configured = {table.name for table in load_config(self.config_path).tables}  # --change-tables removes one
        self.waiting = [(spec, target) for spec, target in self.waiting
                        if spec.qualified_name in configured and not self._loaded(spec, target)]
        if not self.waiting:
            self.loaded_at = elapsed

    def _loaded(self, spec: Any, target: str) -> bool:
        keys = self.instance.get_dynamic_partitions(spec.partitions_def_name)
        return bool(keys) and set(keys) <= self.instance.get_materialized_partitions(spec.target_key(target))

    def close(self) -> None:
        self.instance.dispose()


def role_of(pid: int) -> str:
    """Which part of the Dagster side a process is, for the CPU breakdown."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return "gone"
    if "java" in argv[0]:
        return "Spark"
    command = " ".join(argv)
    for marker, role in (("dagster._daemon", "Dagster daemon"), ("dagster_webserver", "Dagster webserver"),
                         ("code-server", "code server"), ("api grpc", "code server (sensors)"),
                         ("spawn_main", "streaming run"), ("execute_run", "streaming run"),
                         ("pyspark", "Spark")):
        if marker in command:
            return role
    return "other Dagster"  # `dagster dev` itself, Dagster's log capture


def machine_ticks() -> dict[str, int]:
    """The whole machine's CPU time so far by state (/proc/stat's first line), in clock ticks."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    states = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {state: int(value) for state, value in zip(states, fields, strict=False)}


class CpuSplit:
    """CPU used per part of the machine between `start()` and `stop()`, in cores; and the machine's
    cores left idle and taken by its host (`steal`: a virtual machine's CPU time its hypervisor gave
    to others), which tell a slow hour of the machine from a slower code."""

    def __init__(self, parts: dict[str, Callable[[], list[int]]]) -> None:
        self.parts = parts
        self._before: dict[int, tuple[str, float]] = {}
        self._machine_before: dict[str, int] = {}
        self._started = 0.0
        self.cores: dict[str, float] = {}
        self.machine: dict[str, float] = {}

    def _now(self) -> dict[int, tuple[str, float]]:
        used: dict[int, tuple[str, float]] = {}
        for part, pids in self.parts.items():
            for pid in pids():
                used[pid] = (part if part != "dagster" else role_of(pid), cpu_seconds([pid]))
        return used

    def start(self) -> None:
        self._before, self._started = self._now(), time.monotonic()
        self._machine_before = machine_ticks()

    def stop(self) -> None:
        after, seconds = self._now(), time.monotonic() - self._started
        machine, tick = machine_ticks(), os.sysconf("SC_CLK_TCK")
        self.machine = {state: round((machine[state] - self._machine_before.get(state, 0)) / tick / seconds, 3)
                        for state in ("idle", "iowait", "steal") if state in machine}
        # Per process: one started in the window counts whole, one that ended in it is not counted
        # (a streaming run replaced in the window counts as its replacement's CPU, not as none).
        self.cores = {}
        for pid, (role, used) in after.items():
            earlier = self._before.get(pid, (role, 0.0))[1]
            self.cores[role] = self.cores.get(role, 0.0) + max(0.0, used - earlier) / seconds


def run_metrics(port: int, attempts: int = 3) -> dict[str, Any]:
    """Sums over every table of the streaming run's batch counters, from its /metrics, and which
    target's run that is (with both targets, the run that took the port first serves it).

    A run busy with hundreds of tables can answer late: asked again, and when it never answers the
    figures are NaN rather than the benchmark's end."""
    wanted = ("siphon_stream_batches_total", "siphon_stream_batch_seconds_sum", "siphon_stream_lag_seconds",
              "siphon_stream_pending_messages")
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
                text = response.read().decode()
            break
        except OSError as error:
            print(f"the streaming run's /metrics did not answer ({error}); attempt {attempt + 1} of {attempts}",
                  file=sys.stderr)
    else:
        nan = float("nan")
        return {"batches": nan, "batch_seconds": nan, "lag_max_s": nan, "pending": nan, "phases": {}, "gathered": {},
                "target": None}
    sums = dict.fromkeys(wanted, 0.0)
    peaks = dict.fromkeys(wanted, 0.0)
    phases: dict[str, float] = {}
    gathered: dict[str, float] = {}  # batches by how they gathered (a run at its capacity: waiting for a turn)
    target = None
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == "siphon_stream_batch_phase_seconds_total":
            phase = line.split('phase="', 1)[1].split('"', 1)[0]
            phases[phase] = phases.get(phase, 0.0) + float(line.rsplit(" ", 1)[1])
        if name == "siphon_stream_batches_gathered_total":
            how = line.split('how="', 1)[1].split('"', 1)[0]
            gathered[how] = gathered.get(how, 0.0) + float(line.rsplit(" ", 1)[1])
        if name in sums:
            value = float(line.rsplit(" ", 1)[1])
            sums[name] += value
            peaks[name] = max(peaks[name], value)
            if target is None and 'target="' in line:
                target = line.split('target="', 1)[1].split('"', 1)[0]
    return {"batches": sums["siphon_stream_batches_total"], "batch_seconds": sums["siphon_stream_batch_seconds_sum"],
            "lag_max_s": peaks["siphon_stream_lag_seconds"], "pending": sums["siphon_stream_pending_messages"],
            "phases": phases, "gathered": gathered, "target": target}


def producer_packages(port: int) -> float:
    """Packages the producer has published and had acknowledged so far (its /metrics); NaN when it
    does not answer. Every package is a message the queue stores and each streaming run pulls and
    acks: with the batches a second, how much of a run's work is per message."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("siphon_producer_packages_total"))


def freshness(writer: Writer, poller: Poller, after: float, at_return: bool = False,
              detail: list[tuple[float, str, float]] | None = None) -> list[float]:
    """Commit -> first poll that saw the id, for every (tick, table) insert committed after `after`;
    a poll's time is when its query began, or with `at_return` when it returned (a looser bound,
    printed beside). `detail` receives (commit time, table, seconds) of each."""
    samples = []
    polls = poller.polls
    start = 0
    for committed, tops in writer.commits:
        if committed < after:
            continue
        while start < len(polls) and polls[start][1 if at_return else 0] < committed:
            start += 1
        for table, top in tops.items():
            for asked, returned, seen in polls[start:]:
                if seen.get(table, 0) >= top:
                    samples.append((returned if at_return else asked) - committed)
                    if detail is not None:
                        detail.append((committed, table, samples[-1]))
                    break
    return samples


def keep_logs(directory: Path) -> None:
    """Copies the stack's and Dagster's logs (and the runs' output) out of the benchmark's temporary
    directory, which is removed at the end: rows that differ need them to be explained."""
    kept = Path(tempfile.mkdtemp(prefix="siphon-bench-logs-"))
    for log in directory.rglob("*.log"):
        shutil.copy(log, kept / f"{log.parent.name}-{log.name}")
    runs_output = directory / "dagster_home" / "storage"
    if runs_output.is_dir():
        shutil.copytree(runs_output, kept / "runs-output")
    print(f"the logs are kept in {kept}", flush=True)


def instance_database(dsn: str) -> str:
    """A database for Dagster's storage beside the source's, in the same cluster; its URL."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("create database dagster_instance")
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    user = info.get("user", "postgres")
    return f"postgresql+psycopg2://{user}@{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}/dagster_instance"


def slot_caught_up(dsn: str, end_lsn: int) -> bool:
    with psycopg.connect(dsn) as connection:
        row = connection.execute("select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s",
                                 (naming.slot_name(APPLICATION),)).fetchone()
    return bool(row and row[0]) and naming.parse_lsn(row[0]) >= end_lsn


def differing_rows(config_path: Path, target_name: str = "clickhouse") -> tuple[int, list[str]]:
    """Rows missing, extra or different at the target, over every table."""
    config = load_config(config_path)
    target = build_target(target_name, config)
    total, problems = 0, []
    try:
        with source.connect(config.source.dsn) as connection:
            for table in config.tables:
                schema = source.table_schema(connection, table)
                # Each type's output function, as the producer's session renders it (a `::text` cast
                # prints a boolean as `true`, its output function as `t`).
                columns = sql.SQL(", ").join(map(sql.Identifier, schema.column_names))
                with connection.cursor() as cursor:
                    cursor.execute(sql.SQL("select {} from {}").format(
                        columns, sql.Identifier(table.schema_name, table.table_name)))
                    result = cursor.pgresult
                    rows = [tuple(None if (v := result.get_value(r, c)) is None else bytes(v).decode()
                                  for c in range(result.nfields)) for r in range(result.ntuples)]
                expected = {row[0]: row for row in rows}
                if not target.table_exists(schema):
                    problems.append(f"{table.name}: not created in {target_name} ({len(expected)} rows at the source)")
                    total += len(expected)
                    continue
                actual = {row[0]: tuple(row) for row in target.current_rows_as_text(schema)}
                differ = [key for key in expected.keys() & actual.keys() if expected[key] != actual[key]]
                bad = len(expected.keys() ^ actual.keys()) + len(differ)
                if bad:
                    columns = sorted({schema.column_names[i] for key in differ[:50]
                                      for i, (a, b) in enumerate(zip(expected[key], actual[key], strict=True))
                                      if a != b})
                    example = ""
                    if differ:
                        i = schema.column_names.index(columns[0])
                        example = f"; e.g. {columns[0]} {expected[differ[0]][i]!r} != {actual[differ[0]][i]!r}"
                    problems.append(f"{table.name}: {bad} rows differ ({len(expected)} at the source, "
                                    f"{len(actual)} in {target_name}; columns {columns}{example})")
                total += bad
    finally:
        target.close()
    return total, problems


def counts_match(config_path: Path, names: list[str], target_name: str = "clickhouse") -> bool:
    config = load_config(config_path)
    target = build_target(target_name, config)
    try:
        with source.connect(config.source.dsn) as connection:
            for name in names:
                table = TableConfig(name=f"public.{name}")
                schema = source.table_schema(connection, table)
                expected = connection.execute(sql.SQL("select count(*) from {}").format(
                    sql.Identifier("public", name))).fetchone()[0]
                if target.count_current(schema) != expected:
                    return False
        return True
    except Exception:  # a table not created in the target yet
        return False
    finally:
        target.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=200)
    parser.add_argument("--rate", type=float, default=2000.0, help="changes per second over all tables")
    parser.add_argument("--seconds", type=float, default=120.0, help="steady phase once every table streams")
    parser.add_argument("--samples-out", type=Path, default=None,
                        help="write every freshness sample (commit time, table, seconds) and each table's share "
                             "of the changes to this JSON file")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="mixed",
                        help="mixed: narrow, notes-shaped and wide tables; varied: those and, under names with "
                             "capitals, spaces and letters outside ASCII, tables of many types, with a composite "
                             "key, and partitioned")
    parser.add_argument("--zipf", type=float, default=1.1, help="skew s: table k gets changes in proportion to 1/k^s")
    parser.add_argument("--batch-wait-seconds", type=float, default=1.0,
                        help="streaming.batch_max_wait_seconds: how long a batch collects after its first message")
    parser.add_argument("--max-batches-per-second", type=float, default=50.0,
                        help="streaming.max_batches_per_second: the run's budget of batches over all tables")
    parser.add_argument("--groups", type=int, default=1,
                        help="streaming runs (streaming.groups): the tables dealt round-robin over this many runs")
    parser.add_argument("--driver-decode-max-bytes", type=int, default=None,
                        help="streaming.driver_decode_max_bytes (default: unset, every batch of a group run in its process)")
    parser.add_argument("--instance-storage", choices=("sqlite", "postgres"), default="sqlite",
                        help="Dagster's storage: the repository's dagster.yaml (SQLite under DAGSTER_HOME), or "
                             "a database of the benchmark's PostgreSQL, as a production instance keeps it")
    parser.add_argument("--idle-packages-per-second", type=float, default=None,
                        help="producer.idle_flush_packages_per_second (default: the producer's own)")
    parser.add_argument("--idle-min-age-seconds", type=float, default=None,
                        help="producer.idle_flush_min_age_seconds (default: the producer's own)")
    parser.add_argument("--apply-threads", type=int, default=None,
                        help="streaming.apply_threads: the run's turns, batches written at once (default: the run's own)")
    parser.add_argument("--materialization-interval-seconds", type=float, default=60.0,
                        help="streaming.materialization_interval_seconds: at most one materialization per table "
                             "per this interval")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the stack's and Dagster's logs (they are kept anyway when rows differ)")
    parser.add_argument("--faults", action="store_true",
                        help="a third into the steady phase kill -9 the streaming runs, two thirds in the producer "
                             "(started again at once); the sensor starts the runs again. The batch figures then "
                             "cover the runs' restarts, and rows_differing is what matters")
    parser.add_argument("--change-tables", action="store_true",
                        help="half-way through the steady phase add a table of 3,000 rows to siphon.yaml and remove "
                             "one (the code location reloads by itself), load the new table with `siphon-dagster snapshot`; "
                             "every table the file lists at the end is compared")
    parser.add_argument("--initial-rows", type=int, default=0,
                        help="rows in every table before the producer starts; the snapshot sensor loads them "
                             "(snapshots.auto_load on) while the stream starts, and all_loaded_s says when every "
                             "table's partitions were loaded at every target")
    parser.add_argument("--tables-per-load-run", type=int, default=20,
                        help="snapshots.tables_per_load_run: with --initial-rows, new tables of one partition "
                             "load this many to a run (1: a run per partition, as before)")
    parser.add_argument("--snowflake", action="store_true",
                        help="also replicate every table to Snowflake (a fakesnow server started here; a second "
                             "streaming run); freshness is ClickHouse's, and rows are compared at both targets")
    args = parser.parse_args()
    stop_on_signals()
    names = table_names(args.tables, args.shapes)
    load_before = os.getloadavg()[0]
    bin_dir = Path(sys.executable).parent
    with services(nats=True, clickhouse=True) as stack:
        directory = stack.directory
        config_path = directory / "siphon.yaml"
        fakesnow = FakesnowServer(directory / "fakesnow", free_port()) if args.snowflake else None
        fakesnow_pid = fakesnow.start() if fakesnow is not None else None
        snowflake = None
        if fakesnow is not None:
            env_sf = fakesnow.environment()
            snowflake = {"account": env_sf["SIPHON_SNOWFLAKE_ACCOUNT"], "user": env_sf["SIPHON_SNOWFLAKE_USER"],
                         "password": env_sf["SIPHON_SNOWFLAKE_PASSWORD"], "host": env_sf["SIPHON_SNOWFLAKE_HOST"],
                         "port": int(env_sf["SIPHON_SNOWFLAKE_PORT"]),
                         "protocol": env_sf["SIPHON_SNOWFLAKE_PROTOCOL"], "database": "SIPHON", "schema": "MANY"}
        metrics_port = free_port()
        run_metrics_port = free_port()
        write_config(config_path, stack.dsn, stack.nats.url, stack.clickhouse_url, names, metrics_port, run_metrics_port,
                     args.batch_wait_seconds, args.max_batches_per_second, args.driver_decode_max_bytes, args.groups,
                     args.idle_packages_per_second, snowflake, args.idle_min_age_seconds, args.apply_threads,
                     args.materialization_interval_seconds, auto_load=args.initial_rows > 0,
                     tables_per_load_run=args.tables_per_load_run)
        create_tables(stack.dsn, names, args.shapes)
        if args.initial_rows:
            fill_tables(stack.dsn, names, args.initial_rows)
        dagster_home = directory / "dagster_home"
        dagster_home.mkdir()
        shutil.copy(ROOT / "dagster.yaml", dagster_home / "dagster.yaml")
        if args.instance_storage == "postgres":
            with (dagster_home / "dagster.yaml").open("a") as instance_config:
                yaml.safe_dump({"storage": {"postgres": {"postgres_url": instance_database(stack.dsn)}}}, instance_config)
        env = {**os.environ, "SIPHON_CONFIG": str(config_path), "DAGSTER_HOME": str(dagster_home),
               "PYTHONPATH": str(ROOT)}
        producer = start_process("siphon-producer", [sys.executable, "-m", "producer_service.cli", "run", "--config",
                                                     str(config_path)], directory / "producer.log", env=env)
        dagster_pid = None
        writer = Writer(stack.dsn, names, args.rate, args.zipf)
        poller = Poller(stack.clickhouse_url, names)
        samples: list[tuple[float, float, int]] = []
        peak_roles: dict[str, int] = {}  # what the processes were at the sample with the most of them
        try:
            def producing() -> bool:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=1) as response:
                        return response.status == 200
                except OSError:
                    return False

            wait_until("producer", producing, 120, pid=producer.pid, log_path=directory / "producer.log")

            def restart_producer() -> subprocess.Popen:
                return start_process("siphon-producer", [sys.executable, "-m", "producer_service.cli", "run",
                                                         "--config", str(config_path)],
                                     directory / "producer-restarted.log", env=env)
            port = free_port()
            started = time.monotonic()
            dagster = start_process("dagster dev", [str(bin_dir / "dagster"), "dev", "-m", "siphon_dagster",
                                                    "-h", "127.0.0.1", "-p", str(port)],
                                    directory / "dagster.log", env=with_allocator_settings(env), cwd=dagster_home,
                                    unset=("DAGSTER_MODULE_NAME",))
            dagster_pid = dagster.pid
            writer.thread.start()
            wait_until("Dagster UI", lambda: port_accepts(port), 180, pid=dagster.pid,
                       log_path=directory / "dagster.log")
            ui_seconds = time.monotonic() - started
            load_watch = LoadWatch(dagster_home, config_path) if args.initial_rows else None

            def sample() -> None:
                pids = tree(dagster.pid)
                if not samples or len(pids) > max(s[2] for s in samples):
                    peak_roles.clear()
                    for pid in pids:  # a run's worker, streaming or load, is a "streaming run" here
                        role = "run worker" if (role := role_of(pid)) == "streaming run" else role
                        peak_roles[role] = peak_roles.get(role, 0) + 1
                samples.append((time.monotonic() - started, rss_mb(pids), len(pids)))

            def machine_parts() -> dict[str, Callable[[], list[int]]]:
                return {"ClickHouse (embedded)": lambda: [stack.clickhouse_pid],
                        "NATS": lambda: [stack.nats_pid], "PostgreSQL": lambda: tree(stack.postgres_pid),
                        "producer": lambda: tree(producer.pid), "benchmark (writer, poller)": lambda: [os.getpid()],
                        "dagster": lambda: tree(dagster.pid),
                        **({"fakesnow": lambda: [fakesnow_pid]} if fakesnow_pid else {})}

            # Where the cores go while the tables start streaming, from `dagster dev`'s start.
            startup_cpu = CpuSplit(machine_parts())
            startup_cpu.start()
            all_streaming = None
            first_id = args.initial_rows + 1  # the writer's first insert into each table
            run_started = first_streaming = None  # where the wait for every table goes
            streaming_timeline: list[tuple[int, int]] = []  # (seconds since the start, tables streaming)
            while time.monotonic() - started < 300:
                sample()
                elapsed = time.monotonic() - started
                if run_started is None and any(role_of(pid) == "streaming run" for pid in tree(dagster.pid)):
                    run_started = elapsed
                visible = len([n for n in names if poller.visible.get(n, 0) >= first_id])
                if first_streaming is None and visible:
                    first_streaming = elapsed
                if int(elapsed) // 10 > (streaming_timeline[-1][0] // 10 if streaming_timeline else -1):
                    streaming_timeline.append((int(elapsed), visible))
                if load_watch is not None:
                    load_watch.step(elapsed)
                if visible == len(names):
                    all_streaming = elapsed
                    break
                if writer.error or poller.error:
                    raise RuntimeError(f"writer: {writer.error}; poller: {poller.error}")
                time.sleep(SAMPLE_SECONDS)
            startup_cpu.stop()
            streaming_tables = len([n for n in names if poller.visible.get(n, 0) >= first_id])
            cpu = CpuSplit(machine_parts())
            cpu.start()
            batches_before = run_metrics(run_metrics_port)
            packages_before = producer_packages(metrics_port)
            steady_from = time.time()
            steady_changes = writer.changes
            steady_started = time.monotonic()
            faults = Faults(args.seconds) if args.faults else None
            change = TableChange(args.seconds, config_path, stack.dsn, port, env,
                                 directory / "snapshot.log") if args.change_tables else None
            while time.monotonic() - steady_started < args.seconds:
                if faults is not None:
                    producer = faults.inject(time.monotonic() - steady_started, dagster.pid, producer, restart_producer)
                if change is not None:
                    change.step(time.monotonic() - steady_started)
                if load_watch is not None:
                    load_watch.step(time.monotonic() - started)
                sample()
                if writer.error or poller.error:
                    raise RuntimeError(f"writer: {writer.error}; poller: {poller.error}")
                time.sleep(SAMPLE_SECONDS)
            achieved_rate = (writer.changes - steady_changes) / (time.monotonic() - steady_started)
            # A producer killed in the phase counts its packages from its restart: no figure then.
            packages_per_second = ((producer_packages(metrics_port) - packages_before)
                                   / (time.monotonic() - steady_started) if faults is None else float("nan"))
            cpu.stop()
            # A run killed in the steady phase counts its batches from its restart: no figure of the phase.
            batches_after = run_metrics(run_metrics_port) if faults is None and change is None else batches_before
            steady_batches = batches_after["batches"] - batches_before["batches"]
            steady_batch_seconds = batches_after["batch_seconds"] - batches_before["batch_seconds"]
            writer.stop.set()
            writer.thread.join(30)
            detail: list[tuple[float, str, float]] = []
            fresh = freshness(writer, poller, steady_from, detail=detail)
            if args.samples_out is not None:
                args.samples_out.write_text(json.dumps({
                    "weights": dict(zip(writer.names, writer.weights, strict=True)), "samples": detail}))
            fresh_at_return = freshness(writer, poller, steady_from, at_return=True)
            with psycopg.connect(stack.dsn) as connection:
                end = naming.parse_lsn(connection.execute("select pg_current_wal_lsn()::text").fetchone()[0])
            # A killed run's backlog too; fakesnow runs each MERGE in Python and DuckDB, a few a second.
            deadline = (time.monotonic() + (180 if faults is None else 420) + (900 if args.snowflake else 0)
                        + (900 if args.initial_rows else 0))
            while load_watch is not None and load_watch.loaded_at is None and time.monotonic() < deadline:
                load_watch.step(time.monotonic() - started)
                sample()
                time.sleep(1)
            while time.monotonic() < deadline and not slot_caught_up(stack.dsn, end):
                time.sleep(1)
            compared = [t.name.removeprefix("public.") for t in load_config(config_path).tables]
            target_names = ["clickhouse", "snowflake"] if args.snowflake else ["clickhouse"]
            drained_at = {}
            # Each target's drain is timed on its own: the snapshot command of an added table
            # loads every target, and at fakesnow's pace it ends long after ClickHouse has every row.
            for target_name in target_names:
                while time.monotonic() < deadline and not counts_match(config_path, compared, target_name):
                    sample()
                    time.sleep(2)
                drained_at[target_name] = time.monotonic() - steady_started - args.seconds
            if change is not None:
                change.finish(max(0.0, deadline - time.monotonic()))
            drained_seconds = time.monotonic() - steady_started - args.seconds
            differing, problems, differing_by_target = 0, [], {}
            try:
                for target_name in target_names:
                    count, found = differing_rows(config_path, target_name)
                    differing_by_target[target_name] = count
                    differing, problems = differing + count, problems + found
            except BaseException:
                keep_logs(directory)  # a comparison that failed needs them as much as rows that differ
                raise
            if differing or args.keep_logs:
                keep_logs(directory)
            final_pids = tree(dagster.pid)
            if load_watch is not None:
                load_watch.close()
            final_names = names_of(final_pids)
        finally:
            writer.stop.set()
            poller.stop()
            if dagster_pid is not None:
                leftovers = tree(dagster_pid)
                stop_pid(dagster_pid, timeout=30)
                for pid in leftovers:  # run workers that outlived `dagster dev`
                    stop_pid(pid, timeout=10)
            stop_pid(producer.pid, timeout=30)
            if fakesnow_pid is not None:
                FakesnowServer.stop(fakesnow_pid)

    peak_rss = max(s[1] for s in samples)
    peak_processes = max(s[2] for s in samples)
    p95 = statistics.quantiles(fresh, n=20)[-1] if len(fresh) >= 20 else float("nan")
    p50 = statistics.median(fresh) if fresh else float("nan")
    p95_at_return = statistics.quantiles(fresh_at_return, n=20)[-1] if len(fresh_at_return) >= 20 else float("nan")
    poll_query = statistics.fmean(returned - asked for asked, returned, _ in poller.polls) if poller.polls else float("nan")
    # What a sample may overstate: the time between the starts of two polls.
    starts = [asked for asked, _, _ in poller.polls]
    poll_interval = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else float("nan")
    figures = {
        "tables": args.tables, "shapes": args.shapes, "rate": args.rate, "instance_storage": args.instance_storage,
        "achieved_rate": achieved_rate,
        "rss_mb": peak_rss, "processes": peak_processes, "processes_at_peak": peak_roles,
        "freshness_p50_s": p50, "freshness_p95_s": p95,
        "freshness_p95_at_poll_return_s": p95_at_return, "poll_query_mean_s": poll_query,
        "poll_interval_mean_s": poll_interval,
        "all_streaming_s": all_streaming if all_streaming is not None else float("nan"),
        "streaming_tables": streaming_tables, "rows_differing": differing, "ui_ready_s": ui_seconds,
        "run_started_s": run_started, "first_table_streaming_s": first_streaming,
        "drain_s": drained_seconds, "load_average_before": load_before,
        "batches_per_s": steady_batches / args.seconds if steady_batches else float("nan"),
        "batch_latency_mean_s": steady_batch_seconds / steady_batches if steady_batches else float("nan"),
        "lag_max_end_s": batches_after["lag_max_s"], "pending_end": batches_after["pending"],
        "run_metrics_target": batches_after["target"],
        "batch_phase_mean_s": {phase: round((seconds - batches_before["phases"].get(phase, 0.0)) / steady_batches, 4)
                               for phase, seconds in batches_after["phases"].items()} if steady_batches else {},
        "batches_gathered_share": {how: round((count - batches_before["gathered"].get(how, 0.0)) / steady_batches, 3)
                                   for how, count in batches_after["gathered"].items()} if steady_batches else {},
        "packages_per_s": packages_per_second,
        "cpu_cores": {role: round(cores, 3) for role, cores in sorted(cpu.cores.items(), key=lambda kv: -kv[1])},
        "machine_cores": cpu.machine,
        "startup_batches": batches_before["batches"],
        "startup_batch_phase_mean_s": {phase: round(seconds / batches_before["batches"], 4)
                                       for phase, seconds in batches_before["phases"].items()}
        if batches_before["batches"] else {},
        "startup_cpu_cores": {role: round(cores, 3)
                              for role, cores in sorted(startup_cpu.cores.items(), key=lambda kv: -kv[1])},
        "streaming_timeline": streaming_timeline,
        "faults": (faults.done if faults is not None else []) + (change.done if change is not None else []),
        "tables_compared": len(compared), "rows_differing_by_target": differing_by_target,
        "drained_s_by_target": drained_at,
        **({"initial_rows": args.initial_rows, "tables_per_load_run": args.tables_per_load_run,
            "all_loaded_s": load_watch.loaded_at if load_watch.loaded_at is not None else float("nan"),
            "tables_not_loaded": len(load_watch.waiting)} if load_watch is not None else {}),
    }
    print("\nprocesses on the Dagster side at the end:")
    for name in final_names:
        print(f"  {name}")
    for problem in problems[:20]:
        print(f"  {problem}")
    print(f"\nCPU from `dagster dev`'s start until every table streamed ({os.cpu_count()} cores):")
    for role, cores in figures["startup_cpu_cores"].items():
        print(f"  {role:32s} {cores:5.2f} cores")
    print("  tables streaming: " + ", ".join(f"{count} at {second} s" for second, count in streaming_timeline))
    print(f"  {figures['startup_batches']:.0f} batches applied by then; mean seconds per batch by phase: "
          + ", ".join(f"{phase} {seconds:.3f}" for phase, seconds in figures["startup_batch_phase_mean_s"].items()))
    print(f"\nCPU during the steady phase ({os.cpu_count()} cores):")
    for role, cores in figures["cpu_cores"].items():
        print(f"  {role:32s} {cores:5.2f} cores")
    print("  the machine: " + ", ".join(f"{state} {cores:.2f} cores" for state, cores in cpu.machine.items())
          + f"; the producer published {packages_per_second:.0f} packages a second")
    lag = (f"at the steady phase's end the greatest lag {figures['lag_max_end_s']:.1f} s and "
           f"{figures['pending_end']:.0f} messages pending")
    if figures["batch_phase_mean_s"]:
        print(f"streaming run ({figures['run_metrics_target'] or 'its target'}): "
              f"{figures['batches_per_s']:.1f} batches/s, first message to ack "
              f"{figures['batch_latency_mean_s']:.2f} s on average; {lag}")
        print("  mean seconds per batch by phase: " + ", ".join(f"{phase} {seconds:.3f}" for phase, seconds
                                                               in figures["batch_phase_mean_s"].items()))
        if figures["batches_gathered_share"]:
            print("  how batches gathered: " + ", ".join(f"{how} {share:.0%}" for how, share
                                                          in sorted(figures["batches_gathered_share"].items())))
    else:
        # A run replaced during the phase starts its counters again: no rate over the phase to give.
        print(f"streaming run: batches not counted over the phase (runs killed or replaced); {lag}")
    print_table(f"{args.tables} tables, {args.rate:.0f} changes/s Zipf s={args.zipf}, one `dagster dev` "
                f"(instance storage: {args.instance_storage}; load average before: {load_before:.1f})", [
        ("resident memory, Dagster side (MB, peak)", f"{peak_rss:.0f}", f"<= {TARGETS['rss_mb']:.0f}"),
        ("processes, Dagster side (peak)", f"{peak_processes}", f"<= {TARGETS['processes']}"),
        ("  at the peak", ", ".join(f"{role} {count}" for role, count in sorted(peak_roles.items())), ""),
        ("freshness p50 (s)", f"{p50:.2f}", ""),
        ("freshness p95 (s)", f"{p95:.2f}", f"<= {TARGETS['freshness_p95_s']:.0f}"),
        ("  counted when the poll returned (s)", f"{p95_at_return:.2f}", ""),
        ("  a poll's query took on average (s)", f"{poll_query:.3f}", ""),
        ("  polls started every (s, on average)", f"{poll_interval:.3f}", ""),
        ("every table streaming after (s)", "-" if all_streaming is None else f"{all_streaming:.0f}",
         f"<= {TARGETS['all_streaming_s']:.0f}"),
        ("tables streaming", f"{streaming_tables}/{args.tables}", ""),
        ("  the streaming run's process started after (s)", "-" if run_started is None else f"{run_started:.0f}", ""),
        ("  the first table streaming after (s)", "-" if first_streaming is None else f"{first_streaming:.0f}", ""),
        ("changes/s achieved by the writer", f"{achieved_rate:.0f}", f"{args.rate:.0f}"),
        *([("every table loaded at every target after (s)",
            "-" if load_watch.loaded_at is None else f"{load_watch.loaded_at:.0f}", ""),
           ("  (table, target) pairs not loaded", f"{len(load_watch.waiting)}/{load_watch.total}", "0")]
          if load_watch is not None else []),
        ("rows differing at the end", f"{differing}", "0"),
    ])
    print_json(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
