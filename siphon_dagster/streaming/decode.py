"""Decoding packages into change rows, as Spark work on the executors (`mapInArrow`).

Input rows are (seq, payload): the JetStream stream sequence and the compressed package. Output rows
are laid out by `decoded_schema`: one row per change of one primary key, with every column aligned
to the batch's newest column list (positional names `c0..cN`, so any source column name is safe in
Spark, whose names are case-insensitive):

    _key        the primary key, encoded as a TupleData of the key values (NULL for TRUNCATE)
    _op         the pb.Operation value
    _lsn, _pos  commit LSN and position in the transaction; `_version` is computed from them in Spark
    _reset      the row starts a new lineage of values for its key: earlier rows of the key cannot
                supply an unchanged TOASTed value (INSERT, SNAPSHOT, DELETE, the new key of a
                primary-key update)
    _origin     on the new key's row of a primary-key update, the old key: its row supplies the
                unchanged TOASTed values
    _unchanged  positions of columns without a value: unchanged TOASTed values not sent, and columns
                absent from the package's own (older) column list
    c0..cN      PostgreSQL text output, NULL for NULL or no value

A primary-key update becomes a DELETE of the old key and a change of the new key, both with the
event's version. Under REPLICA IDENTITY FULL the old row fills unchanged TOASTed values here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import decode_package
from siphon_core.wire.tuple_data import UNCHANGED_TOAST, Value, decode_tuple, encode_tuple

INPUT_SCHEMA = pa.schema([pa.field("seq", pa.int64(), nullable=False), pa.field("payload", pa.binary())])
_META_FIELDS = [
    pa.field("_key", pa.binary()),
    pa.field("_op", pa.int8()),
    pa.field("_lsn", pa.int64()),
    pa.field("_pos", pa.int64()),
    pa.field("_reset", pa.bool_()),
    pa.field("_origin", pa.binary()),
    pa.field("_unchanged", pa.list_(pa.int32())),
]
_INSERTS = (pb.INSERT, pb.SNAPSHOT)
_MISSING = -1  # a column of the batch's list that an older package does not have


def value_column(position: int) -> str:
    return f"c{position}"


def decoded_schema(column_count: int) -> pa.Schema:
    return pa.schema(_META_FIELDS + [pa.field(value_column(i), pa.binary()) for i in range(column_count)])


def decoded_ddl(column_count: int) -> str:
    """The same layout as a Spark DDL string (what `mapInArrow` is given)."""
    meta = "_key binary, _op tinyint, _lsn bigint, _pos bigint, _reset boolean, _origin binary, _unchanged array<int>"
    return ", ".join([meta] + [f"{value_column(i)} binary" for i in range(column_count)])


@dataclass(frozen=True)
class DecodeSpec:
    """What executors need: the batch's newest column list and its primary key, by name."""

    columns: tuple[str, ...]
    key_columns: tuple[str, ...]


class _Rows:
    """Column-wise output of one package; values are gathered per row and transposed once."""

    def __init__(self) -> None:
        self.keys: list[bytes | None] = []
        self.ops: list[int] = []
        self.lsns: list[int] = []
        self.positions: list[int] = []
        self.resets: list[bool] = []
        self.origins: list[bytes | None] = []
        self.unchanged: list[list[int] | None] = []
        self.values: list[Sequence[Value]] = []

    def add(self, key: bytes | None, op: int, event: pb.Event, reset: bool, origin: bytes | None,
            values: list[Value]) -> None:
        unchanged = None
        if UNCHANGED_TOAST in values:
            unchanged = [i for i, value in enumerate(values) if value is UNCHANGED_TOAST]
            values = [None if value is UNCHANGED_TOAST else value for value in values]
        self.keys.append(key)
        self.ops.append(op)
        self.lsns.append(event.commit_lsn)
        self.positions.append(event.position)
        self.resets.append(reset)
        self.origins.append(origin)
        self.unchanged.append(unchanged)
        self.values.append(values)

    def batch(self, schema: pa.Schema, column_count: int) -> pa.RecordBatch:
        columns = list(zip(*self.values, strict=True)) if self.values else [()] * column_count
        arrays = [
            pa.array(self.keys, pa.binary()), pa.array(self.ops, pa.int8()), pa.array(self.lsns, pa.int64()),
            pa.array(self.positions, pa.int64()), pa.array(self.resets, pa.bool_()),
            pa.array(self.origins, pa.binary()), pa.array(self.unchanged, pa.list_(pa.int32())),
        ]
        arrays += [pa.array(column, pa.binary()) for column in columns]
        return pa.RecordBatch.from_arrays(arrays, schema=schema)


class PackageDecoder:
    """Turns one package into change rows aligned to `spec` (callable on executors, picklable)."""

    def __init__(self, spec: DecodeSpec) -> None:
        self.spec = spec
        self.schema = decoded_schema(len(spec.columns))

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for seq, payload in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True):
                yield self.decode(seq, payload)

    def decode(self, seq: int, payload: bytes) -> pa.RecordBatch:
        where = f"stream sequence {seq}"
        package = decode_package(payload, where)
        if package.HasField("chunk"):
            raise ValueError(f"{where}: a slice of a large event reached the decoder unassembled")
        if package.value_encoding != pb.PGOUTPUT_TUPLE:
            raise ValueError(f"{where}: value encoding {package.value_encoding} is not supported by this consumer")
        align = self._alignment(package, where)
        key_positions = [self.spec.columns.index(name) for name in self.spec.key_columns]
        rows = _Rows()
        for event in package.events:
            try:
                self._event(rows, event, align, key_positions)
            except ValueError as error:  # TupleDataError included
                raise ValueError(f"{where}, table {package.schema}.{package.table}, event at LSN "
                                 f"{naming.format_lsn(event.commit_lsn)} position {event.position}: {error}") from None
        return rows.batch(self.schema, len(self.spec.columns))

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
            rows.add(None, op, event, True, None, [None] * len(self.spec.columns))
            return
        new = _values(event.new_row.tuple, align) if op != pb.DELETE else None
        old = _values(event.old_row.tuple, align) if event.HasField("old_row") else None
        if old is not None and event.old_row_is_key and any(old[i] is None for i in key_positions):
            # The replica identity is an index other than the primary key: the old key does not
            # say which row changed, and guessing would tombstone the wrong one.
            raise ValueError("the old key lacks primary key values; set REPLICA IDENTITY DEFAULT (the primary "
                             "key) or FULL on the source table")
        if op in _INSERTS:
            rows.add(_key(new, key_positions), op, event, True, None, new)  # type: ignore[arg-type]
        elif op == pb.DELETE:
            if old is None:
                raise ValueError("a DELETE without its old key")
            rows.add(_key(old, key_positions), op, event, True, None, old)
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
            rows.add(key, pb.UPDATE, event, False, None, new)
            return
        rows.add(old_key, pb.DELETE, event, True, None, old)  # type: ignore[arg-type]
        rows.add(key, pb.UPDATE, event, True, old_key, new)


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
