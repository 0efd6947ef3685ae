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

from siphon_core.wire.byte_copy import copy_bytes
from siphon_core.wire.tuple_data import BINARY, NULL, TEXT, UNCHANGED, TupleDataError

_INT32_MAX = np.iinfo(np.int32).max
# What `_step` says of a column without bytes.
_NULL_VALUE, _UNCHANGED_VALUE = -1, -2
# Error codes of the check.
_WRONG_COUNT, _UNKNOWN_KIND, _TRUNCATED, _TRAILING = 1, 2, 3, 4


class MalformedTupleError(TupleDataError):
    """A row of the column is not a well-formed TupleData; `row` is its index."""

    def __init__(self, row: int, message: str) -> None:
        super().__init__(f"row {row}: {message}")
        self.row = row
        self.detail = message


@dataclass(frozen=True)
class TupleColumns:
    """A column of well-formed TupleData (checked by `split_tuples`), ready to have its values
    copied out. Nothing per value is stored: each pass walks the rows it is asked for again, which
    costs a few nanoseconds a column, far less than writing and reading back a location per value."""

    buffer: pa.Buffer  # the Arrow column's value bytes
    data: np.ndarray  # the same bytes as a NumPy array
    offsets: np.ndarray  # (rows + 1,) int64: where each row's TupleData starts, and the last one ends
    present: np.ndarray  # (rows,) bool: the row has a TupleData (not NULL)
    column_count: int
    # Whether some value is an unchanged TOASTed one: when none is, `unchanged` walks no row.
    has_unchanged: bool = True

    @property
    def row_count(self) -> int:
        return self.present.shape[0]

    def values(self, column: int, rows: np.ndarray | None = None) -> pa.Array:
        """Column `column`'s values (of the rows at indices `rows`, or of all), copied into a binary
        array; NULL where the value is NULL or unchanged TOAST."""
        return self.columns([column], rows)[0]

    def columns(self, columns: Sequence[int], rows: np.ndarray | None = None) -> list[pa.Array]:
        """`values` of several columns, copied in one pass over the rows."""
        slots = np.full(self.column_count, -1, np.int64)  # output slot of each wanted column
        slots[np.asarray(columns, np.int64)] = np.arange(len(columns))
        offsets, out, bases, valid = _gather_values(self.data, self.offsets, self.present, self._rows(rows),
                                                    self.column_count, slots, len(columns))
        return [_binary_array(offsets[i], out[bases[i]:bases[i + 1]], valid[i]) for i in range(len(columns))]

    def unchanged(self, rows: np.ndarray | None = None) -> pa.Array:
        """Per row (at indices `rows`, or all), the positions of unchanged TOASTed values (NULL
        when there are none)."""
        if not self.has_unchanged:
            return pa.nulls(self.row_count if rows is None else len(rows), pa.list_(pa.int32()))
        offsets, positions = _unchanged_positions(self.data, self.offsets, self.present, self._rows(rows),
                                                  self.column_count)
        if positions.shape[0] == 0:
            return pa.nulls(offsets.shape[0] - 1, pa.list_(pa.int32()))
        mask = pa.array(np.diff(offsets) == 0, pa.bool_())
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(positions, pa.int32()),
                                        mask=mask)

    def key(self, positions: list[int]) -> pa.Array:
        """The TupleData of the columns at `positions` per row, as `tuple_data.encode_tuple` writes
        it for text values: the count, then each column's bytes copied as they are. Rows where one
        of them is not a value (NULL, unchanged, absent row) get NULL."""
        if len(set(positions)) != len(positions):
            raise ValueError(f"key positions must be distinct, not {positions}")
        wanted = np.full(self.column_count, -1, np.int64)  # place of each key column in the key
        wanted[np.asarray(positions, np.int64)] = np.arange(len(positions))
        offsets, out, valid = _gather_keys(self.data, self.offsets, self.present, self.column_count, wanted,
                                           len(positions))
        return _binary_array(offsets, out, valid)

    def _rows(self, rows: np.ndarray | None) -> np.ndarray:
        return np.arange(self.row_count, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)


