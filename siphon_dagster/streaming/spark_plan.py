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
several times the decoding itself. In local mode, where the executors' Python workers share the
driver's file system, a task writes its stream to a file of the batch's own temporary directory
and hands on only the file's name (`_path`): the JVM then copies no values at all (it copied each
blob several times, from the worker, into Spark rows and back to Arrow for the driver), and the
driver maps the file instead of reading it from a socket. The packages go the same way: the driver
writes the batch's payloads to one file of that directory and the Spark rows say where each lies,
so no payload becomes part of a task (Spark warned of tasks of several megabytes and copied each
payload into the JVM and out to a Python worker).
"""

from __future__ import annotations

import gc
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

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
    INPUT_FILE_SCHEMA,
    INPUT_SCHEMA,
    AsSentRows,
    DecodeSpec,
    LocatedChanges,
    PackageDecoder,
    folded_schema,
    locate_changes,
)
from siphon_dagster.streaming.fold import latest_indices, merge_pieces, with_version
from siphon_dagster.streaming.scratch import batch_directory
from siphon_dagster.streaming.spark_facts import decode_slices, is_remote
from siphon_dagster.streaming.worker_memory import retain_between_tasks

BLOB_DDL = "_blob binary, _path string"
PACKAGES_FILE = "packages"  # in a job's result directory: the payloads of its packages
# Decoded changes a decode task folds and hands on at once; the merge still meets every change of
# a key, whatever the number of pieces.
DECODED_BYTES_PER_FLUSH = 128 << 20
# A batch decoded in the driver keeps its decoded changes up to this size for the TOAST fill, which
# would otherwise decode the whole batch a second time to find the earlier changes of a few keys
# (every UPDATE that leaves a TOASTed value unchanged asks for them). A larger batch decodes again.
HISTORY_KEPT_BYTES = 16 << 20
# Values compress several times over; Spark then copies and hands back far fewer bytes. A file
# handed on by name is mapped by the driver as it is: not compressed, nothing to undo.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")
_FILE_IPC_OPTIONS = pa.ipc.IpcWriteOptions()
WARM_UP_ROUNDS = 4
WARM_UP_ROWS = 20_000


def folded_pieces(spark: SparkSession, packages: Sequence[ReceivedPackage], spec: DecodeSpec,
                  truncated_at: int | None) -> list[pa.Table]:
    """The tasks' folded rows: each piece holds a key at most once; `merge_folded` makes one row
    per key of the batch out of them."""
    with _result_directory(spark) as directory:
        stage = DecodeStage(spec, truncated_at, directory=directory)
        return _collect(_package_frame(spark, packages, directory).mapInArrow(stage, BLOB_DDL))


def folded_pieces_in_driver(packages: Sequence[ReceivedPackage], spec: DecodeSpec,
                            truncated_at: int | None) -> tuple[list[pa.Table], list[LocatedChanges] | None]:
    """`folded_pieces` without Spark: the decode stage the tasks run, called in this process on one
    slice of every package. For small batches, where a Spark job's scheduling (tens of
    milliseconds) would cost more than the decoding. Also returns the decoded changes before the
    fold when a folded row has unchanged TOASTed values and the changes hold at most
    `HISTORY_KEPT_BYTES` (else None): `key_history_in_driver` reads a key's history out of them
    instead of decoding the batch again."""
    stage = DecodeStage(spec, truncated_at, in_driver=True, keep_located_bytes=HISTORY_KEPT_BYTES)
    pieces = list(stage.tables(iter(package_rows(packages, None).to_batches())))
    # Kept only when a folded row has unchanged values to fill: no other batch asks for history, and
    # a batch waiting for its write should not hold its changes twice.
    return pieces, stage.located if any(_has_unchanged(piece) for piece in pieces) else None


def _with_as_sent(parts: list[pa.RecordBatch], as_sent: AsSentRows) -> list[pa.RecordBatch]:
    made = as_sent.batch()
    return parts if made is None else [made, *parts]


def _held_bytes(part: pa.RecordBatch) -> int:
    """The memory a decoded part holds: its buffers' sizes. `nbytes` measures the values' own ranges
    instead, walking the offsets of every binary column, at a tenth of a package's decoding cost."""
    return part.get_total_buffer_size()


