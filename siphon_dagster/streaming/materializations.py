"""At most one materialization per table per interval: the batches between are aggregated.

A group run serves hundreds of tables whose batches come every second or so; one event per batch
would flood Dagster's event log. A batch that changed the schema or carries a warning is reported
at once (with whatever was aggregated before it), since an operator may have to act on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from siphon_core import naming
from siphon_dagster.streaming.report import BatchReport

BURST_SECONDS = 5.0


@dataclass
class AggregatedBatches:
    """The batches of one table since its last materialization."""

    table: str
    batches: int = 0
    events: int = 0
    rows_applied: int = 0
    rows_by_operation: dict[str, int] = field(default_factory=dict)
    applied_lsn: int = 0
    first_sequence: int = 0
    last_sequence: int = 0
    lag_seconds: float = 0.0  # of the latest batch: now - its newest commit time
    lag_max_seconds: float = 0.0  # the largest oldest-commit lag of any batch aggregated
    pending: int = 0
    decoded_in_driver: int = 0  # batches decoded in the run's process rather than by Spark tasks
    schema_changed: bool = False
    warnings: list[str] = field(default_factory=list)

    def add(self, report: BatchReport) -> None:
        if not self.batches:
            self.first_sequence = report.first_sequence
        self.batches += 1
        self.events += report.events
        self.rows_applied += report.rows_applied
        for name, count in report.rows_by_operation.items():
            self.rows_by_operation[name] = self.rows_by_operation.get(name, 0) + count
        self.applied_lsn = max(self.applied_lsn, report.applied_lsn)
        self.last_sequence = max(self.last_sequence, report.last_sequence)
        self.lag_seconds = report.lag_newest_seconds
        self.lag_max_seconds = max(self.lag_max_seconds, report.lag_oldest_seconds)
        self.pending = report.pending
        self.decoded_in_driver += int(report.decoded_in_driver)
        self.schema_changed = self.schema_changed or report.schema_changed
        self.warnings += report.warnings

    @property
    def applied_lsn_text(self) -> str:
        return naming.format_lsn(self.applied_lsn)


class MaterializationLimiter:
    """Decides when a table's aggregated batches become a materialization. Not thread-safe.

    `max_per_second`: a budget over all the run's tables. Each materialization costs the run a few
    writes to Dagster's event log, and the sensors and the daemon read them: at 500 tables and one
    a minute each, a run on SQLite storage spent its reporting thread on them and its reports fell
    minutes behind. Tables whose interval passed then wait their turn, the longest unreported (a
    table never materialized) first, and aggregate on. Schema changes and warnings never wait.
    """

    def __init__(self, interval_seconds: float, max_per_second: float | None = None) -> None:
        self.interval_seconds = interval_seconds
        self.max_per_second = max_per_second
        # Up to BURST_SECONDS of the budget may go at once: a run of a few tables reports them all
        # together, and a tick (every few seconds) finds the budget of the seconds since the last.
        self._capacity = max(1.0, (max_per_second or 0.0) * BURST_SECONDS)
        self._tokens = self._capacity
        self._refilled_at: float | None = None
        self._behind = False  # the last look left tables due for want of budget
        self._open: dict[str, AggregatedBatches] = {}
        self._last: dict[str, float] = {}

    def add(self, report: BatchReport, now: float) -> AggregatedBatches | None:
        """Adds a batch; returns the aggregate to materialize now, or None to wait."""
        aggregate = self._open.setdefault(report.table, AggregatedBatches(report.table))
        aggregate.add(report)
        if report.schema_changed or report.warnings:
            self._spend(now, force=True)
            return self._take(report.table, now)
        # While tables wait for the budget, a table's batch does not go before them: `due` serves
        # them, longest waiting first.
        if self._is_due(report.table, now) and not self._behind and self._spend(now):
            return self._take(report.table, now)
        return None

    def absorb(self, report: BatchReport) -> None:
        """Adds a batch to its table's aggregate whatever is due: `flush` reports it."""
        self._open.setdefault(report.table, AggregatedBatches(report.table)).add(report)

    def due(self, now: float) -> list[AggregatedBatches]:
        """Aggregates whose interval has passed since their table's last materialization (a table
        that went quiet after a batch is reported without waiting for another), as many as the
        budget allows."""
        waiting = sorted((table for table in self._open if self._is_due(table, now)),
                         key=lambda table: self._last.get(table, -math.inf))
        taken = []
        for table in waiting:
            if not self._spend(now):
                break
            taken.append(self._take(table, now))
        self._behind = len(taken) < len(waiting)
        return taken

    def flush(self, now: float) -> list[AggregatedBatches]:
        """Every aggregate still open, e.g. when the run ends."""
        return [self._take(table, now) for table in list(self._open)]

    def _is_due(self, table: str, now: float) -> bool:
        return now - self._last.get(table, -math.inf) >= self.interval_seconds

    def _spend(self, now: float, force: bool = False) -> bool:
        """Takes one materialization from the budget; `force`: even below nothing, down to one
        burst below (the tables waiting then wait longer, but a schema change of hundreds of tables
        at once does not hold every routine materialization back for minutes)."""
        if self.max_per_second is None:
            return True
        if self._refilled_at is not None:
            self._tokens = min(self._capacity, self._tokens + (now - self._refilled_at) * self.max_per_second)
        self._refilled_at = now
        if self._tokens >= 1.0 or force:
            self._tokens = max(-self._capacity, self._tokens - 1.0)
            return True
        return False

    def _take(self, table: str, now: float) -> AggregatedBatches:
        self._last[table] = now
        return self._open.pop(table)
