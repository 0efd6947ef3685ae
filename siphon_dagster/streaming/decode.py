"""Decoding packages into change rows, as Spark work on the executors (`mapInArrow`).

Input rows are (seq, payload): the JetStream stream sequence and the compressed package; or, when
the payloads were written to a file the executors share (siphon_dagster.streaming.spark_plan),
(seq, start, length): where the payload lies in it. Decoded
rows are laid out by `DECODED_SCHEMA`: one row per change of one primary key, its values kept as one
TupleData aligned to the batch's newest column list:

    _key        the primary key, encoded as a TupleData of the key values (NULL for TRUNCATE)
    _op         the pb.Operation value
    _lsn, _pos  commit LSN and position in the transaction; `_version` is computed from them
    _seq        the stream sequence of the package (named in errors)
    _reset      the row starts a new lineage of values for its key: earlier rows of the key cannot
                supply an unchanged TOASTed value (INSERT, SNAPSHOT, DELETE, the new key of a
                primary-key update)
    _origin     on the new key's row of a primary-key update, the old key: its row supplies the
                unchanged TOASTed values
    _row        TupleData of the values in the batch's column order; 'u' marks a column without a
                value: an unchanged TOASTed value not sent, or a column absent from the package's
                own (older) column list. NULL for TRUNCATE.

`locate_changes` splits the tuples of all of a task's packages at once (vectorized, every row
checked) and cuts the keys out of them; after the fold, `LocatedChanges.take` hands on the surviving
rows with `_row` replaced by `_unchanged` (those positions) and `c0..cN` (PostgreSQL text output,
NULL for NULL or no value; positional names, so any source column name is safe). Values are split
once, and only for rows that survive.

A primary-key update becomes a DELETE of the old key and a change of the new key, both with the
event's version. Under REPLICA IDENTITY FULL the old row fills unchanged TOASTed values here.

Most events need no Python per value: an INSERT's or a plain UPDATE's new tuple, a DELETE's old key,
are the row as sent. Events that need values rearranged (an older column list, an UPDATE carrying
its old row) take the per-value path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.event_columns import binary_array, gather_spans_into, read_package
from siphon_core.wire.packages import decompress_package
from siphon_core.wire.tuple_columns import MalformedTupleError, TupleColumns, split_tuples
from siphon_core.wire.tuple_data import UNCHANGED_TOAST, TupleDataError, Value, decode_tuple, encode_tuple
from siphon_dagster.streaming.fold import VERSION_TYPE

INPUT_SCHEMA = pa.schema([pa.field("seq", pa.int64(), nullable=False), pa.field("payload", pa.binary())])
# The same rows when the payloads lie in a file the executors read (local mode): where each lies.
INPUT_FILE_SCHEMA = pa.schema([pa.field("seq", pa.int64(), nullable=False), pa.field("start", pa.int64(), nullable=False),
                               pa.field("length", pa.int64(), nullable=False)])
DECODED_SCHEMA = pa.schema([
    pa.field("_key", pa.binary()),
    pa.field("_op", pa.int8()),
    pa.field("_lsn", pa.int64()),
    pa.field("_pos", pa.int64()),
    pa.field("_seq", pa.int64()),
    pa.field("_reset", pa.bool_()),
    pa.field("_origin", pa.binary()),
    pa.field("_row", pa.binary()),
])
_INSERTS = (pb.INSERT, pb.SNAPSHOT)
_UPDATE, _DELETE, _TRUNCATE = pb.UPDATE, pb.DELETE, pb.TRUNCATE
_MISSING = -1  # a column of the batch's list that an older package does not have
# What an as-sent row holds besides its values: operation, LSN, position, sequence, offset, flag.
_AS_SENT_ROW_BYTES = 1 + 8 + 8 + 8 + 8 + 1


def value_column(position: int) -> str:
    return f"c{position}"


@dataclass(frozen=True)
class DecodeSpec:
    """What executors need: the batch's newest column list and its primary key, by name, and the
    table's name for errors."""

    columns: tuple[str, ...]
    key_columns: tuple[str, ...]
    table: str = ""

    @property
    def key_positions(self) -> list[int]:
        return [self.columns.index(name) for name in self.key_columns]