def _has_unchanged(folded: pa.Table) -> bool:
    lengths = pc.list_value_length(folded.column("_unchanged"))
    return folded.num_rows > 0 and bool(pc.max(pc.fill_null(lengths, 0)).as_py() or 0)


def key_history_in_driver(packages: Sequence[ReceivedPackage], spec: DecodeSpec, keys: Sequence[bytes],
                          positions: Sequence[int], located: Sequence[LocatedChanges] | None = None) -> pa.Table:
    """`key_history` without Spark, for the batches `folded_pieces_in_driver` decoded; from
    `located`, that decode's changes, when it kept them."""
    stage = DecodeStage(spec, None, keys=frozenset(keys), positions=tuple(positions), in_driver=True)
    if located is not None:
        pieces = [stage.history(changes) for changes in located]
    else:
        pieces = list(stage.tables(iter(package_rows(packages, None).to_batches())))
    return pa.concat_tables(pieces) if pieces else folded_schema(len(spec.columns), positions).empty_table()


def merge_folded(pieces: Sequence[pa.Table], column_count: int, superseded_allowed: bool = False) -> pa.Table:
    """The latest row of each key among folded pieces, laid out as `decode.folded_schema`: `_key,
    _op, _lsn, _pos, _seq, _reset, _origin, _unchanged, c0..cN` (values as binary), `_version`.

    With `superseded_allowed` (a target that keeps each key's greatest version by itself), pieces
    none of whose rows has unchanged TOASTed values are only put together: a key two tasks both
    saw keeps both rows, and the older is superseded at the target. Taking it out meant copying
    every value of each piece that held one, a fifth of the driver's time behind a backlog of
    updates, for rows that cost the target far less. Rows to fill are still merged, so each is
    filled once, as the newest change of its key."""
    nonempty = [piece for piece in pieces if piece.num_rows]
    if not nonempty:
        return folded_schema(column_count).empty_table()
    if superseded_allowed and not any(_has_unchanged(piece) for piece in nonempty):
        return with_version(pa.concat_tables(nonempty) if len(nonempty) > 1 else nonempty[0])
    return with_version(merge_pieces(nonempty))


def _has_unchanged(piece: pa.Table) -> bool:
    """Whether a row of the folded piece has unchanged TOASTed values (`_unchanged` not NULL)."""
    return piece.column("_unchanged").null_count < piece.num_rows


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
    with _result_directory(spark) as directory:
        stage = DecodeStage(spec, None, keys=frozenset(keys), positions=tuple(positions), directory=directory)
        pieces = _collect(_package_frame(spark, packages, directory).mapInArrow(stage, BLOB_DDL))
    return pa.concat_tables(pieces) if pieces else folded_schema(len(spec.columns), positions).empty_table()