def split_tuples(tuples: pa.Array | pa.ChunkedArray, column_count: int) -> TupleColumns:
    """Checks a binary column of TupleData with `column_count` columns each, and readies it.

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
    row, code, detail_a, detail_b, unchanged = (int(value) for value in _check(data, offsets, present, column_count))
    if code == _WRONG_COUNT:
        raise MalformedTupleError(row, f"the tuple has {detail_a} columns, expected {column_count}")
    if code == _UNKNOWN_KIND:
        raise MalformedTupleError(row, f"unknown column kind {bytes([detail_b])!r} (column {detail_a})")
    if code == _TRUNCATED:
        raise MalformedTupleError(row, f"truncated TupleData: its values need {detail_a} bytes, it has {detail_b}")
    if code == _TRAILING:
        raise MalformedTupleError(row, f"{detail_b - detail_a} bytes follow the tuple's last value")
    return TupleColumns(data_buffer, data, offsets, present, column_count, has_unchanged=unchanged > 0)


def _binary_array(offsets: np.ndarray, out: np.ndarray, valid: np.ndarray) -> pa.Array:
    rows = valid.shape[0]
    nulls = rows - int(np.count_nonzero(valid))
    validity = None if nulls == 0 else pa.py_buffer(np.packbits(valid, bitorder="little"))
    large = offsets[-1] > _INT32_MAX
    arrow_type = pa.large_binary() if large else pa.binary()
    return pa.Array.from_buffers(arrow_type, rows, [validity, pa.py_buffer(offsets if large else offsets.astype(np.int32)),
                                                   pa.py_buffer(out)], null_count=nulls)


# The compiled loops (numba takes the kind bytes, module-level ints, as constants). TEXT and BINARY
# have an Int32 length, then the value; NULL and UNCHANGED no bytes. They run on rows `_check`
# accepted, so they read within each row.


@numba.njit(cache=True, nogil=True)
def _failure(row, code, a, b, unchanged=0):  # pragma: no cover - compiled
    error = np.empty(5, np.int64)
    error[0], error[1], error[2], error[3], error[4] = row, code, a, b, unchanged
    return error


@numba.njit(cache=True, nogil=True)
def _check(data, offsets, present, column_count):  # pragma: no cover - compiled
    """(row, code, a, b, unchanged) of the first malformed row; code 0 when every row is well
    formed, and then `unchanged` counts the unchanged TOASTed values."""
    unchanged = 0
    for row in range(present.shape[0]):
        if not present[row]:
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
            if kind in (TEXT, BINARY):
                if pos + 5 > end:
                    return _failure(row, 3, pos + 5 - begin, end - begin)
                pos += 5 + _length(data, pos)
            elif kind == NULL:
                pos += 1
            elif kind == UNCHANGED:
                pos += 1
                unchanged += 1
            else:
                return _failure(row, 2, column, kind)
        if pos != end:
            return _failure(row, 3 if pos > end else 4, pos - begin, end - begin)
    return _failure(0, 0, 0, 0, unchanged)


@numba.njit(cache=True, nogil=True, inline="always")
def _length(data, pos):  # pragma: no cover - compiled
    return ((np.int64(data[pos + 1]) << 24) | (np.int64(data[pos + 2]) << 16)
            | (np.int64(data[pos + 3]) << 8) | np.int64(data[pos + 4]))


@numba.njit(cache=True, nogil=True, inline="always")
def _step(data, pos):  # pragma: no cover - compiled
    """(length of the value at `pos`, or _NULL_VALUE / _UNCHANGED_VALUE; where the next column starts)."""
    kind = data[pos]
    if kind in (TEXT, BINARY):
        length = _length(data, pos)
        return length, pos + 5 + length
    return (_UNCHANGED_VALUE if kind == UNCHANGED else _NULL_VALUE), pos + 1


@numba.njit(cache=True, nogil=True)
def _gather_values(data, offsets, present, rows, column_count, slots, width):  # pragma: no cover - compiled
    """Binary column parts of the columns with a slot (>= 0) at `rows`: per slot its offsets, its
    bytes (one buffer, slot i at bases[i]:bases[i + 1]) and validity. Each row is walked twice, to
    size the output and then to copy, reading the tuples in order both times."""
    count = rows.shape[0]
    sizes = np.zeros((width, count + 1), np.int64)  # becomes the offsets
    valid = np.zeros((width, count), np.bool_)
    for i in range(count):
        if present[rows[i]]:
            pos = offsets[rows[i]] + 2
            for column in range(column_count):
                length, following = _step(data, pos)
                if slots[column] >= 0 and length >= 0:
                    valid[slots[column], i] = True
                    sizes[slots[column], i + 1] = length
                pos = following
    bases = np.zeros(width + 1, np.int64)
    for j in range(width):
        for i in range(count):
            sizes[j, i + 1] += sizes[j, i]
        bases[j + 1] = bases[j] + sizes[j, count]
    out = np.empty(bases[width], np.uint8)
    for i in range(count):
        if present[rows[i]]:
            pos = offsets[rows[i]] + 2
            for column in range(column_count):
                length, following = _step(data, pos)
                if slots[column] >= 0 and length > 0:
                    copy_bytes(out, bases[slots[column]] + sizes[slots[column], i], data, pos + 5, length)
                pos = following
    return sizes, out, bases, valid


@numba.njit(cache=True, nogil=True)
def _gather_keys(data, offsets, present, column_count, wanted, width):  # pragma: no cover - compiled
    """Per row, the Int16 count and each wanted column's kind, length and bytes as sent."""
    count = present.shape[0]
    spans = np.zeros((count, width, 2), np.int64)  # (start, size) of each key column's bytes as sent
    sizes = np.zeros(count + 1, np.int64)
    valid = np.zeros(count, np.bool_)
    for row in range(count):
        if not present[row]:
            continue
        pos = offsets[row] + 2
        found = 0
        ok = True
        for column in range(column_count):
            length, following = _step(data, pos)
            if wanted[column] >= 0:
                if length < 0:
                    ok = False
                    break
                spans[row, wanted[column], 0] = pos
                spans[row, wanted[column], 1] = following - pos
                found += 1
                if found == width:
                    break
            pos = following
        if ok:
            valid[row] = True
            size = 2
            for j in range(width):
                size += spans[row, j, 1]
            sizes[row + 1] = size
    for row in range(count):
        sizes[row + 1] += sizes[row]
    out = np.empty(sizes[count], np.uint8)
    for row in range(count):
        if valid[row]:
            at = sizes[row]
            out[at] = width >> 8
            out[at + 1] = width & 0xFF
            at += 2
            for j in range(width):
                copy_bytes(out, at, data, spans[row, j, 0], spans[row, j, 1])
                at += spans[row, j, 1]
    return sizes, out, valid


@numba.njit(cache=True, nogil=True)
def _unchanged_positions(data, offsets, present, rows, column_count):  # pragma: no cover - compiled
    """List offsets and the column positions marked b"u", per row at `rows` (two walks: count, fill)."""
    count = rows.shape[0]
    ends = np.zeros(count + 1, np.int64)
    for i in range(count):
        ends[i + 1] = ends[i] + _walk_unchanged(data, offsets, present, rows[i], column_count, ends, -1)
    marks = np.empty(ends[count], np.int32)
    if ends[count]:
        for i in range(count):
            _walk_unchanged(data, offsets, present, rows[i], column_count, marks, ends[i])
    return ends, marks


@numba.njit(cache=True, nogil=True, inline="always")
def _walk_unchanged(data, offsets, present, row, column_count, out, at):  # pragma: no cover - compiled
    """Counts the b"u" columns of `row`; writes their positions to out[at:] unless `at` < 0."""
    found = 0
    if present[row]:
        pos = offsets[row] + 2
        for column in range(column_count):
            length, pos = _step(data, pos)
            if length == _UNCHANGED_VALUE:
                if at >= 0:
                    out[at + found] = column
                found += 1
    return found
