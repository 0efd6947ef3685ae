"""Loads block ranges of one table into one target: the snapshot asset's and the resync's loop.

Each range is read under its own temporary slot and applied whole or not at all (see
`Target.apply_copy_text`), so a range that loses its source or target connection is simply read
and loaded again: a few attempts with backoff over about two minutes, for connection failures
only. Anything else (SQL, configuration, a wait past its limit) fails at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import tenacity
from psycopg import sql

from siphon_core import naming
from siphon_core.config import TableConfig
from siphon_core.logs import get_logger
from siphon_core.replication import ReplicationError
from siphon_dagster import source
from siphon_dagster.partitions import BlockRange
from siphon_dagster.snapshot.blockers import SnapshotWaitLimitError, WaitReport
from siphon_dagster.snapshot.reader import SnapshotProgress, TableRewrittenError
from siphon_dagster.snapshot.spool import MAX_AHEAD_BYTES, spooled_range
from siphon_dagster.targets.base import TableSchema, Target

log = get_logger("snapshot")

RETRY_ATTEMPTS = 5
RETRY_SECONDS = 120.0
REREAD_ROUNDS = 3  # rounds of ranges read again after the table was rewritten while it loaded


@dataclass(frozen=True)
class SnapshotSettings:
    """Where and how ranges are read (source.* in siphon.yaml)."""

    dsn: str
    spool_directory: str | None = None
    spool_max_bytes: int = MAX_AHEAD_BYTES
    wait_limit_seconds: float = 0.0
    retry_seconds: float = 120.0  # how long a range retries a lost connection (RetryPolicy.seconds)
    # The producer's publication: a range of a table not in it is not read (check_published).
    publication: str | None = None


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = RETRY_ATTEMPTS
    seconds: float = RETRY_SECONDS
    first_wait_seconds: float = 2.0
    max_wait_seconds: float = 30.0


@dataclass
class LoadSummary:
    progress: SnapshotProgress = field(default_factory=SnapshotProgress)
    consistent_points: list[int] = field(default_factory=list)
    table: TableSchema | None = None  # the columns last loaded
    retries: int = 0

    @property
    def consistent_point_text(self) -> str:
        points = [naming.format_lsn(p) for p in self.consistent_points]
        if not points:
            return ""
        return points[0] if len(points) == 1 else f"{points[0]} .. {points[-1]}"


def _chain(error: BaseException) -> list[BaseException]:
    """The error, its causes and the errors it was raised while handling (a clean-up that failed
    after the connection was lost hides the loss in its context)."""
    seen: list[BaseException] = []
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if any(current is s for s in seen):
            continue
        seen.append(current)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return seen


def _sqlstate_is_connection(sqlstate: str | None) -> bool:
    # None: the client lost the connection; 08: connection exception; 57P: the server shut the
    # session down (admin shutdown, crash recovery, cannot connect now).
    return sqlstate is None or sqlstate.startswith(("08", "57P"))


def is_connection_failure(error: BaseException) -> bool:
    """True when `error` (or what caused it) is a lost or refused connection to the source or a target."""
    if isinstance(error, SnapshotWaitLimitError):
        return False
    for failure in _chain(error):
        if isinstance(failure, psycopg.OperationalError) and _sqlstate_is_connection(failure.sqlstate):
            return True
        if isinstance(failure, ReplicationError) and (
                failure.sqlstate is not None and _sqlstate_is_connection(failure.sqlstate)
                or "cannot open a replication connection" in str(failure)):
            return True
        if isinstance(failure, ConnectionError | TimeoutError):
            return True
        if _is_target_connection_error(failure):
            return True
    return False


def _is_target_connection_error(failure: BaseException) -> bool:
    kind = type(failure)
    # The drivers' own connection errors: HTTP for ClickHouse (clickhouse-connect raises its
    # OperationalError on a refused or dropped connection), the connector's for Snowflake.
    if kind.__module__.startswith("clickhouse_connect") and kind.__name__ == "OperationalError":
        return True
    if kind.__module__.startswith("snowflake.connector") and kind.__name__ == "OperationalError":
        return True
    return kind.__module__.startswith("urllib3") and kind.__name__ in (
        "NewConnectionError", "ProtocolError", "MaxRetryError", "ConnectTimeoutError")


def load_ranges(settings: SnapshotSettings, table: TableConfig, ranges: Sequence[BlockRange], destination: Target,
                *, shadow: bool = False, ensure: Callable[[TableSchema, dict[str, source.ExistingRowsValue]], None],
                on_progress: Callable[[SnapshotProgress], None] | None = None,
                on_info: Callable[[str], None] = log.info, on_warning: Callable[[str], None] = log.warning,
                on_blocked: Callable[[WaitReport], None] | None = None,
                retry: RetryPolicy | None = None, parallel: int = 1,
                open_destination: Callable[[], Target] | None = None) -> LoadSummary:
    """Loads `ranges` of `table` into `destination` (its resync shadow when `shadow`), `parallel`
    ranges at a time: each further worker writes through a target of its own from
    `open_destination` (a target connection carries one statement at a time), and closes it.

    `ensure(columns, existing)` runs, with the table locked, whenever the columns read differ from
    those of the range before: it makes the target table follow them (see `ensure_target_table`).
    A failed range stops the workers from starting more; the ranges already loaded stay loaded.
    """
    retry = retry or RetryPolicy(attempts=RETRY_ATTEMPTS if settings.retry_seconds > 0 else 1,
                                 seconds=settings.retry_seconds)
    summary = LoadSummary()
    ensured: list[TableSchema | None] = [None]
    ensuring = threading.Lock()  # one worker at a time compares the columns and changes the target
    counting = threading.Lock()
    loading: list[SnapshotProgress] = []  # the ranges being read now
    # Each range's consistent point and the table's storage it was read from (reader.table_layout).
    layouts: dict[BlockRange, tuple[int, tuple[tuple[int, int], ...]]] = {}

    def report(_: SnapshotProgress) -> None:
        if on_progress is None:
            return
        with counting:
            rows = summary.progress.rows + sum(p.rows for p in loading)
            size = summary.progress.bytes + sum(p.bytes for p in loading)
        on_progress(SnapshotProgress(rows, size, summary.progress.started))

    def load_one(block_range: BlockRange, target: Target) -> None:
        progress = SnapshotProgress()
        with counting:
            loading.append(progress)
        try:
            with source.connect(settings.dsn, autocommit=True) as catalog:
                if settings.publication:
                    check_published(catalog, settings.publication, table)

                def locked_columns() -> TableSchema:
                    # The table is locked against DDL from here on: the columns read now, from the
                    # current catalog, are the ones the COPY reads.
                    with ensuring:
                        columns, existing = current_columns(catalog, table)
                        if columns != ensured[0]:
                            ensure(columns, existing)
                            ensured[0] = columns
                        return columns

                with spooled_range(settings.dsn, table.schema_name, table.table_name, block_range, locked_columns,
                                   progress, on_wait=on_warning, directory=settings.spool_directory,
                                   max_ahead_bytes=settings.spool_max_bytes,
                                   wait_limit_seconds=settings.wait_limit_seconds, on_blocked=on_blocked) as reading:
                    point = naming.format_lsn(reading.consistent_point)
                    on_info(f"reading blocks {block_range.first_block}..{block_range.last_block} of {table.name} "
                            f"as of {point}" + (" into the resync table" if shadow else ""))
                    target.apply_copy_text(reading.table, reading.chunks(on_progress=report),
                                           naming.row_version(reading.consistent_point, 0), shadow=shadow)
            # Only a range applied whole counts: a failed attempt's rows were not applied.
            with counting:
                summary.progress.rows += progress.rows
                summary.progress.bytes += progress.bytes
                summary.consistent_points.append(reading.consistent_point)
                layouts[block_range] = (reading.consistent_point, reading.layout)
        finally:
            with counting:
                loading.remove(progress)

    def load_with_retries(block_range: BlockRange, target: Target) -> None:
        def before_retry(state: tenacity.RetryCallState) -> None:
            with counting:
                summary.retries += 1
            error = state.outcome.exception() if state.outcome else None
            what = "its table was rewritten" if isinstance(error, TableRewrittenError) else "a range lost its connection"
            on_warning(f"{table.name}: {what} ({error}); nothing of it was applied, reading it "
                       f"again in {state.upcoming_sleep:.0f}s (attempt {state.attempt_number + 1} of {retry.attempts})")
            target.close()  # the next attempt opens a fresh connection

        tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda error: is_connection_failure(error)
                                              or isinstance(error, TableRewrittenError)),
            stop=tenacity.stop_after_attempt(retry.attempts) | tenacity.stop_after_delay(retry.seconds),
            wait=tenacity.wait_exponential(multiplier=retry.first_wait_seconds, min=retry.first_wait_seconds,
                                           max=retry.max_wait_seconds),
            before_sleep=before_retry,
            reraise=True,
        )(load_one, block_range, target)

    workers = max(1, min(parallel, len(ranges))) if open_destination is not None else 1
    if workers == 1:
        for block_range in ranges:
            load_with_retries(block_range, destination)
    else:
        _in_parallel(ranges, workers, destination, open_destination, load_with_retries)
    # A rewrite between two ranges (VACUUM FULL, CLUSTER) moves rows to other blocks, and the stream
    # carries no change for them: a row moved from a range read after it into one read before it
    # was in neither read. The ranges read from an earlier storage are read again.
    for round_number in range(REREAD_ROUNDS + 1):
        latest = max(layouts.values())[1] if layouts else ()
        stale = [block_range for block_range in ranges if layouts[block_range][1] != latest]
        if not stale:
            break
        if round_number == REREAD_ROUNDS:
            raise TableRewrittenError(f"{table.name} was rewritten again each time its ranges were read again "
                                      f"({REREAD_ROUNDS} rounds); load its partitions once the rewrites have ended")
        on_warning(f"{table.name} was rewritten while it loaded (VACUUM FULL, CLUSTER or a rewriting ALTER TABLE): "
                   f"its rows may have moved between ranges; reading {len(stale)} range(s) read before it again")
        for block_range in stale:
            load_with_retries(block_range, destination)
    summary.consistent_points.sort()
    summary.table = ensured[0]
    return summary


class TableNotPublishedError(RuntimeError):
    """The producer's publication exists and does not hold the table yet."""