class DecodeStage:
    """Executors: packages in, IPC streams of the task's folded changes out (picklable), as blobs
    or, with a `directory` the driver reads too, as files named by their path. Packages come as
    rows of `INPUT_SCHEMA`, or of `INPUT_FILE_SCHEMA` when they lie in that directory's
    `PACKAGES_FILE`."""

    def __init__(self, spec: DecodeSpec, truncated_at: int | None, keys: frozenset[bytes] | None = None,
                 positions: tuple[int, ...] | None = None, directory: str | None = None,
                 in_driver: bool = False, keep_located_bytes: int = 0) -> None:
        self.spec = spec
        self.in_driver = in_driver  # called by the run's own process: not a Python worker's heap to freeze
        self.truncated_at = truncated_at
        self.keys = keys  # history: only these keys, nothing folded, values at `positions`
        self.positions = positions
        self.directory = directory
        # The decoded changes of every flush, kept while they hold at most `keep_located_bytes`
        # (None once they hold more, or when nothing is kept).
        self.keep_located_bytes = keep_located_bytes
        self.located: list[LocatedChanges] | None = [] if keep_located_bytes > 0 else None
        self._located_bytes = 0

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        retention = None if self.in_driver else retain_between_tasks()
        if retention is not None:
            retention.task_started()
        try:
            for rows in self.tables(batches):
                yield self._result(rows)
        finally:
            if retention is not None:
                retention.task_ended()
        if not self.in_driver:
            _freeze_worker_heap()

    def tables(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.Table]:
        """The folded rows of the packages, a table per flush (what a task hands on as IPC)."""
        decoder = PackageDecoder(self.spec)
        parts: list[pa.RecordBatch] = []
        as_sent = AsSentRows()  # the rows of every package that are a tuple as sent, as one part
        held = 0
        for batch in batches:
            for seq, payload in self._payloads(batch):
                for part in decoder.decode(seq, payload, as_sent):
                    parts.append(part)
                    held += _held_bytes(part)
                if held + as_sent.nbytes >= DECODED_BYTES_PER_FLUSH:  # a worker holds a bounded part of the batch
                    yield self._flush(_with_as_sent(parts, as_sent))
                    parts, held = [], 0
        if parts or as_sent.count:
            yield self._flush(_with_as_sent(parts, as_sent))

    def _payloads(self, batch: pa.RecordBatch) -> Iterator[tuple[int, bytes]]:
        sequences = batch.column(0).to_pylist()
        if batch.num_columns == len(INPUT_SCHEMA):
            yield from zip(sequences, batch.column(1).to_pylist(), strict=True)
            return
        if self.directory is None:
            raise ValueError("packages given by their place in a file, but the decode stage has no directory")
        path = os.path.join(self.directory, PACKAGES_FILE)
        starts, lengths = batch.column(1).to_pylist(), batch.column(2).to_pylist()
        with open(path, "rb") as file:
            for seq, start, length in zip(sequences, starts, lengths, strict=True):
                payload = os.pread(file.fileno(), length, start)
                if len(payload) != length:
                    raise ValueError(f"stream sequence {seq}: {path} ends before the package's {length} bytes at "
                                     f"{start}")
                yield seq, payload

    def _flush(self, parts: list[pa.RecordBatch]) -> pa.Table:
        decoded = locate_changes(parts, self.spec)
        if self.keys is not None:
            return self.history(decoded)
        self._keep(decoded, sum(_held_bytes(part) for part in parts))
        latest = np.sort(latest_indices(decoded.changes, self.truncated_at))  # rows read in buffer order
        return decoded.take(latest)

    def history(self, decoded: LocatedChanges) -> pa.Table:
        """Every change of `keys` among `decoded`, unfolded, with the values at `positions`."""
        assert self.keys is not None
        wanted = pc.is_in(decoded.changes.column("_key"), value_set=pa.array(sorted(self.keys), pa.binary()))
        return with_version(decoded.take(np.flatnonzero(wanted.to_numpy(zero_copy_only=False)), self.positions))

    def _keep(self, decoded: LocatedChanges, size: int) -> None:
        if self.located is None:
            return
        self._located_bytes += size
        if self._located_bytes > self.keep_located_bytes:
            self.located = None
            return
        self.located.append(decoded)

    def _result(self, rows: pa.Table) -> pa.RecordBatch:
        if self.directory is not None:
            path = os.path.join(self.directory, f"{uuid.uuid4().hex}.arrows")
            try:
                _write_file(rows, path)
                return _result_batch(None, path)
            except OSError:  # a full or vanished directory: the blob still goes through Spark
                _remove(path)
        return _result_batch(_write_blob(rows), None)


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


