"""The fold: per primary key, only the latest change of a micro-batch survives, computed in Spark.

The version rule makes this safe: a target keeps the greatest version of each row, so earlier
changes of a key in the same batch would be overwritten anyway. A DELETE wins over earlier changes;
a later INSERT wins over the DELETE because its version is greater. Changes at or before the
batch's last TRUNCATE are dropped (the truncate tombstones their keys anyway).

Unchanged TOASTed values are carried forward inside the batch in the same aggregate: for column i
the value is the one of the latest row of the key that either knows it or starts a new lineage
(`_reset`). If that row knows it, the value is exact; otherwise it comes from before the batch
(`_unresolved`), from the stored row of the key or, when the lineage starts at a primary-key
update, from the old key (`_origin`, at `_reset_version`).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType

from siphon_core.wire import siphon_pb2 as pb
from siphon_dagster.streaming.decode import value_column

VERSION_TYPE = DecimalType(38, 0)


def with_version(decoded: DataFrame) -> DataFrame:
    """Adds `_version` as DECIMAL(38, 0), exact for any LSN and position."""
    # naming.row_version: (commit LSN << 32) | position.
    version = F.col("_lsn").cast(VERSION_TYPE) * F.lit(1 << 32).cast(VERSION_TYPE) + F.col("_pos")
    return decoded.withColumn("_version", version.cast(VERSION_TYPE))


def fold(decoded: DataFrame, column_count: int, truncated_at: int | None) -> DataFrame:
    """One row per key: `_key, _op, _version, _reset_version, _origin, _unresolved, c0..cN`.

    `truncated_at` is the version of the batch's last TRUNCATE, if any.
    """
    rows = with_version(decoded).where(F.col("_op") != pb.TRUNCATE)
    if truncated_at is not None:
        rows = rows.where(F.col("_version") > F.lit(truncated_at).cast(VERSION_TYPE))
    version, reset = F.col("_version"), F.col("_reset")
    reset_version = F.when(reset, version)
    aggregates = [
        F.max_by("_op", version).alias("_op"),
        F.max(version).alias("_version"),
        F.max(reset_version).alias("_reset_version"),
        F.max_by("_origin", reset_version).alias("_origin"),
    ]
    for i in range(column_count):
        known = _known(i)
        candidate = F.struct(known.alias("known"), F.col(value_column(i)).alias("value"))
        aggregates.append(F.max_by(candidate, F.when(known | reset, version)).alias(value_column(i)))
    folded = rows.groupBy("_key").agg(*aggregates)
    unresolved = F.array(*[
        F.when(F.coalesce(F.col(value_column(i))["known"], F.lit(False)), F.lit(None)).otherwise(F.lit(i))
        for i in range(column_count)
    ])
    return folded.select(
        "_key", "_op", "_version", "_reset_version", "_origin",
        F.filter(unresolved, lambda position: position.isNotNull()).alias("_unresolved"),
        *[F.col(value_column(i))["value"].alias(value_column(i)) for i in range(column_count)],
    )


def _known(position: int) -> Column:
    unchanged = F.col("_unchanged")
    return unchanged.isNull() | ~F.array_contains(unchanged, F.lit(position))
