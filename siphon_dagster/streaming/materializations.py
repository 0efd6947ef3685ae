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
    """Decides when a table's aggregated batches become a materialization. Not thread-safe."""

    def __init__(self, interval_seconds: float) -> None:
        self.interval_seconds = interval_seconds
        self._open: dict[str, AggregatedBatches] = {}
        self._last: dict[str, float] = {}

    def add(self, report: BatchReport, now: float) -> AggregatedBatches | None:
        """Adds a batch; returns the aggregate to materialize now, or None to wait."""
        aggregate = self._open.setdefault(report.table, AggregatedBatches(report.table))
        aggregate.add(report)
        urgent = report.schema_changed or bool(report.warnings)
        if urgent or now - self._last.get(report.table, -math.inf) >= self.interval_seconds:
            return self._take(report.table, now)
        return None

    def absorb(self, report: BatchReport) -> None:
        """Adds a batch to its table's aggregate whatever is due: `flush` reports it."""
        self._open.setdefault(report.table, AggregatedBatches(report.table)).add(report)

    def due(self, now: float) -> list[AggregatedBatches]:
        """Aggregates whose interval has passed since their table's last materialization (a table
        that went quiet after a batch is reported without waiting for another)."""
        return [self._take(table, now) for table in list(self._open)
                if now - self._last.get(table, -math.inf) >= self.interval_seconds]

    def flush(self, now: float) -> list[AggregatedBatches]:
        """Every aggregate still open, e.g. when the run ends."""
        return [self._take(table, now) for table in list(self._open)]

    def _take(self, table: str, now: float) -> AggregatedBatches:
        self._last[table] = now
        return self._open.pop(table)
