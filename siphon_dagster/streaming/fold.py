"""The fold: per primary key, only the latest change of a micro-batch survives, computed in Spark.

The version rule makes this safe: a target keeps the greatest version of each row, so earlier
changes of a key in the same batch would be overwritten anyway. A DELETE wins over earlier changes;
a later INSERT wins over the DELETE because its version is greater. Changes at or before the
batch's last TRUNCATE are dropped (the truncate tombstones their keys anyway).

The latest row keeps its `_unchanged` positions: unchanged TOASTed values are filled afterwards
from the batch's history of the key, the target or the source (siphon_dagster.streaming.toast).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_dagster.streaming.decode import value_column

VERSION_TYPE = DecimalType(38, 0)
_CARRIED = ("_op", "_reset", "_origin", "_unchanged")


def with_version(rows: DataFrame) -> DataFrame:
    """Adds `_version` = naming.row_version(_lsn, _pos) as DECIMAL(38, 0), exact for any LSN."""
    version = F.col("_lsn").cast(VERSION_TYPE) * F.lit(1 << 32).cast(VERSION_TYPE) + F.col("_pos")
    return rows.withColumn("_version", version.cast(VERSION_TYPE))


def fold(decoded: DataFrame, column_count: int, truncated_at: int | None) -> DataFrame:
    """One row per key, its latest change: `_key, _version, _op, _reset, _origin, _unchanged, c0..cN`.

    `truncated_at` is the version of the batch's last TRUNCATE, if any.
    """
    rows = decoded.where(F.col("_op") != pb.TRUNCATE)
    if truncated_at is not None:
        rows = rows.where(_after(truncated_at))
    values = [value_column(i) for i in range(column_count)]
    # A window sort on (LSN, position), two longs, beats an aggregate over the whole row; the
    # 38-digit decimal version is computed for the survivors only.
    newest_first = Window.partitionBy("_key").orderBy(F.col("_lsn").desc(), F.col("_pos").desc())
    latest = rows.withColumn("_rank", F.row_number().over(newest_first)).where(F.col("_rank") == 1)
    return with_version(latest).select("_key", "_version", *_CARRIED, *values)


def _after(version: int) -> Column:
    lsn, position = naming.split_version(version)
    return (F.col("_lsn") > lsn) | ((F.col("_lsn") == lsn) & (F.col("_pos") > position))
