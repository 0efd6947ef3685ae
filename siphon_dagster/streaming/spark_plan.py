"""The Spark work of a micro-batch: decode on the executors, shuffle by key, fold, collect.

    packages (seq, payload)            one row per package, spread over the executors
      -> decode stage (mapInArrow)     decode, fold each task's changes, split the survivors' values
                                       into columns, cut them into key buckets
      -> shuffle by bucket             every change of a key meets in one task
      -> fold stage (mapInArrow)       fold each bucket
      -> collect (toArrow)             the folded rows on the driver

Rows between the stages are Arrow IPC streams of many changes (`_blob`), not one Spark row per
change: Spark's per-row work (conversion from Arrow, shuffle records, sort) cost it about 20 us a
change, several times the decoding itself, and here it is spent per bucket instead. The shuffle is
still Spark's, hash-partitioned on the bucket, so the stages scale out over executors as any other
job.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import encode_package
from siphon_core.wire.tuple_data import encode_tuple
from siphon_dagster.streaming.batch import ReceivedPackage, describe
from siphon_dagster.streaming.decode import (
    INPUT_SCHEMA,
    DecodeSpec,
    PackageDecoder,
    folded_schema,
    locate_changes,
)
from siphon_dagster.streaming.fold import fold_changes, latest_indices, with_version
from siphon_dagster.streaming.spark_session import is_remote, shuffle_partitions

BUCKETED_DDL = "_bucket int, _blob binary"
BLOB_DDL = "_blob binary"
# Decoded changes a decode task folds and hands on at once; the fold stage still meets every
# change of a key, whatever the number of pieces.
DECODED_BYTES_PER_FLUSH = 128 << 20
# Values compress several times over; Spark then copies, shuffles and hands back far fewer bytes.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")
_bucket_ids: dict[int, list[int]] = {}
_bucket_ids_lock = threading.Lock()


def folded_rows(spark: SparkSession, packages: Sequence[ReceivedPackage], spec: DecodeSpec,
                truncated_at: int | None) -> pa.Table:
    """One row per key of the batch, its latest change, laid out as `decode.folded_schema`: `_key,
    _op, _lsn, _pos, _seq, _reset, _origin, _unchanged, c0..cN` (values as binary), `_version`."""
    buckets = bucket_ids(spark)
    decoded = _package_frame(spark, packages).mapInArrow(DecodeStage(spec, buckets, truncated_at), BUCKETED_DDL)
    folded = decoded.repartition(len(buckets), "_bucket").mapInArrow(FoldStage(), BLOB_DDL)
    return _collect(folded, folded_schema(len(spec.columns)))


def warm_up(spark: SparkSession) -> None:
    """Runs both stages once on a one-row package, so the first micro-batch of a run does not pay
    for starting Python workers and compiling the JVM's paths (seconds on 2 cores)."""
    warm = pb.Package(application_identifier="siphon", schema="siphon", table="warm_up",
                      value_encoding=pb.PGOUTPUT_TUPLE)
    warm.columns.append(pb.Column(name="id", type_oid=20, type_name="bigint", primary_key=True, type_modifier=-1))
    event = warm.events.add(operation=pb.INSERT, commit_lsn=1, position=1)
    event.new_row.tuple = encode_tuple([b"1"])
    packages = [describe(warm, (sequence,), encode_package(warm)) for sequence in range(1, 1 + shuffle_partitions(spark))]
    folded_rows(spark, packages, DecodeSpec(("id",), ("id",), "siphon.warm_up"), None)


def key_history(spark: SparkSession, packages: Sequence[ReceivedPackage], spec: DecodeSpec, keys: Sequence[bytes],
                positions: Sequence[int]) -> pa.Table:
    """Every change of these keys in the batch, unfolded, with `_version`, `_unchanged` and the value
    columns at `positions`; decodes the batch again, which only unchanged TOASTed values cost."""
    stage = DecodeStage(spec, [0], None, keys=frozenset(keys), positions=tuple(positions))
    return _collect(_package_frame(spark, packages).mapInArrow(stage, BUCKETED_DDL),
                    folded_schema(len(spec.columns), positions))


def bucket_ids(spark: SparkSession) -> list[int]:
    """One bucket id per shuffle partition, each hashing to a different partition.

    `repartition(n, "_bucket")` places a bucket by Spark's Murmur3 hash of its id modulo n; ids
    0..n-1 may collide and leave a core idle, so the ids are chosen by asking Spark for the hashes.
    """
    partitions = shuffle_partitions(spark)
    with _bucket_ids_lock:
        if partitions not in _bucket_ids:
            hashed = (spark.range(64 * partitions).select(F.col("id").cast("int").alias("id"))
                      .select("id", F.pmod(F.hash("id"), F.lit(partitions)).alias("partition")).toArrow())
            chosen: dict[int, int] = {}
            for bucket, partition in zip(hashed["id"].to_pylist(), hashed["partition"].to_pylist(), strict=True):
                chosen.setdefault(partition, bucket)
            _bucket_ids[partitions] = [chosen[p] for p in sorted(chosen)]
        return _bucket_ids[partitions]


