"""Applies one micro-batch of whole packages to a target: schema, decode and fold in Spark, TOAST
fill, then TRUNCATE and the folded rows through the Target interface.

The applier never acks anything: the consumer acks the batch's messages after `apply` returns,
that is after the target committed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from siphon_core.wire import siphon_pb2 as pb
from siphon_dagster.streaming.batch import (
    ReceivedPackage,
    SchemaChangeError,
    check_keys,
    column_fingerprint,
    table_schema,
)
from siphon_dagster.streaming.decode import (
    INPUT_SCHEMA,
    DecodeSpec,
    PackageDecoder,
    decoded_ddl,
    value_column,
)
from siphon_dagster.streaming.fold import fold, with_version
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.streaming.spark_session import shuffle_partitions
from siphon_dagster.streaming.toast import ToastStats, fill_unchanged
from siphon_dagster.targets.base import TableSchema, Target, change_batch_schema


class IncompatibleSchemaError(SchemaChangeError):
    """A column's type changed in a way the target cannot follow: the table's stream stops."""


@dataclass
class AppliedBatch:
    schema: TableSchema
    rows: int  # rows handed to the target after the fold
    truncated_at: int | None
    toast: ToastStats
    seconds: dict[str, float] = field(default_factory=dict)  # schema, spark (decode+fold+collect), toast, apply


def decoded_frame(spark: SparkSession, packages: Sequence[ReceivedPackage], spec: DecodeSpec) -> DataFrame:
    """(seq, payload) rows spread over the executors, decoded there by `PackageDecoder`."""
    data = pa.Table.from_arrays([pa.array([p.sequence for p in packages], pa.int64()),
                                 pa.array([p.payload for p in packages], pa.binary())], schema=INPUT_SCHEMA)
    frame = spark.createDataFrame(data)
    partitions = min(len(packages), shuffle_partitions(spark))
    if partitions > 1:
        frame = frame.repartition(partitions)
    return frame.mapInArrow(PackageDecoder(spec), decoded_ddl(len(spec.columns)))


class BatchApplier:
    """Applies batches of one table to one target; remembers the column list it last applied."""

    def __init__(self, spark: SparkSession, target: Target, schema: str, table: str,
                 source: SourceRowReader | None = None) -> None:
        self.spark = spark
        self.target = target
        self.schema = schema
        self.table = table
        self.source = source
        self._applied_columns: tuple[object, ...] | None = None
        self._applied_key: tuple[str, ...] | None = None

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    def apply(self, packages: Sequence[ReceivedPackage]) -> AppliedBatch:
        seconds: dict[str, float] = {}
        started = time.perf_counter()
        table = self._ensure_schema(packages)
        seconds["schema"] = _lap(started)

        spec = DecodeSpec(table.column_names, tuple(c.name for c in table.key_columns))
        truncates = [p.truncated_at for p in packages if p.truncated_at is not None]
        truncated_at = max(truncates) if truncates else None
        decoded = decoded_frame(self.spark, packages, spec)
        started = time.perf_counter()
        folded = _as_text(fold(decoded, len(spec.columns), truncated_at).toArrow(), table)
        seconds["spark"] = _lap(started)

        started = time.perf_counter()
        folded, toast = fill_unchanged(folded, table, self.target, self.source,
                                       lambda keys: _history(decoded, keys))
        rows = change_rows(folded, table)
        seconds["toast"] = _lap(started)

        started = time.perf_counter()
        if truncated_at is not None:
            self.target.tombstone_all(table, truncated_at)
        if rows.num_rows:
            self.target.apply_rows(table, rows)
        seconds["apply"] = _lap(started)
        return AppliedBatch(table, rows.num_rows, truncated_at, toast, seconds)

    def _ensure_schema(self, packages: Sequence[ReceivedPackage]) -> TableSchema:
        """The batch's newest column list, created or added at the target when it is new."""
        key = check_keys(self.qualified_name, packages)
        if self._applied_key is not None and key != self._applied_key:
            raise SchemaChangeError(
                f"table {self.qualified_name}: the primary key changed from {list(self._applied_key)} to "
                f"{list(key)} at stream sequence {packages[0].sequence}; rebuild the table's targets with its "
                "resync job")
        columns = packages[-1].columns
        categories = self.source.type_categories([c.type_oid for c in columns]) if self.source else None
        table = table_schema(self.schema, self.table, columns, categories)
        fingerprint = column_fingerprint(columns)
        if fingerprint != self._applied_columns:
            change = self.target.ensure_table(table)
            if change.incompatible:
                described = ", ".join(f"{name} ({table.column(name).type_name})" for name in change.incompatible)
                raise IncompatibleSchemaError(
                    f"table {self.qualified_name}: the type of column(s) {described} changed at the source in a "
                    f"way target {self.target.name} cannot follow (stream sequence {packages[-1].sequence}); "
                    "the table's stream stops here: rebuild the table's targets with its resync job")
            self._applied_columns, self._applied_key = fingerprint, key
        return table


def change_rows(folded: pa.Table, table: TableSchema) -> pa.Table:
    """The folded rows laid out as `change_batch_schema(table)` for `Target.apply_rows`."""
    values = [folded.column(value_column(i)) for i in range(len(table.columns))]
    deleted = pc.equal(folded.column("_op"), pa.scalar(pb.DELETE, pa.int8()))
    return pa.Table.from_arrays([*values, folded.column("_version"), deleted], schema=change_batch_schema(table))


def _as_text(folded: pa.Table, table: TableSchema) -> pa.Table:
    """Value columns from bytes to strings; PostgreSQL text of a UTF-8 database is valid UTF-8."""
    for i, column in enumerate(table.columns):
        name = value_column(i)
        try:
            text = pc.cast(folded.column(name), pa.string())
        except pa.ArrowInvalid as error:
            raise ValueError(f"table {table.schema}.{table.table}, column {column.name}: a value is not valid "
                             f"UTF-8 ({error}); Siphon needs a UTF-8 source database") from None
        folded = folded.set_column(folded.schema.get_field_index(name), name, text)
    return folded


def _history(decoded: DataFrame, keys: list[bytes]) -> pa.Table:
    """Every decoded row of these keys (re-decodes the batch: only for key updates with TOAST)."""
    return with_version(decoded).where(F.col("_key").isin(keys)).drop("_lsn", "_pos").toArrow()


def _lap(started: float) -> float:
    return round(time.perf_counter() - started, 4)
