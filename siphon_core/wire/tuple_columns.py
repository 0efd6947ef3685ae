"""Many TupleData at once: a column of TupleData (one per row) split into one Arrow column per
table column, with NumPy stepping over all rows together instead of Python over every value.

Consumers decode tens of thousands of rows per micro-batch; `tuple_data.decode_tuple` costs a few
microseconds per row of 30 columns, this about a tenth of that. The walk goes column by column: the
kind byte of column j of every row is read at once, then every length, then every row's offset
moves past its value. The layout is the one `tuple_data` describes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from siphon_core.wire.tuple_data import TupleDataError

TEXT, BINARY, NULL, UNCHANGED = b"tbnu"
_KNOWN_KINDS = np.array([TEXT, BINARY, NULL, UNCHANGED], np.uint8)
# Values at least this long are copied one by one: a vectorized gather builds an 8-byte index per
# byte, which a single large TOASTed value would make a large temporary.
_LONG_VALUE = 1 << 16
_SLACK = 16


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
    words: np.ndarray  # the little-endian uint32 starting at each byte offset (an overlapping view)
    present: np.ndarray  # (rows,) bool: the row has a TupleData (not NULL)
    kinds: np.ndarray  # (columns, rows) uint8: b't', b'b', b'n' or b'u' (b'n' for absent rows)
    starts: np.ndarray  # (columns, rows) int64: offset of each value's first byte
    lengths: np.ndarray  # (columns, rows) int64: 0 unless the kind is b't' or b'b'

    @property
    def row_count(self) -> int:
        return self.present.shape[0]

    def sized(self, column: int) -> np.ndarray:
        kinds = self.kinds[column]
        return (kinds == TEXT) | (kinds == BINARY)

    def values(self, column: int) -> pa.Array:
        """Column `column`'s values as binary views into the tuples' buffer (no value is copied),
        NULL where the value is NULL or unchanged TOAST."""
        valid = self.sized(column)
        lengths = np.where(valid, self.lengths[column], 0)
        starts = self.starts[column]
        rows = self.row_count
        # Arrow's view layout, 16 bytes a value: int32 length, then up to 12 bytes inline, or a
        # 4-byte prefix, the data buffer's index (0) and the int32 offset of the value. The inline
        # bytes are read as three little-endian words per value, masked past the value's end.
        views = np.empty((rows, 4), np.uint32)
        views[:, 0] = lengths
        limit = self.words.shape[0] - 1
        for word in range(3):
            keep = np.clip(lengths - 4 * word, 0, 4)
            mask = ((np.uint64(1) << (keep.astype(np.uint64) * np.uint64(8))) - np.uint64(1)).astype(np.uint32)
            views[:, 1 + word] = self.words[np.minimum(starts + 4 * word, limit)] & mask
        long_values = lengths > 12
        views[long_values, 1] = self.words[np.minimum(starts[long_values], limit)]
        views[long_values, 2] = 0
        views[long_values, 3] = starts[long_values]
        validity = None if valid.all() else pa.array(valid, pa.bool_()).buffers()[1]
        return pa.Array.from_buffers(pa.binary_view(), rows, [validity, pa.py_buffer(views), self.buffer],
                                     null_count=int(rows - valid.sum()))

    def unchanged(self) -> pa.Array:
        """Per row, the positions of unchanged TOASTed values (NULL when there are none)."""
        marked = self.kinds == UNCHANGED
        lists: list[list[int] | None] = [None] * self.row_count
        for row in np.flatnonzero(marked.any(axis=0)).tolist():
            lists[row] = np.flatnonzero(marked[:, row]).tolist()
        return pa.array(lists, pa.list_(pa.int32()))

    def key(self, positions: list[int]) -> pa.Array:
        """The TupleData of the columns at `positions` per row, as `tuple_data.encode_tuple` writes
        it for text values: the count, then each column's bytes copied as they are. Rows where one
        of them is not a value (NULL, unchanged, absent row) get NULL."""
        valid = self.present.copy()
        for position in positions:
            valid &= self.sized(position)
        header = np.frombuffer(len(positions).to_bytes(2, "big"), np.uint8)
        parts = [(np.full(self.row_count, 0, np.int64), np.where(valid, 2, 0), header)]
        for position in positions:  # a value's bytes start 5 bytes after its kind byte
            length = np.where(valid, self.lengths[position] + 5, 0)
            parts.append((self.starts[position] - 5, length, self.data))
        return _concatenate_parts(parts, valid)


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
    size = 0 if data_buffer is None else data_buffer.size
    if size > np.iinfo(np.int32).max:
        raise TupleDataError(f"{size} bytes of tuples in one column; at most 2 GiB fit")
    # One copy with zeroed slack, so a word read at any value's offset stays inside the buffer.
    data = np.zeros(size + _SLACK, np.uint8)
    if size:
        data[:size] = np.frombuffer(data_buffer, np.uint8)
    data_buffer = pa.py_buffer(data)
    words = np.ndarray((data.shape[0] - 3,), "<u4", data, strides=(1,))
    present = tuples.is_valid().to_numpy(zero_copy_only=False) if tuples.null_count else np.ones(rows, bool)
    begin, end = offsets[:-1], offsets[1:]
    last = data.shape[0] - 1
    lengths_at = np.ndarray((data.shape[0] - 3,), ">u4", data, strides=(1,))  # big-endian Int32 at any offset
    last_word = lengths_at.shape[0] - 1

    count = (data[np.minimum(begin, last)].astype(np.int64) << 8) | data[np.minimum(begin + 1, last)]
    wrong_count = present & ((end - begin < 2) | (count != column_count))
    if wrong_count.any():
        row = int(np.flatnonzero(wrong_count)[0])
        raise MalformedTupleError(row, f"the tuple has {int(count[row])} columns, expected {column_count}")

    kinds = np.empty((column_count, rows), np.uint8)
    starts = np.empty((column_count, rows), np.int64)
    lengths = np.empty((column_count, rows), np.int64)
    pos = begin + 2
    absent = ~present
    for column in range(column_count):
        # Positions are clipped: a malformed row reads garbage here and is reported below.
        kind = data[np.minimum(pos, last)]
        if rows and absent.any():
            kind[absent] = NULL
        sized = (kind == TEXT) | (kind == BINARY)
        length = lengths_at[np.minimum(pos + 1, last_word)].astype(np.int64)
        length[~sized] = 0
        kinds[column], starts[column], lengths[column] = kind, pos + 5, length
        pos = pos + 1 + (length + 4) * sized
    unknown = present & ~np.isin(kinds, _KNOWN_KINDS).all(axis=0)
    if unknown.any():
        row = int(np.flatnonzero(unknown)[0])
        column = int(np.flatnonzero(~np.isin(kinds[:, row], _KNOWN_KINDS))[0])
        raise MalformedTupleError(row, f"unknown column kind {bytes([kinds[column, row]])!r} (column {column})")
    wrong_end = present & (pos != end)
    if wrong_end.any():
        row = int(np.flatnonzero(wrong_end)[0])
        needed, held = int(pos[row] - begin[row]), int(end[row] - begin[row])
        if needed > held:
            raise MalformedTupleError(row, f"truncated TupleData: its values need {needed} bytes, it has {held}")
        raise MalformedTupleError(row, f"{held - needed} bytes follow the tuple's last value")
    return TupleColumns(data_buffer, data, words, present, kinds, starts, lengths)


def _concatenate_parts(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], valid: np.ndarray) -> pa.Array:
    """A binary array whose row i is the concatenation, over `parts`, of source[start[i]:start[i]+length[i]]."""
    rows = valid.shape[0]
    row_lengths = np.zeros(rows, np.int64)
    for _, length, _ in parts:
        row_lengths += length
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(row_lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), np.uint8)
    at = offsets[:-1].copy()  # where each row's next part goes
    for start, length, source in parts:
        long_rows = length >= _LONG_VALUE
        short = np.flatnonzero((length > 0) & ~long_rows)
        if short.size:
            part_lengths = length[short]
            total = int(part_lengths.sum())
            # For every byte to copy: its output offset minus its source offset is constant per row.
            shift = np.repeat(at[short] - start[short], part_lengths)
            targets = np.arange(total, dtype=np.int64)
            targets += np.repeat(at[short] - np.cumsum(part_lengths) + part_lengths, part_lengths)
            out[targets] = source[targets - shift]
        for row in np.flatnonzero(long_rows).tolist():
            begin, size, to = int(start[row]), int(length[row]), int(at[row])
            out[to:to + size] = source[begin:begin + size]
        at += length
    large = offsets[-1] > np.iinfo(np.int32).max
    arrow_type = pa.large_binary() if large else pa.binary()
    validity = None if valid.all() else pa.array(valid, pa.bool_()).buffers()[1]
    return pa.Array.from_buffers(arrow_type, rows, [validity, pa.py_buffer(offsets if large else offsets.astype(np.int32)),
                                                   pa.py_buffer(out)], null_count=int(rows - valid.sum()))
