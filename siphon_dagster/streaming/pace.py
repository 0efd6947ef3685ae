"""`BatchPace`: how long each table's batch collects in a run that serves many tables.

Every batch costs the target a few statements and the run a few milliseconds whatever its size, so
a run whose hundreds of tables each cut a batch every `batch_max_wait_seconds` spends its time on
fixed costs and falls behind. The pace keeps a run near a budget of batches per second: with more
busy tables than the budget allows at the configured wait, each table's batch collects longer (and
holds more changes), up to a ceiling that bounds the lag it adds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CEILING_SECONDS = 5.0  # the longest a batch collects, whatever the number of busy tables
BUSY_WITHIN_SECONDS = 10.0  # a table that cut a batch this recently counts as busy
_RECOMPUTE_SECONDS = 0.5


class BatchPace:
    def __init__(self, floor_seconds: float, max_batches_per_second: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.floor_seconds = floor_seconds
        self.ceiling_seconds = max(floor_seconds, CEILING_SECONDS)
        self.max_batches_per_second = max_batches_per_second
        self._clock = clock
        self._last_batch: dict[str, float] = {}
        self._wait = floor_seconds
        self._computed_at = float("-inf")

    def record(self, table: str) -> None:
        """`table` cut a batch now."""
        self._last_batch[table] = self._clock()

    def busy_tables(self) -> int:
        since = self._clock() - BUSY_WITHIN_SECONDS
        return sum(1 for at in self._last_batch.values() if at >= since)

    def wait_seconds(self) -> float:
        """How long a batch collects after its first message."""
        now = self._clock()
        if now - self._computed_at >= _RECOMPUTE_SECONDS:
            wanted = self.busy_tables() / self.max_batches_per_second
            self._wait = min(self.ceiling_seconds, max(self.floor_seconds, wanted))
            self._computed_at = now
        return self._wait


# How a group run's batch gathered its messages after the first arrived, counted per target
# (`siphon_stream_batches_gathered_total`): nearly every batch waiting for a turn says the run's
# apply (its CPU, or the target) sets its pace, not `max_batches_per_second`.
GATHERED_BACKLOG = "backlog"  # more were already waiting: taken at once
GATHERED_FIRST = "first_batch"  # the table's first batch, which does not wait for the pace
GATHERED_IN_LINE = "waiting_for_turn"  # every turn was taken: it gathered while in line for one
GATHERED_PACED = "paced"  # it waited the pace's time (`BatchPace`), then took what had arrived


def gathering(backlog: bool, applied_any: bool, turns_taken: bool) -> str:
    """How a batch whose first message just arrived gathers the rest (GATHERED_*)."""
    if backlog:
        return GATHERED_BACKLOG
    if not applied_any:
        return GATHERED_FIRST
    return GATHERED_IN_LINE if turns_taken else GATHERED_PACED
