"""The Spark work of a micro-batch: decode and fold on the executors, merge on the driver.

    packages (seq, payload)            one row per package, spread over the executors
      -> decode stage (mapInArrow)     decode, fold the task's changes per key, split the
                                       survivors' values into columns
      -> collect (toArrow)             every task's folded rows on the driver (`folded_pieces`)
      -> merge (driver)                the latest of each key's folded rows (`merge_folded`), done
                                       by the write step, while Spark works on the next batch

Each task hands back one row per key it saw, so the driver receives at most (tasks x keys) rows
and keeps each key's newest: folding parts first is exact (siphon_dagster.streaming.fold.merge_pieces). The
driver holds the batch's folded rows anyway, to complete and write them; a shuffle to fold them
on executors instead cost more than the merge (a second stage, shuffle files and Arrow
conversions in the JVM: about a third of a second per batch on 2 cores, against tens of
milliseconds for the merge).

Rows leaving the executors are Arrow IPC streams of many changes (`_blob`), not one Spark row per
change: Spark's per-row work (conversion from Arrow, a row per change) cost it about 20 us a change,
several times the decoding itself.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession

from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.compiled import compile_all
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
from siphon_dagster.streaming.fold import latest_indices, merge_pieces, with_version
from siphon_dagster.streaming.spark_session import decode_slices, is_remote

BLOB_DDL = "_blob binary"
# Decoded changes a decode task folds and hands on at once; the merge still meets every change of
# a key, whatever the number of pieces.
DECODED_BYTES_PER_FLUSH = 128 << 20
# Values compress several times over; Spark then copies and hands back far fewer bytes.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")
WARM_UP_ROUNDS = 4
WARM_UP_ROWS = 20_000


def folded_pieces(spark: SparkSession, packages: Sequence[ReceivedPackage], spec: DecodeSpec,
                  truncated_at: int | None) -> list[pa.Table]:
    """The tasks' folded rows: each piece holds a key at most once; `merge_folded` makes one row
    per key of the batch out of them."""
    return _collect(_package_frame(spark, packages).mapInArrow(DecodeStage(spec, truncated_at), BLOB_DDL))


def merge_folded(pieces: Sequence[pa.Table], column_count: int) -> pa.Table:
    """The latest row of each key among folded pieces, laid out as `decode.folded_schema`: `_key,
    _op, _lsn, _pos, _seq, _reset, _origin, _unchanged, c0..cN` (values as binary), `_version`."""
    if not any(piece.num_rows for piece in pieces):
        return folded_schema(column_count).empty_table()
    return with_version(merge_pieces(pieces))


def warm_up(spark: SparkSession, rounds: int = WARM_UP_ROUNDS) -> None:
    """Runs the decode stage a few times on small packages in every slice, so the first
    micro-batches of a run do not pay for starting Python workers and compiling the JVM's paths
    (seconds on 2 cores). The driver's own compiled loops are loaded here too."""
    compile_all()
    warm = pb.Package(application_identifier="siphon", schema="siphon", table="warm_up",
                      value_encoding=pb.PGOUTPUT_TUPLE)
    for name in ("id", "body"):
        warm.columns.append(pb.Column(name=name, type_oid=20 if name == "id" else 25, primary_key=name == "id",
                                      type_modifier=-1))
    for key in range(WARM_UP_ROWS):
        event = warm.events.add(operation=pb.INSERT, commit_lsn=1, position=key + 1)
        event.new_row.tuple = encode_tuple([str(key % (WARM_UP_ROWS // 2)).encode(), b"warm up"])
    payload = encode_package(warm)
    packages = [describe(warm, (sequence,), payload) for sequence in range(1, 1 + 2 * decode_slices(spark))]
    for _ in range(rounds):
        merge_folded(folded_pieces(spark, packages, DecodeSpec(("id", "body"), ("id",), "siphon.warm_up"), None), 2)


def key_history(spark: SparkSession, packages: Sequence[ReceivedPackage], spec: DecodeSpec, keys: Sequence[bytes],
                positions: Sequence[int]) -> pa.Table:
    """Every change of these keys in the batch, unfolded, with `_version`, `_unchanged` and the value
    columns at `positions`; decodes the batch again, which only unchanged TOASTed values cost."""
    stage = DecodeStage(spec, None, keys=frozenset(keys), positions=tuple(positions))
    pieces = _collect(_package_frame(spark, packages).mapInArrow(stage, BLOB_DDL))
    return pa.concat_tables(pieces) if pieces else folded_schema(len(spec.columns), positions).empty_table()


class DecodeStage:
    """Executors: packages in, IPC blobs of the task's folded changes out (picklable)."""

    def __init__(self, spec: DecodeSpec, truncated_at: int | None, keys: frozenset[bytes] | None = None,
                 positions: tuple[int, ...] | None = None) -> None:
        self.spec = spec
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
                    yield self._flush(parts)
                    parts, held = [], 0
        if parts:
            yield self._flush(parts)
        _freeze_worker_heap()

    def _flush(self, parts: list[pa.RecordBatch]) -> pa.RecordBatch:
        decoded = locate_changes(parts, self.spec)
        if self.keys is not None:
            wanted = pc.is_in(decoded.changes.column("_key"), value_set=pa.array(sorted(self.keys), pa.binary()))
            rows = decoded.take(np.flatnonzero(wanted.to_numpy(zero_copy_only=False)), self.positions)
            return _blob_batch(with_version(rows))
        latest = np.sort(latest_indices(decoded.changes, self.truncated_at))  # rows read in buffer order
        return _blob_batch(decoded.take(latest))


def _freeze_worker_heap() -> None:
    """Once per Python worker, after its first task: everything then alive (pyspark, pyarrow, numba
    and its loaded kernels) leaves the cyclic collector's reach (`gc.freeze`).

    A reused PySpark worker runs a full `gc.collect()` after every task (pyspark.daemon); over those
    modules' objects that took about 65 ms of CPU a task, more than decoding 20,000 changes. Objects
    created later are collected as before, and refcounting frees frozen ones as usual.
    """
    if not gc.get_freeze_count():
        gc.collect()
        gc.freeze()


def _package_frame(spark: SparkSession, packages: Sequence[ReceivedPackage]) -> DataFrame:
    """(seq, payload) rows spread over the executors, each slice about as large as the others."""
    slices = decode_slices(spark)
    order = _balanced_order([len(p.payload) for p in packages], slices)
    data = pa.Table.from_arrays([pa.array([packages[i].sequence for i in order], pa.int64()),
                                 pa.array([packages[i].payload for i in order], pa.binary())], schema=INPUT_SCHEMA)
    frame = spark.createDataFrame(data)
    if not is_remote(spark):
        return frame  # a local relation is already cut into `slices` contiguous, equally long slices
    partitions = min(len(packages), slices)
    return frame.repartition(partitions) if partitions > 1 else frame


def _balanced_order(sizes: Sequence[int], slices: int) -> list[int]:
    """An order of the packages whose contiguous, equally long slices (as Spark cuts a local
    relation) hold about equal bytes: largest first, dealt round-robin."""
    count = len(sizes)
    slices = max(1, min(slices, count))
    bounds = [i * count // slices for i in range(slices + 1)]
    by_size = sorted(range(count), key=lambda i: sizes[i], reverse=True)
    dealt: list[list[int]] = [[] for _ in range(slices)]
    room = [bounds[i + 1] - bounds[i] for i in range(slices)]
    target = 0
    for index in by_size:
        while not room[target % slices]:
            target += 1
        dealt[target % slices].append(index)
        room[target % slices] -= 1
        target += 1
    return [index for part in dealt for index in part]


def _collect(frame: DataFrame) -> list[pa.Table]:
    collected = frame.toArrow()
    return [_read_blob(blob) for batch in collected.to_batches() for blob in _blobs(batch)]


def _blob_batch(rows: pa.Table) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([_one_binary(_write_blob(rows))], names=["_blob"])


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
