"""What the benchmarks share: services on loopback in a temporary directory, a notes-shaped table, tables of figures."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from siphon_stack.nats import NatsServer  # noqa: E402
from siphon_stack.postgres import PostgresServer, find_bindir  # noqa: E402
from siphon_stack.process import free_port, port_accepts, start_process, stop_pid, wait_until  # noqa: E402


def stop_on_signals() -> None:
    """SIGTERM and SIGINT unwind the benchmark like Ctrl-C, so every process it started is stopped
    on the way out: a shell that starts a job in the background has it ignore SIGINT, and SIGTERM
    would otherwise end the benchmark alone, its `dagster dev` and servers left running."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


# About 30 columns and 750 bytes a row, like a code-hosting application's notes.
NOTES_DDL = """
create table {name} (
    id bigserial primary key,
    note text not null,
    noteable_type varchar(255),
    author_id bigint,
    created_at timestamptz default now(),
    updated_at timestamptz default now(),
    project_id bigint,
    line_code varchar(255),
    commit_id varchar(255),
    noteable_id bigint,
    system boolean not null default false,
    st_diff text,
    updated_by_id bigint,
    type varchar(255),
    position text,
    original_position text,
    resolved_at timestamptz,
    resolved_by_id bigint,
    discussion_id varchar(255),
    note_html text,
    cached_markdown_version integer,
    change_position text,
    resolved_by_push boolean,
    review_id bigint,
    confidential boolean,
    last_edited_at timestamptz,
    internal boolean not null default false,
    imported_from smallint not null default 0,
    namespace_id bigint,
    organization_id bigint
)
"""

NOTES_INSERT_SELECT = """
insert into {name} (note, noteable_type, author_id, project_id, line_code, commit_id, noteable_id, st_diff,
    updated_by_id, type, position, discussion_id, note_html, cached_markdown_version, review_id, confidential,
    namespace_id, organization_id)
select repeat('a useful comment about the change ', 6) || g, 'MergeRequest', g % 5000, g % 700,
    md5(g::text) || '_12_14', md5((g * 7)::text), g % 90000, null, g % 5000, 'DiffNote',
    '{{"base_sha":"' || md5(g::text) || '","start_line":12}}', md5((g * 3)::text),
    '<p>a useful comment about the change ' || g || '</p>', 2072576, g % 300, g % 50 = 0, g % 700, 1
from generate_series({first}, {last}) g
"""


@dataclass
class Services:
    directory: Path
    postgres: PostgresServer
    postgres_pid: int
    nats: NatsServer | None = None
    nats_pid: int | None = None
    clickhouse_url: str | None = None
    clickhouse_pid: int | None = None

    @property
    def dsn(self) -> str:
        return self.postgres.dsn


@contextlib.contextmanager
def services(nats: bool = True, clickhouse: bool = False) -> Iterator[Services]:
    with tempfile.TemporaryDirectory(prefix="siphon-bench-") as tmp:
        directory = Path(tmp)
        os.chmod(directory, 0o755)
        pg = PostgresServer(directory / "postgres", free_port(), find_bindir())
        pg.initialize()
        started = Services(directory, pg, pg.start())
        try:
            if nats:
                started.nats = NatsServer(directory / "nats", free_port(), free_port())
                started.nats_pid = started.nats.start()
            if clickhouse:
                port = free_port()
                log = directory / "clickhouse.log"
                process = start_process("siphon-clickhouse", [sys.executable, "-m", "siphon_stack.clickhouse_server",
                                                              "--data-dir", str(directory / "ch"), "--port", str(port)],
                                        log)
                started.clickhouse_pid = process.pid
                wait_until("embedded ClickHouse", lambda: port_accepts(port), 90, pid=process.pid, log_path=log)
                started.clickhouse_url = f"http://127.0.0.1:{port}"
            yield started
        finally:
            for pid in (started.clickhouse_pid, started.nats_pid):
                if pid:
                    stop_pid(pid)
            pg.stop(started.postgres_pid)


def create_notes_table(dsn: str, name: str = "notes") -> None:
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(f"drop table if exists {name}")
        connection.execute(NOTES_DDL.format(name=name))


def peak_rss_mb(pid: int) -> float:
    with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    """Rows of (figure, measured, reference or target)."""
    width = max(len(r[0]) for r in rows)
    print(f"\n{title}")
    print(f"{'figure'.ljust(width)}  {'measured':>16}  {'reference / target':>24}")
    for name, measured, reference in rows:
        print(f"{name.ljust(width)}  {measured:>16}  {reference:>24}")


def print_json(figures: dict[str, float]) -> None:
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in figures.items()}))


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition") -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout:.0f}s")
