"""`ConnectionPerThread`: the connections a streaming run's tables share at one target.

A run serves hundreds of tables from a pool of a few threads, and a connection runs one statement
at a time. A connection per table would be hundreds of sessions (and logins, and at Snowflake a
temporary stage each) for the few statements that can run at once; a connection per thread of the
pool is as many as can be busy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)  # held connections are told apart by identity
class _Held:
    connection: Any
    generation: int  # the `close` it was opened after: a closed pool's connections are not reused
    # What lives and dies with this connection's session (a Snowflake temporary stage).
    session: dict[str, Any] = field(default_factory=dict)


class ConnectionPerThread:
    """Hands each thread its own connection, opened on its first statement and opened again when
    `is_open` says the old one has ended; `close` closes every one of them (a thread's next
    statement opens a new one)."""

    def __init__(self, open_connection: Callable[[], Any],
                 is_open: Callable[[Any], bool] = lambda connection: True) -> None:
        self._open_connection = open_connection
        self._is_open = is_open
        self._local = threading.local()
        self._lock = threading.Lock()
        self._held: list[_Held] = []
        self._generation = 0

    def _current(self) -> _Held:
        held: _Held | None = getattr(self._local, "held", None)
        if held is not None and held.generation == self._generation and self._is_open(held.connection):
            return held
        fresh = _Held(self._open_connection(), self._generation)
        with self._lock:
            if held is not None and held in self._held:
                self._held.remove(held)  # ended: its session's objects ended with it
            self._held.append(fresh)
        self._local.held = fresh
        return fresh

    def connection(self) -> Any:
        """The calling thread's connection."""
        return self._current().connection

    def session(self) -> dict[str, Any]:
        """Values of the calling thread's session, emptied when its connection is replaced."""
        return self._current().session

    def discard(self) -> None:
        """Forgets the calling thread's connection, whose session has ended: the thread's next
        statement opens another."""
        held: _Held | None = getattr(self._local, "held", None)
        if held is None:
            return
        self._local.held = None
        with self._lock:
            if held in self._held:
                self._held.remove(held)
        with contextlib.suppress(Exception):  # the session is gone: only the client's side is left
            held.connection.close()

    @property
    def opened(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, []
            self._generation += 1
        for each in held:
            each.connection.close()
