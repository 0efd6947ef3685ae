"""What the streaming plan needs to know of a Spark session, apart from how sessions are made
(`spark_session`), so that the plan and the session factory do not import each other."""

from __future__ import annotations

from pyspark.sql import SparkSession


def is_remote(spark: SparkSession) -> bool:
    """A Spark Connect session (its DataFrames have no RDD side)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def decode_slices(spark: SparkSession) -> int:
    """Tasks a micro-batch's decode is spread over: the driver's default parallelism (cores in local
    mode), or on Spark Connect the server's `spark.sql.shuffle.partitions`, which its operator sets
    to the cores runs should share."""
    if is_remote(spark):
        return int(spark.conf.get("spark.sql.shuffle.partitions") or 2)
    return max(1, spark.sparkContext.defaultParallelism)
