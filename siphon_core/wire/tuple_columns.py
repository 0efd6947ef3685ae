"""Many TupleData at once: a column of TupleData (one per row) split into one Arrow column per
table column, with compiled loops (numba) stepping over the bytes instead of Python over every
value.

Consumers decode hundreds of thousands of rows per micro-batch; `tuple_data.decode_tuple` costs a
few microseconds per row of 30 columns, NumPy stepping over all rows column by column about a
third of a microsecond, these loops a few nanoseconds a value. `split_tuples` walks every row once
and records where each value lies (checking the layout as it goes); the values of the rows wanted
are then copied into Arrow binary columns in one pass per column. The layout is the one
`tuple_data` describes.

The loops are compiled on first use and cached next to this module, so a new process (a Spark
Python worker) loads them instead of compiling again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import pyarrow as pa

from siphon_core.wire.tuple_data import TupleDataError

TEXT, BINARY, NULL, UNCHANGED = b"tbnu"
_INT32_MAX = np.iinfo(np.int32).max
# Error codes of the walk.
_WRONG_COUNT, _UNKNOWN_KIND, _TRUNCATED, _TRAILING = 1, 2, 3, 4


class MalformedTupleError(TupleDataError):
    """A row of the column is not a well-formed TupleData; `row` is its index."""

    def __init__(self, row: int, message: str) -> None:
        super().__init__(f"row {row}: {message}")
        self.row = row
        self.detail = message


@dataclass(frozen=True)
class TupleColumns:
    """Where every value of every row lies in the buffer of the TupleData column."""

    buffer: pa.Buffer  # the Arrow column's value bytes
    data: np.ndarray  # the same bytes as a NumPy array
    present: np.ndarray  # (rows,) bool: the row has a TupleData (not NULL)
    kinds: np.ndarray  # (rows, columns) uint8: b't', b'b', b'n' or b'u' (b'n' for absent rows)
    starts: np.ndarray  # (rows, columns) int64: offset of each value's first byte
    lengths: np.ndarray  # (rows, columns) int64: 0 unless the kind is b't' or b'b'

    @property
    def row_count(self) -> int:
        return self.present.shape[0]

    @property
    def column_count(self) -> int:
        return self.kinds.shape[1]

    def values(self, column: int, rows: np.ndarray | None = None) -> pa.Array:
        """Column `column`'s values (of the rows at indices `rows`, or of all), copied into a binary
        array; NULL where the value is NULL or unchanged TOAST."""
        return self.columns([column], rows)[0]

    def columns(self, columns: Sequence[int], rows: np.ndarray | None = None) -> list[pa.Array]:
        """`values` of several columns, copied in one pass over the rows."""
        wanted = np.asarray(columns, np.int64)
        offsets, out, bases, valid = _gather_values(self.data, self.starts, self.lengths, self.kinds,
                                                    self._rows(rows), wanted)
        return [_binary_array(offsets[i], out[bases[i]:bases[i + 1]], valid[i]) for i in range(wanted.shape[0])]

    def unchanged(self, rows: np.ndarray | None = None) -> pa.Array:
        """Per row (at indices `rows`, or all), the positions of unchanged TOASTed values (NULL
        when there are none)."""
        offsets, positions = _unchanged_positions(self.kinds, self._rows(rows))
        counts = np.diff(offsets)
        mask = pa.array(counts == 0, pa.bool_())
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(positions, pa.int32()),
                                        mask=mask)

    def key(self, positions: list[int]) -> pa.Array:
        """The TupleData of the columns at `positions` per row, as `tuple_data.encode_tuple` writes
        it for text values: the count, then each column's bytes copied as they are. Rows where one
        of them is not a value (NULL, unchanged, absent row) get NULL."""
        offsets, out, valid = _gather_keys(self.data, self.starts, self.lengths, self.kinds,
                                           np.asarray(positions, np.int64))
        return _binary_array(offsets, out, valid)

    def _rows(self, rows: np.ndarray | None) -> np.ndarray:
        return np.arange(self.row_count, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)


def split_tuples(tuples: pa.Array | pa.ChunkedArray, column_count: int) -> TupleColumns:
    """Locates the values of a binary column of TupleData with `column_count` columns each.

    A NULL row stands for no tuple (every value NULL). Raises MalformedTupleError naming the first
    malformed row.
    """
    if isinstance(tuples, pa.ChunkedArray):
        tuples = tuples.combine_chunks() if tuples.num_chunks != 1 else tuples.chunk(0)
    if not pa.types.is_binary(tuples.type) and not pa.types.is_large_binary(tuples.type):
        raise TypeError(f"TupleData must be a binary column, not {tuples.type}")
    rows = len(tuples)
    offset_type = np.int64 if pa.types.is_large_binary(tuples.type) else np.int32
    _, offsets_buffer, data_buffer = tuples.buffers()
    offsets = np.frombuffer(offsets_buffer, offset_type, rows + 1, tuples.offset * np.dtype(offset_type).itemsize)
    offsets = offsets.astype(np.int64)
    if data_buffer is None or data_buffer.size == 0:
        data_buffer = pa.py_buffer(b"\0")
    data = np.frombuffer(data_buffer, np.uint8)
    present = tuples.is_valid().to_numpy(zero_copy_only=False) if tuples.null_count else np.ones(rows, bool)
    kinds = np.empty((rows, column_count), np.uint8)
    starts = np.empty((rows, column_count), np.int64)
    lengths = np.empty((rows, column_count), np.int64)
    error = _walk(data, offsets, present, column_count, kinds, starts, lengths)
    row, code, detail_a, detail_b = (int(value) for value in error)
    if code == _WRONG_COUNT:
        raise MalformedTupleError(row, f"the tuple has {detail_a} columns, expected {column_count}")
    if code == _UNKNOWN_KIND:
        raise MalformedTupleError(row, f"unknown column kind {bytes([detail_b])!r} (column {detail_a})")
    if code == _TRUNCATED:
        raise MalformedTupleError(row, f"truncated TupleData: its values need {detail_a} bytes, it has {detail_b}")
    if code == _TRAILING:
        raise MalformedTupleError(row, f"{detail_b - detail_a} bytes follow the tuple's last value")
    return TupleColumns(data_buffer, data, present, kinds, starts, lengths)


def _binary_array(offsets: np.ndarray, out: np.ndarray, valid: np.ndarray) -> pa.Array:
    rows = valid.shape[0]
    nulls = rows - int(np.count_nonzero(valid))
    validity = None if nulls == 0 else pa.py_buffer(np.packbits(valid, bitorder="little"))
    large = offsets[-1] > _INT32_MAX
    arrow_type = pa.large_binary() if large else pa.binary()
    return pa.Array.from_buffers(arrow_type, rows, [validity, pa.py_buffer(offsets if large else offsets.astype(np.int32)),
                                                   pa.py_buffer(out)], null_count=nulls)


@numba.njit(cache=True, nogil=True)
def _failure(row, code, a, b):  # pragma: no cover - compiled
    error = np.empty(4, np.int64)
    error[0], error[1], error[2], error[3] = row, code, a, b
    return error


@numba.njit(cache=True, nogil=True)
def _walk(data, offsets, present, column_count, kinds, starts, lengths):  # pragma: no cover - compiled
    """Fills kinds/starts/lengths row by row; returns (row, code, a, b) of the first malformed row
    (code 0: none)."""
    for row in range(present.shape[0]):
        if not present[row]:
            for column in range(column_count):
                kinds[row, column] = 110  # b"n"
                starts[row, column] = 0
                lengths[row, column] = 0
            continue
        begin, end = offsets[row], offsets[row + 1]
        if end - begin < 2:
            return _failure(row, 1, 0 if end == begin else np.int64(data[begin]) << 8, 0)
        count = (np.int64(data[begin]) << 8) | np.int64(data[begin + 1])
        if count != column_count:
            return _failure(row, 1, count, 0)
        pos = begin + 2
        for column in range(column_count):
            if pos >= end:
                return _failure(row, 3, pos + 1 - begin, end - begin)
            kind = data[pos]
            kinds[row, column] = kind
            if kind == 116 or kind == 98:  # b"t", b"b": Int32 length, then the value
                if pos + 5 > end:
                    return _failure(row, 3, pos + 5 - begin, end - begin)
                length = ((np.int64(data[pos + 1]) << 24) | (np.int64(data[pos + 2]) << 16)
                          | (np.int64(data[pos + 3]) << 8) | np.int64(data[pos + 4]))
                starts[row, column] = pos + 5
                lengths[row, column] = length
                pos += 5 + length
            elif kind == 110 or kind == 117:  # b"n", b"u"
                starts[row, column] = pos + 1
                lengths[row, column] = 0
                pos += 1
            else:
                return _failure(row, 2, column, kind)
        if pos != end:
            return _failure(row, 3 if pos > end else 4, pos - begin, end - begin)
    return _failure(0, 0, 0, 0)


@numba.njit(cache=True, nogil=True)
def _gather_values(data, starts, lengths, kinds, rows, columns):  # pragma: no cover - compiled
    """Binary column parts of `columns` at `rows`: per column its offsets, its bytes (one buffer,
    column i at bases[i]:bases[i + 1]) and validity. Rows are visited in order, all their columns
    at once: the locations of a row lie together."""
    count, width = rows.shape[0], columns.shape[0]
    offsets = np.empty((width, count + 1), np.int64)
    valid = np.empty((width, count), np.bool_)
    offsets[:, 0] = 0
    for i in range(count):
        row = rows[i]
        for j in range(width):
            kind = kinds[row, columns[j]]
            sized = kind == 116 or kind == 98
            valid[j, i] = sized
            offsets[j, i + 1] = offsets[j, i] + (lengths[row, columns[j]] if sized else 0)
    bases = np.zeros(width + 1, np.int64)
    for j in range(width):
        bases[j + 1] = bases[j] + offsets[j, count]
    out = np.empty(bases[width], np.uint8)
    for i in range(count):
        row = rows[i]
        for j in range(width):
            if valid[j, i]:
                start, at = starts[row, columns[j]], bases[j] + offsets[j, i]
                for k in range(offsets[j, i + 1] - offsets[j, i]):
                    out[at + k] = data[start + k]
    return offsets, out, bases, valid


@numba.njit(cache=True, nogil=True)
def _gather_keys(data, starts, lengths, kinds, positions):  # pragma: no cover - compiled
    """Per row, the Int16 count and each key column's kind, length and bytes as sent."""
    count = kinds.shape[0]
    offsets = np.empty(count + 1, np.int64)
    valid = np.empty(count, np.bool_)
    offsets[0] = 0
    for row in range(count):
        size = 2
        ok = True
        for position in positions:
            kind = kinds[row, position]
            if kind != 116 and kind != 98:
                ok = False
                break
            size += 5 + lengths[row, position]
        valid[row] = ok
        offsets[row + 1] = offsets[row] + (size if ok else 0)
    out = np.empty(offsets[count], np.uint8)
    for row in range(count):
        if valid[row]:
            at = offsets[row]
            out[at] = positions.shape[0] >> 8
            out[at + 1] = positions.shape[0] & 0xFF
            at += 2
            for position in positions:
                start = starts[row, position] - 5
                size = 5 + lengths[row, position]
                out[at:at + size] = data[start:start + size]
                at += size
    return offsets, out, valid


@numba.njit(cache=True, nogil=True)
def _unchanged_positions(kinds, rows):  # pragma: no cover - compiled
    """List offsets and the column positions marked b"u", per row at `rows`."""
    count = rows.shape[0]
    offsets = np.zeros(count + 1, np.int64)
    for i in range(count):
        marked = 0
        for column in range(kinds.shape[1]):
            if kinds[rows[i], column] == 117:
                marked += 1
        offsets[i + 1] = offsets[i] + marked
    positions = np.empty(offsets[count], np.int32)
    for i in range(count):
        at = offsets[i]
        for column in range(kinds.shape[1]):
            if kinds[rows[i], column] == 117:
                positions[at] = column
                at += 1
    return offsets, positions
