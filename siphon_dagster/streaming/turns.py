"""`Turns`: how many batches a run of many tables writes at once, and which waits least.

A group run's tables take turns to write (see `StreamConsumer.turns`): with more busy tables than
turns, batches wait in line, gathering what arrives meanwhile. A table's first batch goes ahead of
every later batch in that line. Until it lands the table is not streaming at all: its target table
is not made yet and its asset shows nothing, while a table already streaming only waits one line
more. When a run starts with hundreds of tables, their first batches otherwise queued behind the
second and third batches of the tables set up before them (500 tables: the last one streamed 48 s
after the first).
"""

from __future__ import annotations

import asyncio
from collections import deque


class Turns:
    """At most `count` turns held at once; waiters get them first-batch first, then in order.
    Used on one event loop."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"turns: at least one, not {count}")
        self._free = count
        # Waiting for a turn: tables whose first batch it is, then every other table, each in order.
        self._first: deque[asyncio.Future[None]] = deque()
        self._later: deque[asyncio.Future[None]] = deque()

    def locked(self) -> bool:
        """Whether an `acquire` now would wait."""
        return self._free <= 0 or self._waiting()

    async def acquire(self, first: bool = False) -> None:
        """Waits for a turn; `first`: for a table's first batch. Cancelled while waiting, it holds
        no turn (one granted as the wait was cancelled is handed on)."""
        if self._free > 0 and not self._waiting():
            self._free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        line = self._first if first else self._later
        line.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()
            else:
                turn.cancel()
                if turn in line:
                    line.remove(turn)
            raise

    def release(self) -> None:
        """Gives a turn back: to the first waiter in line, or to the free turns."""
        for line in (self._first, self._later):
            while line:
                turn = line.popleft()
                if not turn.done():
                    turn.set_result(None)
                    return
        self._free += 1

    def _waiting(self) -> bool:
        # The lines hold only waits still pending: a granted one is taken off by `release`, a
        # cancelled one by its `acquire`. Asked before every batch, so no walk over the lines.
        return bool(self._first or self._later)