def check_published(connection: psycopg.Connection[Any], publication: str, table: TableConfig) -> None:
    """Raises TableNotPublishedError when `publication` exists and holds neither the table nor one
    of its partitions. A range's rows are those as of its slot's consistent point, and the stream
    carries the table's changes only from the commit that added it to the publication: a range read
    before that would leave the changes in between nowhere. No publication at all (no producer has
    run yet) is not checked."""
    exists, found, published = connection.execute(
        sql.SQL("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = {publication}), "
                "to_regclass({table}) IS NOT NULL, "
                "EXISTS (SELECT 1 FROM pg_publication_tables t WHERE t.pubname = {publication} "
                "AND format('%I.%I', t.schemaname, t.tablename)::regclass "
                "IN (SELECT to_regclass({table}) UNION ALL SELECT relid FROM pg_partition_tree(to_regclass({table}))))").format(
            publication=sql.Literal(publication),
            table=sql.Literal(sql.Identifier(table.schema_name, table.table_name).as_string(connection)))).fetchone()
    # A table that does not exist is reported by the range's read of its columns, in its own words.
    if exists and found and not published:
        raise TableNotPublishedError(
            f"{table.name} is not in the publication {publication} yet, so no range of it was read: its changes "
            "stream from the commit that adds it, and rows read before that would miss the changes in between. "
            "The producer adds a table when it reads siphon.yaml (every producer.config_check_seconds, or on "
            "SIGHUP); its log says why it has not (a table without a primary key or replica identity, a missing "
            "privilege). Load the table again once the producer has added it")


