"""Applies one micro-batch of whole packages to a target: schema, decode and fold in Spark, TOAST
fill, then TRUNCATE and the folded rows through the Target interface.

The applier never acks anything: the consumer acks the batch's messages after `apply` returns,
that is after the target committed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from siphon_core.wire import siphon_pb2 as pb
from siphon_dagster.streaming import spark_session
from siphon_dagster.streaming.batch import ReceivedPackage
from siphon_dagster.streaming.decode import DecodeSpec, LocatedChanges, value_column
from siphon_dagster.streaming.schema import SchemaTracker
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.streaming.spark_plan import (
    folded_pieces,
    folded_pieces_in_driver,
    key_history,
    key_history_in_driver,
    merge_folded,
)
from siphon_dagster.streaming.toast import ToastStats, fill_unchanged
from siphon_dagster.targets.base import TableSchema, Target, change_batch_schema


@dataclass
class AppliedBatch:
    schema: TableSchema
    rows: int  # rows handed to the target after the fold
    truncated_at: int | None
    toast: ToastStats
    seconds: dict[str, float] = field(default_factory=dict)  # schema, spark (decode+fold+collect), merge, toast, apply
    prepared_early: bool = False
    load_path: str | None = None  # how the target loaded the rows, when it says (Snowflake: stage or insert)
    in_driver: bool = False  # decoded and folded in this process, not by Spark tasks


@dataclass
class PreparedBatch:
    """A batch decoded and folded, not yet written: what `BatchApplier.prepare` returns."""

    packages: Sequence[ReceivedPackage]
    table: TableSchema
    spec: DecodeSpec
    pieces: list[pa.Table]  # the Spark tasks' folded rows, merged by the write step
    truncated_at: int | None
    seconds: dict[str, float]
    early: bool = False  # prepared while the batch before was written
    in_driver: bool = False  # decoded and folded in this process (a small batch), not by Spark tasks
    # The driver's decoded changes before the fold, when it kept them: the TOAST fill's history.
    located: list[LocatedChanges] | None = None


class BatchApplier:
    """Applies batches of one table to one target.

    `apply` = `prepare` (schema, decode and fold in Spark) then the write (TOAST fill, TRUNCATE,
    rows). A consumer may prepare the next batch while this one is written (`prepare_early`), when
    the next batch needs no schema change: preparing reads nothing from the target then, and the
    TOAST fill, which reads the target's rows, still runs after the earlier write.
    """

    def __init__(self, spark: SparkSession | Callable[[], SparkSession], target: Target, schema: str, table: str,
                 source: SourceRowReader | None = None, driver_decode_max_bytes: int = 0) -> None:
        # A callable starts the session on first need: a group run whose batches are all small
        # never starts a JVM.
        self._spark = spark
        # Batches of at most this many payload bytes skip Spark: same decode, no job to schedule.
        self.driver_decode_max_bytes = driver_decode_max_bytes
        self.target = target
        self.source = source
        self.schemas = SchemaTracker(target, schema, table, source)
        self._preparing = threading.Lock()

    @contextmanager
    def _session(self) -> Iterator[SparkSession]:
        """The Spark session for one step; a session the applier is given as a callable may be
        stopped while idle (`spark_session.stop_if_idle`) and is asked for again each time."""
        if isinstance(self._spark, SparkSession) or not callable(self._spark):
            yield self._spark
            return
        with spark_session.in_use(self._spark) as session:
            yield session

    @property
    def qualified_name(self) -> str:
        return self.schemas.qualified_name

    def prepare_early(self, packages: Sequence[ReceivedPackage]) -> PreparedBatch | None:
        """`prepare`, called once the batch before is prepared but may still be being written; None
        (nothing done) when the batch's schema is not the current one, since resolving it may
        change the target."""
        with self._preparing:
            if not self.schemas.is_current(packages):
                return None
            prepared = self._prepare(packages)
            prepared.early = True
            return prepared

    def ensure_schema(self, packages: Sequence[ReceivedPackage]) -> None:
        """Resolves the batch's column list at the target ahead of `prepare` (statements at the
        target: a caller keeps them off the threads that decode)."""
        with self._preparing:
            self.schemas.resolve(packages)

    def prepare(self, packages: Sequence[ReceivedPackage]) -> PreparedBatch:
        with self._preparing:  # one batch at a time: the schema is resolved in stream order
            return self._prepare(packages)

    def _prepare(self, packages: Sequence[ReceivedPackage]) -> PreparedBatch:
        seconds: dict[str, float] = {}
        started = time.perf_counter()
        table = self.schemas.resolve(packages)
        seconds["schema"] = _lap(started)

        spec = DecodeSpec(table.column_names, tuple(c.name for c in table.key_columns),
                          f"{table.schema}.{table.table}")
        truncates = [p.truncated_at for p in packages if p.truncated_at is not None]
        truncated_at = max(truncates) if truncates else None
        started = time.perf_counter()
        in_driver = self.decodes_in_driver(packages)
        located = None
        if in_driver:
            pieces, located = folded_pieces_in_driver(packages, spec, truncated_at)
            seconds["decode"] = _lap(started)
        else:
            with self._session() as spark:
                pieces = folded_pieces(spark, packages, spec, truncated_at)
            seconds["spark"] = _lap(started)
        return PreparedBatch(packages, table, spec, pieces, truncated_at, seconds, in_driver=in_driver,
                             located=located)

    def decodes_in_driver(self, packages: Sequence[ReceivedPackage]) -> bool:
        return sum(len(p.payload) for p in packages) <= self.driver_decode_max_bytes

    def apply(self, packages: Sequence[ReceivedPackage], prepared: PreparedBatch | None = None) -> AppliedBatch:
        """Applies `packages`; `prepared` is their `prepare` result when it was done beforehand."""
        if prepared is None or prepared.packages is not packages:
            prepared = self.prepare(packages)
        table, spec, seconds = prepared.table, prepared.spec, dict(prepared.seconds)
        started = time.perf_counter()
        # The merge runs here, not in `prepare`: it overlaps the next batch's Spark work.
        folded = _as_text(merge_folded(prepared.pieces, len(table.columns),
                                       superseded_allowed=self.target.superseded_rows_allowed), table)
        seconds["merge"] = _lap(started)
        started = time.perf_counter()

        def history(keys: Sequence[bytes], positions: Sequence[int]) -> pa.Table:
            if prepared.in_driver:
                return key_history_in_driver(packages, spec, keys, positions, prepared.located)
            with self._session() as spark:
                return key_history(spark, packages, spec, keys, positions)

        folded, toast = fill_unchanged(folded, table, self.target, self.source, history)
        rows = change_rows(folded, table)
        seconds["toast"] = _lap(started)

        started = time.perf_counter()
        if prepared.truncated_at is not None:
            self.target.tombstone_all(table, prepared.truncated_at)
        load_path = None
        if rows.num_rows:
            self.target.apply_rows(table, rows)
            load_path = getattr(self.target, "last_load_path", None)
        seconds["apply"] = _lap(started)
        return AppliedBatch(table, rows.num_rows, prepared.truncated_at, toast, seconds, prepared.early,
                            load_path=load_path, in_driver=prepared.in_driver)


def change_rows(folded: pa.Table, table: TableSchema) -> pa.Table:
    """The folded rows laid out as `change_batch_schema(table)` for `Target.apply_rows`."""
    values = [folded.column(value_column(i)) for i in range(len(table.columns))]
    deleted = pc.equal(folded.column("_op"), pa.scalar(pb.DELETE, pa.int8()))
    return pa.Table.from_arrays([*values, folded.column("_version"), deleted], schema=change_batch_schema(table))


def _as_text(folded: pa.Table, table: TableSchema) -> pa.Table:
    """Value columns from bytes to strings; PostgreSQL text of a UTF-8 database is valid UTF-8.

    Each column is viewed as strings in place and its UTF-8 checked, and the table is built once:
    a cast and a new table per column cost a wide table's batch three times as much."""
    columns, fields = folded.columns, list(folded.schema)
    for i, column in enumerate(table.columns):
        at = folded.schema.get_field_index(value_column(i))
        text_type = pa.large_string() if pa.types.is_large_binary(columns[at].type) else pa.string()
        text = pa.chunked_array([chunk.view(text_type) for chunk in columns[at].chunks], text_type)
        try:
            text.validate(full=True)
        except pa.ArrowInvalid as error:
            raise ValueError(f"table {table.schema}.{table.table}, column {column.name}: a value is not valid "
                             f"UTF-8 ({error}); Siphon needs a UTF-8 source database") from None
        columns[at], fields[at] = text, fields[at].with_type(text_type)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _lap(started: float) -> float:
    return round(time.perf_counter() - started, 4)
