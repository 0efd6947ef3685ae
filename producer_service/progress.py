"""Which LSN may be reported to PostgreSQL as flushed.

Only the end LSN of a transaction whose every event JetStream has acknowledged, and never a
position inside a transaction: a restarted producer then resumes at a transaction boundary and
may resend, but never skips, a change.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque


class ProgressTracker:
    def __init__(self, start_lsn: int = 0) -> None:
        self._next_ordinal = 0
        self._open_ordinal: int | None = None
        # Committed transactions not yet confirmed: (ordinal, end_lsn), in commit order.
        self._committed: deque[tuple[int, int]] = deque()
        # Ordinal of the earliest transaction each pending holder (buffer or package) contains.
        self._pending: Counter[int] = Counter()
        self._pending_heap: list[int] = []
        self.confirmed_lsn = start_lsn

    def begin(self) -> int:
        """A transaction started; returns its ordinal, which holders of its events refer to."""
        ordinal = self._next_ordinal
        self._next_ordinal += 1
        self._open_ordinal = ordinal
        return ordinal

    def commit(self, end_lsn: int) -> None:
        if self._open_ordinal is None:
            raise RuntimeError(f"commit at {end_lsn:X} without a transaction in progress")
        self._committed.append((self._open_ordinal, end_lsn))
        self._open_ordinal = None
        self._advance()

    def hold(self, ordinal: int) -> None:
        """Something (a buffer, a package in flight) holds events of transactions >= ordinal."""
        if self._pending[ordinal] == 0:
            heapq.heappush(self._pending_heap, ordinal)
        self._pending[ordinal] += 1

    def release(self, ordinal: int) -> None:
        self._pending[ordinal] -= 1
        if self._pending[ordinal] == 0:
            del self._pending[ordinal]
        self._advance()

    def idle_position(self, wal_end: int) -> None:
        """Nothing in flight and the server says WAL ends at `wal_end`: it may be confirmed."""
        if self._open_ordinal is None and not self._pending and not self._committed and wal_end > self.confirmed_lsn:
            self.confirmed_lsn = wal_end

    @property
    def has_pending(self) -> bool:
        """Some buffer or package still holds events not acknowledged."""
        return bool(self._pending)

    @property
    def in_flight(self) -> int:
        return sum(self._pending.values())

    def _barrier(self) -> int | None:
        while self._pending_heap and self._pending_heap[0] not in self._pending:
            heapq.heappop(self._pending_heap)
        return self._pending_heap[0] if self._pending_heap else None

    def _advance(self) -> None:
        barrier = self._barrier()
        while self._committed and (barrier is None or self._committed[0][0] < barrier):
            _, end_lsn = self._committed.popleft()
            self.confirmed_lsn = max(self.confirmed_lsn, end_lsn)
