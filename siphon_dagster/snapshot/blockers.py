"""Why a range's snapshot waits: the transactions its temporary slot waits for, named while it waits.

Creating a logical slot waits until every transaction that held a transaction id when it started
has ended (the slot's snapshot must not miss any of their changes). A session left idle in a
transaction can make that last hours; this watch reports the backends holding it, from a
connection of its own, and past a limit ends the slot's creation (its backend is terminated, and
a temporary slot never outlives its backend) so the run fails with that report instead of hanging.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from siphon_core.logs import get_logger
from siphon_dagster.source import connect

log = get_logger("snapshot")
CHECK_SECONDS = 5.0
REPEAT_SECONDS = 60.0  # an unchanged report is repeated this often, a changed one at once
SLOT_GONE_SECONDS = 10.0

# Backends other than the slot's that hold a transaction id and began their transaction before the
# wait did (later ones do not hold the slot back). The interval is measured here and subtracted on
# the server, so no clock but the server's is compared.
_BLOCKERS = """
select pid, extract(epoch from statement_timestamp() - xact_start)::float8, state,
       query_start::text, usename::text, application_name
from pg_stat_activity
where backend_xid is not null and pid <> %(slot_pid)s
  and xact_start <= statement_timestamp() - make_interval(secs => %(waited)s)
order by xact_start
"""


@dataclass(frozen=True)
class BlockingBackend:
    pid: int
    transaction_seconds: float
    state: str | None
    query_start: str | None
    user: str | None
    application_name: str | None

    def text(self) -> str:
        return (f"pid {self.pid} ({self.user or '?'}, {self.application_name or 'no application name'}): "
                f"transaction open {self.transaction_seconds:,.0f}s, state {self.state or 'unknown'}, "
                f"last query started {self.query_start or 'never'}")


@dataclass(frozen=True)
class WaitReport:
    """The backends a snapshot of `table` waits for, after `waited_seconds`."""

    table: str
    waited_seconds: float
    blockers: tuple[BlockingBackend, ...]
    limit_seconds: float = 0.0

    def text(self) -> str:
        limit = f" (limit {self.limit_seconds:,.0f}s, source.snapshot_wait_limit_seconds)" if self.limit_seconds else ""
        if not self.blockers:
            head = (f"snapshot of {self.table} has waited {self.waited_seconds:,.0f}s{limit} for its replication "
                    "slot; no backend of this server holds a transaction id older than the wait (on a standby, "
                    "look at the primary)")
            return head
        names = "; ".join(b.text() for b in self.blockers)
        return (f"snapshot of {self.table} has waited {self.waited_seconds:,.0f}s{limit} for transactions open "
                f"since before it began to end: {names}. End them (commit, roll back, or "
                "pg_terminate_backend(pid)) and the snapshot goes on")

    def metadata(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "waited_seconds": round(self.waited_seconds, 1),
            "limit_seconds": self.limit_seconds,
            "blocking_pids": [b.pid for b in self.blockers],
            "blockers": [
                {"pid": b.pid, "transaction_seconds": round(b.transaction_seconds, 1), "state": b.state,
                 "query_start": b.query_start, "user": b.user, "application_name": b.application_name}
                for b in self.blockers
            ],
        }


class SnapshotWaitLimitError(RuntimeError):
    """A range's slot waited longer than source.snapshot_wait_limit_seconds; `report` says for whom."""

    def __init__(self, report: WaitReport) -> None:
        super().__init__(f"{report.text()}; gave up after the limit, no slot was left behind")
        self.report = report


def blocking_backends(connection: psycopg.Connection[Any], slot_pid: int, waited_seconds: float) -> tuple[BlockingBackend, ...]:
    rows = connection.execute(_BLOCKERS, {"slot_pid": slot_pid, "waited": waited_seconds}).fetchall()
    return tuple(BlockingBackend(*row) for row in rows)


class _Watch:
    def __init__(self, dsn: str, table: str, slot_pid: int, limit_seconds: float, check_seconds: float,
                 on_report: Callable[[WaitReport], None]) -> None:
        self.dsn, self.table, self.slot_pid = dsn, table, slot_pid
        self.limit_seconds, self.check_seconds, self.on_report = limit_seconds, check_seconds, on_report
        self.started = time.monotonic()
        self.done = threading.Event()
        self.exceeded: WaitReport | None = None
        self.last: WaitReport | None = None
        self._connection: psycopg.Connection[Any] | None = None
        self._thread = threading.Thread(target=self._run, name=f"snapshot wait watch {table}", daemon=True)

    def _run(self) -> None:
        last_pids: tuple[int, ...] | None = None
        last_reported = 0.0
        failed: str | None = None
        while not self.done.wait(self.check_seconds):
            waited = time.monotonic() - self.started
            try:
                if self._connection is None:  # only a wait that lasts costs a connection
                    self._connection = connect(self.dsn, autocommit=True, application_name="siphon snapshot watch")
                report = WaitReport(self.table, waited, blocking_backends(self._connection, self.slot_pid, waited),
                                    self.limit_seconds)
                if self.done.is_set():
                    return
                self.last = report
                pids = tuple(b.pid for b in report.blockers)
                over = bool(self.limit_seconds) and waited >= self.limit_seconds
                if over or pids != last_pids or time.monotonic() - last_reported >= REPEAT_SECONDS:
                    self.on_report(report)
                    last_pids, last_reported = pids, time.monotonic()
                if over:
                    self._connection.execute("select pg_terminate_backend(%s)", (self.slot_pid,))
                    self.exceeded = report
                    return
            except Exception as error:
                # Tried again at the next check (a full server refuses a connection for a while):
                # a watch that gave up would let the wait outlast its limit.
                if str(error) != failed:
                    log.warning("watching a snapshot's wait for its slot failed; trying again", error=str(error))
                    failed = str(error)
                self._drop_connection()

    def _drop_connection(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None

    def wait_for_slot_gone(self, slot_name: str) -> None:
        """A terminated backend drops its temporary slot as it exits; wait until it has."""
        if self._connection is None:
            return
        deadline = time.monotonic() + SLOT_GONE_SECONDS
        while time.monotonic() < deadline:
            row = self._connection.execute("select count(*) from pg_replication_slots where slot_name = %s",
                                           (slot_name,)).fetchone()
            if not row or not row[0]:
                return
            time.sleep(0.1)
        log.warning("temporary slot %s is still listed %.0fs after its backend was terminated", slot_name,
                    SLOT_GONE_SECONDS)

    def stop(self) -> None:
        self.done.set()
        self._thread.join()


@contextmanager
def watch_slot_wait(dsn: str, table: str, slot_pid: int, slot_name: str, limit_seconds: float,
                    on_report: Callable[[WaitReport], None], check_seconds: float = CHECK_SECONDS) -> Iterator[_Watch]:
    """Watches the slot creation that runs in the block (on backend `slot_pid`); raises
    SnapshotWaitLimitError if the limit ended it."""
    watch = _Watch(dsn, table, slot_pid, limit_seconds, check_seconds, on_report)
    watch._thread.start()
    try:
        try:
            yield watch
        finally:
            watch.stop()
        # Also when the creation returned just as the limit ended its backend: the slot is gone.
        if watch.exceeded is not None:
            watch.wait_for_slot_gone(slot_name)
            raise SnapshotWaitLimitError(watch.exceeded)
    except SnapshotWaitLimitError:
        raise
    except BaseException:
        if watch.exceeded is not None:
            watch.wait_for_slot_gone(slot_name)
            raise SnapshotWaitLimitError(watch.exceeded) from None
        raise
    finally:
        if watch._connection is not None:
            watch._connection.close()