class _Rows:
    """Column-wise output of one package."""

    def __init__(self) -> None:
        self.keys: list[bytes | None] = []
        self.ops: list[int] = []
        self.lsns: list[int] = []
        self.positions: list[int] = []
        self.resets: list[bool] = []
        self.origins: list[bytes | None] = []
        self.rows: list[bytes | None] = []

    def add(self, key: bytes | None, op: int, event: pb.Event, reset: bool, origin: bytes | None,
            row: bytes | None) -> None:
        self.keys.append(key)
        self.ops.append(op)
        self.lsns.append(event.commit_lsn)
        self.positions.append(event.position)
        self.resets.append(reset)
        self.origins.append(origin)
        self.rows.append(row)

    def batch(self, seq: int) -> pa.RecordBatch:
        count = len(self.ops)
        return pa.RecordBatch.from_arrays(
            [pa.array(self.keys, pa.binary()), pa.array(self.ops, pa.int8()), pa.array(self.lsns, pa.int64()),
             pa.array(self.positions, pa.int64()), pa.array(np.full(count, seq, np.int64)),
             pa.array(self.resets, pa.bool_()), pa.array(self.origins, pa.binary()), pa.array(self.rows, pa.binary())],
            schema=DECODED_SCHEMA)


class AsSentRows:
    """The events of many packages that are their row as sent (see `PackageDecoder.decode`), kept as
    arrays and made into one record batch: a batch of a run of hundreds of tables holds tens of
    small packages, and building eight Arrow arrays per package cost more than reading it. Each
    package's values are copied once, when the batch is made, straight into the batch's column."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._ops: list[np.ndarray] = []
        self._lsns: list[np.ndarray] = []
        self._positions: list[np.ndarray] = []
        self._seqs: list[np.ndarray] = []
        self._spans: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (package data, starts, lengths)
        self._value_bytes = 0
        self.count = 0
        self.nbytes = 0  # what the held packages and the per-row arrays hold

    def add(self, ops: np.ndarray, lsns: np.ndarray, positions: np.ndarray, seq: int, data: np.ndarray,
            starts: np.ndarray, lengths: np.ndarray) -> None:
        self._ops.append(ops)
        self._lsns.append(lsns)
        self._positions.append(positions)
        self._seqs.append(np.full(ops.size, seq, np.int64))
        self._spans.append((data, starts, lengths))
        self._value_bytes += int(lengths.sum())
        self.count += ops.size
        self.nbytes += data.nbytes + ops.size * _AS_SENT_ROW_BYTES

    def batch(self) -> pa.RecordBatch | None:
        """Every row added, as one batch laid out by `DECODED_SCHEMA`; None without rows. Starts over."""
        if not self.count:
            return None
        ops = np.concatenate(self._ops)
        values = np.empty(self._value_bytes, np.uint8)
        offsets = np.empty(self.count + 1, np.int64)
        offsets[0] = first = 0
        for data, starts, lengths in self._spans:
            gather_spans_into(data, starts, lengths, values, offsets, first)
            first += starts.size
        made = pa.RecordBatch.from_arrays(
            [pa.nulls(self.count, pa.binary()), pa.array(ops), pa.array(np.concatenate(self._lsns)),
             pa.array(np.concatenate(self._positions)), pa.array(np.concatenate(self._seqs)),
             pa.array(ops != _UPDATE), pa.nulls(self.count, pa.binary()), binary_array(offsets, values)],
            schema=DECODED_SCHEMA)
        self._reset()
        return made


class PackageDecoder:
    """Turns one package into change rows aligned to `spec` (callable on executors, picklable).

    The rows' keys are left NULL where they are to be cut out of `_row` (`locate_changes` does that
    for all packages of a task at once)."""

    def __init__(self, spec: DecodeSpec) -> None:
        self.spec = spec

    def decode(self, seq: int, payload: bytes, as_sent: AsSentRows | None = None) -> Iterator[pa.RecordBatch]:
        """The package's change rows; with `as_sent`, the rows that are an event's tuple as sent go
        there instead (the caller makes them a batch), and only the others are yielded."""
        where = f"stream sequence {seq}"
        package, columns = read_package(decompress_package(payload, where), where)
        if package.HasField("chunk"):
            raise ValueError(f"{where}: a slice of a large event reached the decoder unassembled")
        if package.value_encoding != pb.PGOUTPUT_TUPLE:
            raise ValueError(f"{where}: value encoding {package.value_encoding} is not supported by this consumer")
        align = self._alignment(package, where)
        # The common events are read as columns, with no Python per event: an INSERT's or a plain
        # UPDATE's new tuple, a DELETE's old key, is the row as sent.
        if align is not None:
            others = [columns.event(i) for i in range(len(columns))]
        else:
            ops, has_old = columns.operations, columns.has_old_row
            # Comparisons, not np.isin: it costs tens of microseconds a call on a small package.
            sent = (ops == pb.INSERT) | (ops == pb.SNAPSHOT) | ((ops == _UPDATE) & ~has_old)
            old_key = (ops == _DELETE) & has_old
            fast = np.flatnonzero(sent | old_key)
            others = [columns.event(i) for i in np.flatnonzero(~(sent | old_key)).tolist()]
            if fast.size:
                starts = np.where(sent, columns.new_starts, columns.old_starts)[fast]
                lengths = np.where(sent, columns.new_lengths, columns.old_lengths)[fast]
                op_array = ops[fast].astype(np.int8)
                gathered = as_sent if as_sent is not None else AsSentRows()
                gathered.add(op_array, columns.commit_lsns[fast].view(np.int64), columns.positions[fast], seq,
                             columns.data, starts, lengths)
                if as_sent is None:
                    yield gathered.batch()  # type: ignore[misc]
        if others:
            slow = _Rows()
            key_positions = self.spec.key_positions
            for event in others:
                try:
                    self._event(slow, event, align, key_positions)
                except ValueError as error:  # TupleDataError included
                    raise _event_error(where, self.spec.table, event.commit_lsn, event.position, error) from None
            yield slow.batch(seq)

    def _alignment(self, package: pb.Package, where: str) -> list[int] | None:
        """Package column index for each output column, or None when the lists are the same."""
        names = [column.name for column in package.columns]
        if tuple(names) == self.spec.columns:
            return None
        index = {name: i for i, name in enumerate(names)}
        missing_keys = [name for name in self.spec.key_columns if name not in index]
        if missing_keys:
            raise ValueError(f"{where}: primary key column(s) {missing_keys} are missing from the package")
        return [index.get(name, _MISSING) for name in self.spec.columns]

    def _event(self, rows: _Rows, event: pb.Event, align: list[int] | None, key_positions: list[int]) -> None:
        op = event.operation
        if op == pb.TRUNCATE:
            rows.add(None, op, event, True, None, None)
            return
        new = _values(event.new_row.tuple, align) if op != pb.DELETE else None
        old = _values(event.old_row.tuple, align) if event.HasField("old_row") else None
        if old is not None and event.old_row_is_key and any(old[i] is None for i in key_positions):
            raise ValueError(_missing_key_message(op))
        if op in _INSERTS:
            rows.add(_key(new, key_positions), op, event, True, None, encode_tuple(new))  # type: ignore[arg-type]
        elif op == pb.DELETE:
            if old is None:
                raise ValueError("a DELETE without its old key")
            rows.add(_key(old, key_positions), op, event, True, None, encode_tuple(old))
        elif op == pb.UPDATE:
            self._update(rows, event, new, old, key_positions)  # type: ignore[arg-type]
        else:
            raise ValueError(f"unknown operation {op}")

    @staticmethod
    def _update(rows: _Rows, event: pb.Event, new: list[Value], old: list[Value] | None,
                key_positions: list[int]) -> None:
        if old is not None:
            # A TOASTed key column is sent only in the old key; a full old row fills the rest.
            fill = range(len(new)) if event.old_row_is_full else key_positions
            for i in fill:
                if new[i] is UNCHANGED_TOAST and old[i] is not UNCHANGED_TOAST:
                    new[i] = old[i]
        key = _key(new, key_positions)
        old_key = _key(old, key_positions) if old is not None else key
        if old_key == key:
            rows.add(key, pb.UPDATE, event, False, None, encode_tuple(new))
            return
        rows.add(old_key, pb.DELETE, event, True, None, encode_tuple(old))  # type: ignore[arg-type]
        rows.add(key, pb.UPDATE, event, True, old_key, encode_tuple(new))


@dataclass(frozen=True)
class LocatedChanges:
    """Decoded changes with every key filled, and where each value of `_row` lies."""

    changes: pa.Table  # DECODED_SCHEMA, one chunk
    located: TupleColumns

    def take(self, rows: np.ndarray, positions: Sequence[int] | None = None) -> pa.Table:
        """The changes at `rows`, `_row` replaced by `_unchanged` and the value columns `c<i>` (all,
        or those at `positions`) as binary."""
        rows = np.asarray(rows, np.int64)
        taken = self.changes.drop_columns(["_row"]).take(pa.array(rows))
        wanted = range(self.located.column_count) if positions is None else positions
        # The table is made once: appending a wide table's columns one by one made a table each time.
        added = [self.located.unchanged(rows), *self.located.columns(wanted, rows)]
        names = ["_unchanged", *(value_column(position) for position in wanted)]
        fields = [*taken.schema, *(pa.field(name, array.type) for name, array in zip(names, added, strict=True))]
        return pa.Table.from_arrays([*taken.columns, *added], schema=pa.schema(fields))


def locate_changes(parts: Sequence[pa.RecordBatch], spec: DecodeSpec) -> LocatedChanges:
    """Splits the tuples of all `parts` at once and fills the keys the decoder left NULL."""
    changes = pa.Table.from_batches(parts, DECODED_SCHEMA).combine_chunks()
    try:
        located = split_tuples(changes.column("_row"), len(spec.columns))  # every row checked, not only its key
    except MalformedTupleError as error:
        raise _row_error(changes, spec.table, error.row, TupleDataError(error.detail)) from None
    given = changes.column("_key")
    if given.null_count:
        keys = pc.coalesce(given, located.key(spec.key_positions))
        ops = changes.column("_op").to_numpy()
        missing = keys.is_null().to_numpy(zero_copy_only=False) & (ops != _TRUNCATE)
        if missing.any():
            row = int(np.flatnonzero(missing)[0])
            raise _row_error(changes, spec.table, row, ValueError(_missing_key_message(int(ops[row]))))
        changes = changes.set_column(0, "_key", keys)
    return LocatedChanges(changes, located)


def folded_schema(column_count: int, positions: Sequence[int] | None = None) -> pa.Schema:
    """The layout of `LocatedChanges.take` with `_version` (what the Spark plan hands back)."""
    fields = [f for f in DECODED_SCHEMA if f.name != "_row"]
    fields.append(pa.field("_unchanged", pa.list_(pa.int32())))
    fields += [pa.field(value_column(p), pa.binary()) for p in (range(column_count) if positions is None else positions)]
    fields.append(pa.field("_version", VERSION_TYPE))
    return pa.schema(fields)


def _missing_key_message(op: int) -> str:
    if op == pb.UPDATE:
        return "a primary key value is an unchanged TOASTed value and no old key was sent"
    # The replica identity is an index other than the primary key: the old key does not say which
    # row changed, and guessing would tombstone the wrong one.
    return ("the old key lacks primary key values; set REPLICA IDENTITY DEFAULT (the primary key) or FULL "
            "on the source table")


def _event_error(where: str, table: str, lsn: int, position: int, error: Exception) -> ValueError:
    in_table = f", table {table}" if table else ""
    return ValueError(f"{where}{in_table}, event at LSN {naming.format_lsn(lsn)} position {position}: {error}")


def _row_error(changes: pa.Table, table: str, row: int, error: Exception) -> ValueError:
    return _event_error(f"stream sequence {changes.column('_seq')[row].as_py()}", table,
                        changes.column("_lsn")[row].as_py(), changes.column("_pos")[row].as_py(), error)


def _values(data: bytes, align: list[int] | None) -> list[Value]:
    values, _ = decode_tuple(data)
    if align is None:
        return values
    return [UNCHANGED_TOAST if i == _MISSING else values[i] for i in align]


_ONE_VALUE_TUPLE = b"\x00\x01t"  # TupleData head of one text value


def _key(values: list[Value], key_positions: list[int]) -> bytes:
    if len(key_positions) == 1:
        value = values[key_positions[0]]
        if type(value) is bytes:  # the usual single-column key: encode_tuple's output, built directly
            return _ONE_VALUE_TUPLE + len(value).to_bytes(4, "big") + value
    key = [values[i] for i in key_positions]
    if UNCHANGED_TOAST in key:
        raise ValueError("a primary key value is an unchanged TOASTed value and no old key was sent")
    return encode_tuple(key)  # type: ignore[arg-type]
