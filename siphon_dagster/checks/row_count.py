"""Row count: the source's rows at one read against the target's, exactly, however busy the table.

The source is counted in a REPEATABLE READ transaction whose LSN L is noted, and the transaction is
held while the table's stream applies past L. The target is then read once around V = (L, 0): C1
current rows with no version above V, and the keys with a version above V (changed since, current
or deleted), which are looked up in the held read. Without drift the source's count S equals C1
plus those keys the read holds (see `ExactCount`); any other difference is drift (rows deleted or
added at the target by hand, changes the stream never received), on a quiet table or a busy one.

C1 and the changed keys come from one statement (`Target.changes_around`), so from one state of
the table whatever the stream applies meanwhile. With more than `checks.row_count_max_changed_keys`
changed keys the read is repeated; the band C1 <= S <= C1 + C2 + T2 (C2 current rows above V, T2
keys deleted after it) still fails counts no in-flight change explains, and otherwise the check
warns that it could not compare.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from siphon_core import naming
from siphon_dagster import source
from siphon_dagster.checks import source_digest
from siphon_dagster.checks.digest import CountBand, ExactCount
from siphon_dagster.checks.outcome import ERROR, WARN, CheckContext, Outcome
from siphon_dagster.checks.stream_position import wait_until_applied
from siphon_dagster.targets.base import TableSchema

NAME = "row_count"
SEVERITY = ERROR
DESCRIPTION = ("The target holds as many current rows as the source at one read, comparing the keys changed "
               "since the read at the read itself; fails on rows deleted or added at the target, or never "
               "received from the stream, however busy the table.")
EXACT_MISMATCHES_TO_FAIL = 2  # two reads that disagree exactly (or every read there was) are drift


@dataclass(frozen=True)
class CountRead:
    band: CountBand
    exact: ExactCount | None  # None: this read could not be compared exactly (`why`)
    why: str = ""


def read_counts(context: CheckContext) -> tuple[CountRead | None, dict, str]:
    """One read: None (with the wait's detail) when the stream did not apply the source's read in time."""
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
        limit = context.settings.row_count_max_changed_keys
        # Keys alone: a column the target lacks (schema parity's finding) must not stop the count.
        keys = TableSchema(table.schema, table.table, table.key_columns)
        changes = context.target.changes_around(keys, read.version_before, limit)
        counts = changes.counts
        band = CountBand(rows, counts.at_or_below, counts.above, counts.tombstones_above)
        if changes.changed_keys is None:
            exact, why = None, f"more than {limit} keys changed since the read (checks.row_count_max_changed_keys)"
        else:
            exact, why = _exact(read.connection, keys, band, changes.changed_keys), ""
    return CountRead(band, exact, why), metadata, waited.detail


def _exact(connection: psycopg.Connection[Any], keys: TableSchema, band: CountBand,
           changed: list[tuple[str, ...]]) -> ExactCount:
    held = len(source_digest.key_rows(connection, keys, changed)) if changed else 0
    return ExactCount(band.source, band.at_or_below, len(changed), held)


def verdict(reads: Sequence[CountRead], attempts: int) -> Outcome | None:
    """The outcome of the reads so far, or None to read again (`attempts` reads are allowed)."""
    last = reads[-1]
    if last.exact is not None and last.exact.difference == 0:
        changed = last.exact.changed_keys
        note = f" ({changed} keys changed since the read, compared at it)" if changed else ""
        return Outcome(True, f"{last.band.source} rows at both ends{note}")
    mismatches = [r.exact for r in reads if r.exact is not None and r.exact.difference != 0]
    if len(mismatches) < EXACT_MISMATCHES_TO_FAIL and len(reads) < attempts:
        return None
    if mismatches:
        exact = mismatches[-1]
        where = "missing at" if exact.difference < 0 else "extra at"
        # The figures of the read that disagreed (a later read may not have been exact).
        return Outcome(False, f"drift: {abs(exact.difference)} rows {where} the target among keys unchanged since "
                              f"the source's read: {exact.describe()}",
                       {"difference": exact.difference, "keys_changed_after_read": exact.changed_keys,
                        "changed_keys_in_source_read": exact.changed_at_source})
    band = last.band
    if all(r.band.drift for r in reads):
        return Outcome(False, f"drift: {band.describe()}; expected {band.at_or_below} <= {band.source} <= "
                              f"{band.at_or_below + band.above + band.tombstones_above}")
    return Outcome(False, f"could not compare exactly in {len(reads)} reads ({last.why}); the counts are inside "
                          f"the in-flight band: {band.describe()}", {}, WARN)


def check(context: CheckContext) -> Outcome:
    reads: list[CountRead] = []
    metadata: dict = {}
    for attempt in range(1, context.settings.settle_attempts + 1):
        if attempt > 1:
            time.sleep(context.settings.settle_interval_seconds)
        read, metadata, detail = read_counts(context)
        if read is None:
            return Outcome(False, f"could not settle: {detail}", {**metadata, "attempts": attempt}, WARN)
        reads.append(read)
        band = read.band
        metadata.update({"source_rows": band.source, "target_rows_at_or_before_read": band.at_or_below,
                         "target_rows_after_read": band.above, "target_deletions_after_read": band.tombstones_above,
                         "attempts": attempt})
        if read.exact is not None:
            metadata.update({"keys_changed_after_read": read.exact.changed_keys,
                             "changed_keys_in_source_read": read.exact.changed_at_source,
                             "difference": read.exact.difference})
        outcome = verdict(reads, context.settings.settle_attempts)
        if outcome is not None:
            outcome.metadata = {**metadata, **outcome.metadata}
            return outcome
    raise AssertionError("verdict decides at the last attempt")  # pragma: no cover