def _package_frame(spark: SparkSession, packages: Sequence[ReceivedPackage], directory: str | None) -> DataFrame:
    """One row per package, spread over the executors, each slice about as large as the others."""
    slices = decode_slices(spark)
    order = _balanced_order([len(p.payload) for p in packages], slices)
    frame = spark.createDataFrame(package_rows([packages[i] for i in order], directory))
    if not is_remote(spark):
        return frame  # a local relation is already cut into `slices` contiguous, equally long slices
    partitions = min(len(packages), slices)
    return frame.repartition(partitions) if partitions > 1 else frame


def package_rows(packages: Sequence[ReceivedPackage], directory: str | None) -> pa.Table:
    """`INPUT_SCHEMA` rows; with a `directory`, the payloads are written to its `PACKAGES_FILE`
    and the rows (`INPUT_FILE_SCHEMA`) say where each lies."""
    sequences = pa.array([p.sequence for p in packages], pa.int64())
    if directory is not None:
        lengths = np.array([len(p.payload) for p in packages], np.int64)
        try:
            with open(os.path.join(directory, PACKAGES_FILE), "wb") as file:
                file.writelines(p.payload for p in packages)
        except OSError:
            pass  # a full or vanished directory: the payloads go through Spark
        else:
            starts = np.cumsum(lengths) - lengths
            return pa.Table.from_arrays([sequences, pa.array(starts), pa.array(lengths)], schema=INPUT_FILE_SCHEMA)
    return pa.Table.from_arrays([sequences, pa.array([p.payload for p in packages], pa.binary())], schema=INPUT_SCHEMA)


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


@contextmanager
def _result_directory(spark: SparkSession) -> Iterator[str | None]:
    """A temporary directory for one Spark job's files (`scratch`), in local mode only (elsewhere
    the executors may not share the driver's file system); removed with whatever a failed or
    retried task left in it."""
    if is_remote(spark) or not spark.sparkContext.master.startswith("local"):
        yield None
        return
    try:
        path = batch_directory()
    except OSError:
        yield None
        return
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _collect(frame: DataFrame) -> list[pa.Table]:
    return [table for batch in frame.toArrow().to_batches() for table in _results(batch)]


def _results(batch: pa.RecordBatch) -> list[pa.Table]:
    """The rows a decode stage's output batch carries, as blobs or in files."""
    blobs, paths = batch.column("_blob"), batch.column("_path")
    return [_read_file(path.as_py()) if path.is_valid else _read_blob(blob.as_buffer())
            for blob, path in zip(blobs, paths, strict=True)]


def _result_batch(blob: pa.Buffer | None, path: str | None) -> pa.RecordBatch:
    blobs = pa.array([None], pa.binary()) if blob is None else _one_binary(blob)
    return pa.RecordBatch.from_arrays([blobs, pa.array([path], pa.string())], names=["_blob", "_path"])


def _one_binary(buffer: pa.Buffer) -> pa.Array:
    """A one-value binary array over `buffer`, without copying it."""
    offsets = pa.array([0, buffer.size], pa.int64() if buffer.size > 2**31 - 1 else pa.int32())
    binary = pa.large_binary() if buffer.size > 2**31 - 1 else pa.binary()
    return pa.Array.from_buffers(binary, 1, [None, offsets.buffers()[1], buffer])


def _write_blob(rows: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema, options=_IPC_OPTIONS) as writer:
        writer.write_table(rows)
    return sink.getvalue()


def _read_blob(blob: pa.Buffer) -> pa.Table:
    return pa.ipc.open_stream(blob).read_all()


def _write_file(rows: pa.Table, path: str) -> None:
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, rows.schema, options=_FILE_IPC_OPTIONS) as writer:
        writer.write_table(rows)


def _read_file(path: str) -> pa.Table:
    """The rows of a result file, mapped, not copied; the file's name is removed at once (the
    mapping keeps its pages until the rows are freed)."""
    try:
        with pa.memory_map(path) as source:
            return pa.ipc.open_stream(source).read_all()
    finally:
        _remove(path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
