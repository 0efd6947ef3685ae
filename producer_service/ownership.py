"""One producer per application: a PostgreSQL session-level advisory lock derived from its identifier."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from siphon_core import naming


class LockHeldError(RuntimeError):
    """Another producer of the same application holds the lock."""


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
    return f"backend pid {pid} ({app or 'no application_name'} from {host}, connected {started:%Y-%m-%d %H:%M:%S %Z})"


def acquire(connection: psycopg.Connection[Any], application_identifier: str, wait: bool,
            poll_seconds: float = 2.0, log: Any = None) -> None:
    """Takes the application's lock on `connection` (autocommit), held until the session ends."""
    key = naming.advisory_lock_key(application_identifier)
    announced = False
    while True:
        locked = connection.execute("select pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
        if locked:
            return
        holder = describe_holder(connection, application_identifier)
        message = (f"another producer of application '{application_identifier}' is running: "
                   f"the lock is held by {holder}")
        if not wait:
            raise LockHeldError(message + "; stop it first, or set producer.on_lock_held: wait")
        if not announced and log is not None:
            log.warning("waiting for the application lock", holder=holder)
            announced = True
        time.sleep(poll_seconds)
