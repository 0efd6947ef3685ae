"""`CreatedTables`: which tables a group run's stream made at its target had been there before.

A batch that found no table at the target made it. A table never materialized is new there; one
materialized before was lost (dropped by hand, a database restored) and must be loaded again, which
the run signals on its asset (`snapshot_sensor.made_anew`). Asked one table at a time, Dagster's
SQLite storage took about 5 ms of CPU a table (a run of 500 new tables starting spent 2.5 s of it on
its reporting thread); asked for a hundred assets in one read, 0.2 ms a table.

So a made table's reports are held, and the next tick asks for every held table at once. A table's
own materializations come from those reports, so holding them keeps the answer about what came
before the stream made it: none of its batches is materialized until it is answered. A table the
stream made twice before it was answered had been there the second time (the first made it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from siphon_dagster.streaming.report import BatchReport

CHUNK = 100  # assets asked for in one read


@dataclass
class Answered:
    made_again: list[str] = field(default_factory=list)  # had been at the target: to be loaded again
    new: list[str] = field(default_factory=list)  # never materialized: new at the target
    reports: list[BatchReport] = field(default_factory=list)  # the held reports, in the order they came


class CreatedTables:
    """`materialized(tables)` returns which of `tables` have ever been materialized at this target
    (called with at most `CHUNK` at a time). Used from one thread (the run's reporting thread)."""

    def __init__(self, materialized: Callable[[Sequence[str]], set[str]]) -> None:
        self._materialized = materialized
        self._held: dict[str, list[tuple[int, BatchReport]]] = {}  # table -> (arrival, report) since it was made
        self._arrivals = 0

    def hold(self, report: BatchReport) -> bool:
        """Keeps `report` when it made its table or its table waits for an answer; False: not held."""
        if report.created_table or report.table in self._held:
            self._arrivals += 1
            self._held.setdefault(report.table, []).append((self._arrivals, report))
            return True
        return False

    def answer(self) -> Answered:
        """Asks about every held table, and hands back their reports."""
        answered = Answered()
        if not self._held:
            return answered
        tables = list(self._held)
        before: set[str] = set()
        for start in range(0, len(tables), CHUNK):  # a read that fails leaves every report held
            before |= self._materialized(tables[start:start + CHUNK])
        held, self._held = self._held, {}
        arrived: list[tuple[int, BatchReport]] = []
        for table in tables:
            made = sum(1 for _, report in held[table] if report.created_table)
            (answered.made_again if table in before or made > 1 else answered.new).append(table)
            arrived.extend(held[table])
        answered.reports = [report for _, report in sorted(arrived, key=lambda pair: pair[0])]
        return answered
