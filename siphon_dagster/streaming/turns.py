"""`Turns`: how many batches a run of many tables writes at once, and which waits least.

A group run's tables take turns to write (see `StreamConsumer.turns`): with more busy tables than
turns, batches wait in line, gathering what arrives meanwhile. A table's first batch goes ahead of
every later batch in that line. Until it lands the table is not streaming at all: its target table
is not made yet and its asset shows nothing, while a table already streaming only waits one line
more. When a run starts with hundreds of tables, their first batches otherwise queued behind the
second and third batches of the tables set up before them (500 tables: the last one streamed 48 s
after the first).

First batches may also have turns of their own (`first_extra`), which no later batch takes. A
first batch waits on more than the target's write (the table and its view are created, the
source's catalog is read, its first event is recorded), so more of them at once keep the machine
busier while a run starts, and the turns of the tables already streaming stay as many as the
target is best written with.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque


class Turn(enum.Enum):
    SHARED = "shared"  # one of the `count` turns every batch may take
    FIRST_ONLY = "first only"  # one of the `first_extra` turns only a table's first batch takes


class Turns:
    """At most `count` turns held at once, and `first_extra` more that only first batches take;
    waiters get them first-batch first, then in order. Used on one event loop."""

    def __init__(self, count: int, first_extra: int = 0) -> None:
        if count < 1:
            raise ValueError(f"turns: at least one, not {count}")
        if first_extra < 0:
            raise ValueError(f"turns for first batches only: zero or more, not {first_extra}")
        self._free = count
        self._first_free = first_extra
        # Waiting for a turn: tables whose first batch it is, then every other table, each in order.
        self._first: deque[asyncio.Future[Turn]] = deque()
        self._later: deque[asyncio.Future[Turn]] = deque()

    def locked(self, first: bool = False) -> bool:
        """Whether an `acquire(first)` now would wait."""
        if first:
            return (self._free <= 0 and self._first_free <= 0) or bool(self._first)
        return self._free <= 0 or self._waiting()

    async def acquire(self, first: bool = False) -> Turn:
        """Waits for a turn and returns it (give it back to `release`); `first`: for a table's
        first batch, which takes a turn of its own before a shared one. Cancelled while waiting,
        it holds no turn (one granted as the wait was cancelled is handed on)."""
        if first and self._first_free > 0 and not self._first:
            self._first_free -= 1
            return Turn.FIRST_ONLY
        if self._free > 0 and not self._waiting():
            self._free -= 1
            return Turn.SHARED
        turn = asyncio.get_running_loop().create_future()
        line = self._first if first else self._later
        line.append(turn)
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release(turn.result())
            else:
                turn.cancel()
                if turn in line:
                    line.remove(turn)
            raise

    def release(self, turn: Turn = Turn.SHARED) -> None:
        """Gives a turn back: to the first waiter in line that may take it, or to the free turns."""
        lines = (self._first, self._later) if turn is Turn.SHARED else (self._first,)
        for line in lines:
            while line:
                waiter = line.popleft()
                if not waiter.done():
                    waiter.set_result(turn)
                    return
        if turn is Turn.SHARED:
            self._free += 1
        else:
            self._first_free += 1

    def _waiting(self) -> bool:
        # The lines hold only waits still pending: a granted one is taken off by `release`, a
        # cancelled one by its `acquire`. Asked before every batch, so no walk over the lines.
        return bool(self._first or self._later)
