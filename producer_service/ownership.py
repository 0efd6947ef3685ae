"""One producer per application: a PostgreSQL session-level advisory lock derived from its identifier."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from siphon_core import naming


class LockHeldError(RuntimeError):
    """Another producer of the same application holds the lock."""


NOT_WAITING_HINT = "; stop it first, or set producer.on_lock_held: wait"


_HOLDER_QUERY = """
select a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), 'local'), a.backend_start
from pg_locks l join pg_stat_activity a on a.pid = l.pid
where l.locktype = 'advisory' and l.granted
  and l.classid = %s::bigint::oid and l.objid = %s::bigint::oid and l.objsubid = 1
"""


def _lock_parts(key: int) -> tuple[int, int]:
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


def describe_holder(connection: psycopg.Connection[Any], application_identifier: str) -> str:
    high, low = _lock_parts(naming.advisory_lock_key(application_identifier))
    row = connection.execute(_HOLDER_QUERY, (high, low)).fetchone()
    if row is None:
        return "an unknown session"
    pid, app, host, started = row
    # Another role's sessions show fewer details (no address, no start time) to a non-superuser.
    since = f", connected {started:%Y-%m-%d %H:%M:%S %Z}" if started is not None else ""
    return f"backend pid {pid} ({app or 'no application_name'} from {host}{since})"


def try_acquire(connection: psycopg.Connection[Any], application_identifier: str) -> str | None:
    """Takes the application's lock on `connection` (autocommit), held until the session ends;
    returns None when taken, else why not (naming the holder)."""
    key = naming.advisory_lock_key(application_identifier)
    if connection.execute("select pg_try_advisory_lock(%s)", (key,)).fetchone()[0]:
        return None
    holder = describe_holder(connection, application_identifier)
    return (f"another producer of application '{application_identifier}' is running: "
            f"the lock is held by {holder}")


def acquire(connection: psycopg.Connection[Any], application_identifier: str, wait: bool,
            poll_seconds: float = 2.0, log: Any = None) -> None:
    """Takes the application's lock on `connection` (autocommit), held until the session ends."""
    announced = False
    while True:
        refusal = try_acquire(connection, application_identifier)
        if refusal is None:
            return
        if not wait:
            raise LockHeldError(refusal + NOT_WAITING_HINT)
        if not announced and log is not None:
            log.warning("waiting for the application lock", reason=refusal)
            announced = True
        time.sleep(poll_seconds)
