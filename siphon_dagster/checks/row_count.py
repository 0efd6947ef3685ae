"""Row count: the source's rows at one read against the target's, allowing for changes in flight.

The source is counted in a REPEATABLE READ transaction whose LSN L is noted; once the table's stream
applied past L, the target is counted around V = (L, 0): C1 current rows at or below V, C2 above it,
T2 keys deleted after it. Without drift C1 <= S <= C1 + C2 + T2 (changes after the read can only
have added, changed or deleted rows the read counted). Outside that band is drift; inside it and
unequal, changes are still moving, so the count is read again a few times before it passes.
"""

from __future__ import annotations

import time

from siphon_core import naming
from siphon_dagster import source
from siphon_dagster.checks import source_digest
from siphon_dagster.checks.digest import CountBand
from siphon_dagster.checks.outcome import ERROR, WARN, CheckContext, Outcome
from siphon_dagster.checks.stream_position import wait_until_applied

NAME = "row_count"
SEVERITY = ERROR
DESCRIPTION = ("The target holds as many current rows as the source, allowing only for changes committed after "
               "the source was counted and not yet applied; fails on rows deleted or added at the target, or "
               "never received from the stream.")


def read_band(context: CheckContext) -> tuple[CountBand | None, dict, str]:
    with source.connect(context.source_dsn, autocommit=True) as connection:
        table = source.table_schema(connection, context.spec.table)
    with source_digest.snapshot_read(context.source_dsn) as read:
        rows = source_digest.count_rows(read.connection, table)
        lsn = source_digest.snapshot_lsn(read.connection)
    waited = wait_until_applied(context.watch, lsn, context.settings.settle_timeout_seconds)
    metadata = {"source_lsn": naming.format_lsn(lsn), "stream_wait_seconds": round(waited.seconds, 3)}
    if not waited.caught_up:
        return None, metadata, waited.detail
    # Rows at or below the position read before the snapshot are in it as they are at the target.
    counts = context.target.version_counts(table, read.version_before)
    return CountBand(rows, counts.at_or_below, counts.above, counts.tombstones_above), metadata, waited.detail


def check(context: CheckContext) -> Outcome:
    bands: list[CountBand] = []
    metadata: dict = {}
    for attempt in range(1, context.settings.settle_attempts + 1):
        if attempt > 1:
            time.sleep(context.settings.settle_interval_seconds)
        band, metadata, detail = read_band(context)
        if band is None:
            return Outcome(False, f"could not settle: {detail}", {**metadata, "attempts": attempt}, WARN)
        bands.append(band)
        metadata.update({"source_rows": band.source, "target_rows_at_or_before_read": band.at_or_below,
                         "target_rows_after_read": band.above, "target_deletions_after_read": band.tombstones_above,
                         "attempts": attempt})
        if band.settled and not band.drift:
            return Outcome(True, f"{band.source} rows at both ends", metadata)
    last = bands[-1]
    # A commit that reached the WAL before the read's LSN but was not yet visible to its snapshot
    # can put one read outside the band; drift puts every read outside it.
    if all(b.drift for b in bands):
        return Outcome(False, f"drift: {last.describe()}; expected {last.at_or_below} <= {last.source} <= "
                              f"{last.at_or_below + last.above + last.tombstones_above}", metadata)
    return Outcome(True, f"inside the in-flight band after {len(bands)} reads: {last.describe()}",
                   {**metadata, "in_flight_band": True})