class DecodeStage:
    """Executors: packages in, bucketed IPC blobs of folded changes out (picklable)."""

    def __init__(self, spec: DecodeSpec, buckets: Sequence[int], truncated_at: int | None,
                 keys: frozenset[bytes] | None = None, positions: tuple[int, ...] | None = None) -> None:
        self.spec = spec
        self.buckets = list(buckets)
        self.truncated_at = truncated_at
        self.keys = keys  # history: only these keys, nothing folded, values at `positions`
        self.positions = positions

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        decoder = PackageDecoder(self.spec)
        parts: list[pa.RecordBatch] = []
        held = 0
        for batch in batches:
            for seq, payload in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True):
                for part in decoder.decode(seq, payload):
                    parts.append(part)
                    held += part.nbytes
                if held >= DECODED_BYTES_PER_FLUSH:  # a worker holds a bounded part of the batch
                    yield from self._flush(parts)
                    parts, held = [], 0
        if parts:
            yield from self._flush(parts)

    def _flush(self, parts: list[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        decoded = locate_changes(parts, self.spec)
        if self.keys is not None:
            wanted = pc.is_in(decoded.changes.column("_key"), value_set=pa.array(sorted(self.keys), pa.binary()))
            rows = np.flatnonzero(wanted.to_numpy(zero_copy_only=False))
            yield _bucketed(self.buckets[0], with_version(decoded.take(rows, self.positions)))
            return
        latest = np.sort(latest_indices(decoded.changes, self.truncated_at))  # rows read in buffer order
        if len(self.buckets) == 1:
            yield _bucketed(self.buckets[0], decoded.take(latest))
            return
        # crc32 is the same in every worker process, unlike Python's salted hash().
        keys = decoded.changes.column("_key").take(pa.array(latest)).to_pylist()
        slots = np.fromiter((zlib.crc32(key) for key in keys), np.uint32, len(keys)) % len(self.buckets)
        # Rows ordered by bucket: the values are copied once, and each bucket is a slice.
        order = np.argsort(slots, kind="stable")
        changes = decoded.take(latest[order])
        ends = np.searchsorted(slots[order], np.arange(1, len(self.buckets) + 1))
        begin = 0
        for bucket, end in zip(self.buckets, ends.tolist(), strict=True):
            if end > begin:
                yield _bucketed(bucket, changes.slice(begin, end - begin))
            begin = end


class FoldStage:
    """Executors: the blobs of one bucket in, its folded rows out (picklable)."""

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        tables = [_read_blob(blob) for batch in batches for blob in _blobs(batch)]
        if not tables:
            return
        # One piece was folded whole by its decode task; several may share keys.
        folded = tables[0] if len(tables) == 1 else fold_changes(pa.concat_tables(tables))
        yield pa.RecordBatch.from_arrays([_one_binary(_write_blob(with_version(folded)))], names=["_blob"])


def _package_frame(spark: SparkSession, packages: Sequence[ReceivedPackage]) -> DataFrame:
    """(seq, payload) rows spread over the executors."""
    data = pa.Table.from_arrays([pa.array([p.sequence for p in packages], pa.int64()),
                                 pa.array([p.payload for p in packages], pa.binary())], schema=INPUT_SCHEMA)
    frame = spark.createDataFrame(data)
    if not is_remote(spark):
        return frame  # a local relation is already cut into one slice per core
    partitions = min(len(packages), shuffle_partitions(spark))
    return frame.repartition(partitions) if partitions > 1 else frame


def _collect(frame: DataFrame, schema: pa.Schema) -> pa.Table:
    collected = frame.toArrow()
    tables = [_read_blob(blob) for batch in collected.to_batches() for blob in _blobs(batch)]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _bucketed(bucket: int, rows: pa.Table) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([bucket], pa.int32()), _one_binary(_write_blob(rows))],
                                      names=["_bucket", "_blob"])


def _one_binary(buffer: pa.Buffer) -> pa.Array:
    """A one-value binary array over `buffer`, without copying it."""
    offsets = pa.array([0, buffer.size], pa.int64() if buffer.size > 2**31 - 1 else pa.int32())
    binary = pa.large_binary() if buffer.size > 2**31 - 1 else pa.binary()
    return pa.Array.from_buffers(binary, 1, [None, offsets.buffers()[1], buffer])


def _blobs(batch: pa.RecordBatch) -> Iterable[pa.Buffer]:
    column = batch.column(batch.schema.get_field_index("_blob"))
    return (column[i].as_buffer() for i in range(len(column)))


def _write_blob(rows: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema, options=_IPC_OPTIONS) as writer:
        writer.write_table(rows)
    return sink.getvalue()


def _read_blob(blob: pa.Buffer) -> pa.Table:
    return pa.ipc.open_stream(blob).read_all()