def _in_parallel(ranges: Sequence[BlockRange], workers: int, destination: Target,
                 open_destination: Callable[[], Target], load: Callable[[BlockRange, Target], None]) -> None:
    """`load` over `ranges` by `workers` threads, the first writing through `destination`, the
    others through targets they open and close; the first failure is raised once all have stopped."""
    pending = list(reversed(ranges))
    taking = threading.Lock()
    failures: list[BaseException] = []

    def work(target: Target) -> None:
        while True:
            with taking:
                if failures or not pending:
                    return
                block_range = pending.pop()
            try:
                load(block_range, target)
            except BaseException as error:
                with taking:
                    failures.append(error)
                return

    def extra_worker() -> None:
        try:
            target = open_destination()
        except BaseException as error:
            with taking:
                failures.append(error)
            return
        try:
            work(target)
        finally:
            target.close()

    threads = [threading.Thread(target=extra_worker, name=f"snapshot-range-{i}", daemon=True)
               for i in range(1, workers)]
    for thread in threads:
        thread.start()
    work(destination)
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def current_columns(catalog: Any, table: TableConfig) -> tuple[TableSchema, dict[str, source.ExistingRowsValue]]:
    """The table's columns in the current catalog (an autocommit connection: each query sees the
    catalog as it is now), and what rows older than each column hold in it."""
    columns = source.table_schema(catalog, table)
    # A snapshot may be the first to meet a column added at the source: rows outside its ranges
    # must get the value PostgreSQL gave them, as the stream's schema step does.
    existing = source.existing_rows_values(catalog, columns.schema, columns.table,
                                           [c for c in columns.columns if not c.primary_key])
    return columns, existing


def ensure_target_table(destination: Target, target: str, on_warning: Callable[[str], None] = log.warning
                        ) -> Callable[[TableSchema, dict[str, source.ExistingRowsValue]], None]:
    """The usual `ensure` of `load_ranges`: creates the target table or adds the source's new
    columns (to the live table and a resync table alike), warning about columns it cannot fill."""

    def ensure(columns: TableSchema, existing: dict[str, source.ExistingRowsValue]) -> None:
        change = destination.ensure_table(columns, source.backfill(existing))
        for name in change.added_columns:
            if not existing[name].known:
                on_warning(existing[name].unfilled_warning(columns.schema, columns.table, target))

    return ensure

