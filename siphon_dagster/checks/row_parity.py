"""Row parity: every value of every row, compared through digests computed inside each database.

Rows are hashed and grouped into buckets by key (checks.digest); only the buckets whose digests
differ are read row by row, and only their keys are compared. A key whose target version is newer
than the source's read changed since; it is read again, at both ends, after the stream has applied
the new read. What differs at a version the stream had passed, at two reads, is divergent (see
`digest.settle` for why one read is not enough).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from siphon_core.config import ChecksConfig
from siphon_dagster import source
from siphon_dagster.checks import source_digest
from siphon_dagster.checks.digest import (
    KeyRead,
    ParityReport,
    bucket_digits,
    classify,
    mismatched_buckets,
    settle,
)
from siphon_dagster.checks.outcome import ERROR, CheckContext, Outcome
from siphon_dagster.checks.stream_position import StreamWatch, wait_until_applied
from siphon_dagster.specs import TableSpec
from siphon_dagster.targets.base import TableSchema, Target, TargetError

NAME = "row_parity"
SEVERITY = ERROR
DESCRIPTION = ("Every current row at the target has the source's values (a digest per bucket of keys, computed "
               "in both databases); names the divergent keys (missing, extra, values differ) and the snapshot "
               "partitions holding them.")


class StreamBehind(RuntimeError):
    """The stream did not apply the source's read in time: nothing can be concluded about the rows."""


def find_divergent_rows(spec: TableSpec, target: Target, source_dsn: str, watch: StreamWatch,
                        settings: ChecksConfig = ChecksConfig(),
                        log: Callable[[str], None] = lambda _: None) -> ParityReport:
    """The keys whose rows differ at `target`, with their kinds and partitions (see the module's docstring).

    Raises StreamBehind when the stream does not apply the first read within the settle timeout.
    """
    blocks = spec.table.blocks_per_partition
    with source.connect(source_dsn, autocommit=True) as connection:
        table = compared_columns(source.table_schema(connection, spec.table), target)
    report = ParityReport()
    with source_digest.snapshot_read(source_dsn) as read:
        connection = read.connection
        report.source_rows = source_digest.count_rows(connection, table)
        lsn = source_digest.snapshot_lsn(connection)
        report.digits = bucket_digits(report.source_rows)
        source_digests = source_digest.bucket_digests(connection, table, report.digits)
        waited = wait_until_applied(watch, lsn, settings.settle_timeout_seconds)
        if not waited.caught_up:
            raise StreamBehind(waited.detail)
        target_digests = target.bucket_digests(table, report.digits)
        report.target_rows = sum(d.rows for d in target_digests.values())
        report.buckets = len(source_digests.keys() | target_digests.keys())
        buckets = mismatched_buckets(source_digests, target_digests)
        report.mismatched_buckets = len(buckets)
        log(f"{spec.qualified_name}: {len(buckets)} of {report.buckets} buckets differ at {target.name}")
        source_rows = source_digest.bucket_rows(connection, table, report.digits, buckets) if buckets else {}
    target_rows = target.bucket_rows(table, report.digits, buckets) if buckets else {}
    divergent, in_flight = classify(source_rows.keys() | target_rows.keys(), source_rows, target_rows,
                                    read.version_before, blocks)

    def reread(keys: list[tuple]) -> KeyRead | None:
        time.sleep(settings.settle_interval_seconds)
        with source_digest.snapshot_read(source_dsn) as again:
            rows = source_digest.key_rows(again.connection, table, keys)
            lsn = source_digest.snapshot_lsn(again.connection)
        if not wait_until_applied(watch, lsn, settings.settle_timeout_seconds).caught_up:
            return None
        return KeyRead(rows, target.key_rows(table, keys), again.version_before)

    settled = settle(divergent, in_flight, reread, settings.settle_attempts, blocks)
    report.divergent, report.in_flight, report.rounds = settled.divergent, settled.in_flight, settled.rounds
    return report


def compared_columns(table: TableSchema, target: Target) -> TableSchema:
    """The source's columns the target has: a column not there yet is schema parity's finding, and
    every row would differ by it."""
    stored = {c.name for c in target.describe_columns(table)}
    if not stored:
        raise TargetError(f"{table.schema}.{table.table} does not exist at {target.location} yet (snapshot its "
                          "partitions)")
    return TableSchema(table.schema, table.table, tuple(c for c in table.columns if c.name in stored))


def check(context: CheckContext) -> Outcome:
    try:
        report = find_divergent_rows(context.spec, context.target, context.source_dsn, context.watch,
                                     context.settings)
    except StreamBehind as error:
        return Outcome(False, str(error))
    limit = context.settings.row_parity_max_reported_keys
    kinds: dict[str, int] = {}
    for key in report.divergent:
        kinds[key.kind] = kinds.get(key.kind, 0) + 1
    metadata = {
        "source_rows": report.source_rows, "target_rows": report.target_rows, "bucket_digits": report.digits,
        "buckets": report.buckets, "mismatched_buckets": report.mismatched_buckets,
        "divergent_keys": len(report.divergent), "divergent_by_kind": kinds,
        "divergent": [{"key": list(k.key), "kind": k.kind, "partition": k.partition}
                      for k in report.divergent[:limit]],
        "partitions": report.partitions, "keys_still_in_flight": len(report.in_flight), "recheck_rounds": report.rounds,
    }
    if report.divergent:
        shown = ", ".join(f"{_key_text(k.key)} ({k.kind})" for k in report.divergent[:5])
        more = f" and {len(report.divergent) - 5} more" if len(report.divergent) > 5 else ""
        partitions = f"; partitions {', '.join(report.partitions)}" if report.partitions else ""
        return Outcome(False, f"{len(report.divergent)} divergent keys: {shown}{more}{partitions}", metadata)
    note = f"; {len(report.in_flight)} keys still changing" if report.in_flight else ""
    return Outcome(True, f"{report.source_rows} rows identical in {report.buckets} buckets{note}", metadata)


def _key_text(key: tuple[str | None, ...]) -> str:
    return key[0] if len(key) == 1 and key[0] is not None else "(" + ", ".join(str(v) for v in key) + ")"
