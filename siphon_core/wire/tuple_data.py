"""PostgreSQL's logical replication TupleData layout, the value encoding of `Row.tuple`.

    Int16   number of columns, then per column one of
    Byte1('n')                          NULL
    Byte1('u')                          unchanged TOASTed value (not sent)
    Byte1('t') Int32 length, Byte(n)    value in the type's text output format
    Byte1('b') Int32 length, Byte(n)    value in the type's binary format

Integers are big-endian. Text values stay undecoded bytes: the producer passes pgoutput's bytes
through, and a SQL_ASCII database may send text that is not UTF-8. Decoding does not tell 't' from
'b' apart; Siphon never asks pgoutput for binary values.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final, TypeAlias

_COUNT = struct.Struct(">H")
_LENGTH = struct.Struct(">I")
_unpack_count = _COUNT.unpack_from
_unpack_length = _LENGTH.unpack_from
_pack_count = _COUNT.pack
_pack_length = _LENGTH.pack

# The column kinds, as bytes values.
TEXT, BINARY, NULL, UNCHANGED = b"tbnu"
_SIZED = (TEXT, BINARY)
_SINGLE = (NULL, UNCHANGED)


class TupleDataError(ValueError):
    """The bytes are not a well-formed TupleData; the message says where."""


class _UnchangedToast:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"

    def __reduce__(self) -> str:
        return "UNCHANGED_TOAST"  # pickles (e.g. to Spark executors) as the same singleton


UNCHANGED_TOAST: Final = _UnchangedToast()
"""An unchanged TOASTed value that PostgreSQL did not send: keep the stored value."""

Value: TypeAlias = bytes | None | _UnchangedToast
Buffer: TypeAlias = bytes | bytearray | memoryview


def decode_tuple(data: Buffer, offset: int = 0) -> tuple[list[Value], int]:
    """The values of the tuple starting at `offset`, and the offset just past it."""
    if not isinstance(data, bytes):
        data = bytes(data)  # one copy, so each value below is a bytes slice, not a view
    # Locals, not globals, in the loop: this is the consumers' hottest code.
    text, null, unchanged, binary, unpack_length = TEXT, NULL, UNCHANGED, BINARY, _unpack_length
    try:
        (count,) = _unpack_count(data, offset)
        pos = offset + 2
        values: list[Value] = [None] * count
        for index in range(count):
            kind = data[pos]
            # Ordered by frequency; the loop makes no object beyond the value itself.
            if kind == text:
                (length,) = unpack_length(data, pos + 1)
                pos += 5
                values[index] = data[pos : pos + length]
                pos += length
            elif kind == null:
                pos += 1
            elif kind == unchanged:
                values[index] = UNCHANGED_TOAST
                pos += 1
            elif kind == binary:
                (length,) = unpack_length(data, pos + 1)
                pos += 5
                values[index] = data[pos : pos + length]
                pos += length
            else:
                raise TupleDataError(f"unknown column kind {bytes([kind])!r} at offset {pos} (column {index})")
    except (IndexError, struct.error):
        raise _truncated(data, offset) from None
    if pos > len(data):
        raise _truncated(data, offset)
    return values, pos


def tuple_end(data: Buffer, offset: int = 0) -> int:
    """The offset just past the tuple starting at `offset`, reading only kinds and lengths."""
    sized, single, unpack_length = _SIZED, _SINGLE, _unpack_length
    try:
        (count,) = _unpack_count(data, offset)
        pos = offset + 2
        for index in range(count):
            kind = data[pos]
            if kind in sized:
                pos += 5 + unpack_length(data, pos + 1)[0]
            elif kind in single:
                pos += 1
            else:
                raise TupleDataError(f"unknown column kind {bytes([kind])!r} at offset {pos} (column {index})")
    except (IndexError, struct.error):
        raise _truncated(data, offset) from None
    if pos > len(data):
        raise _truncated(data, offset)
    return pos


def encode_tuple(values: Sequence[bytes | str | None | _UnchangedToast]) -> bytes:
    """A TupleData of text values; `str` values are encoded as UTF-8."""
    parts = [_pack_count(len(values))]
    append = parts.append
    for value in values:
        if value is None:
            append(b"n")
        elif value is UNCHANGED_TOAST:
            append(b"u")
        else:
            raw = value.encode() if isinstance(value, str) else bytes(value)  # type: ignore[union-attr, arg-type]
            append(b"t" + _pack_length(len(raw)))
            append(raw)
    return b"".join(parts)


def project_tuple(data: Buffer, keep_indexes: Sequence[int]) -> bytes:
    """The tuple (starting at offset 0) with only the columns at `keep_indexes`, in that order."""
    bounds = _column_bounds(data)
    parts = [_pack_count(len(keep_indexes))]
    # Runs of adjacent columns are copied as one slice: dropping a few columns costs a few slices.
    run_start = run_end = -1
    for index in keep_indexes:
        if not 0 <= index < len(bounds) - 1:
            raise TupleDataError(f"column index {index} is out of range for a tuple of {len(bounds) - 1} columns")
        if index == run_end:
            run_end += 1
            continue
        if run_start >= 0:
            parts.append(data[bounds[run_start] : bounds[run_end]])
        run_start, run_end = index, index + 1
    if run_start >= 0:
        parts.append(data[bounds[run_start] : bounds[run_end]])
    return b"".join(parts)


def _column_bounds(data: Buffer) -> list[int]:
    """Start offsets of every column, then the end of the tuple."""
    sized, single, unpack_length = _SIZED, _SINGLE, _unpack_length
    try:
        (count,) = _unpack_count(data, 0)
        pos = 2
        bounds = [0] * (count + 1)
        for index in range(count):
            bounds[index] = pos
            kind = data[pos]
            if kind in sized:
                pos += 5 + unpack_length(data, pos + 1)[0]
            elif kind in single:
                pos += 1
            else:
                raise TupleDataError(f"unknown column kind {bytes([kind])!r} at offset {pos} (column {index})")
    except (IndexError, struct.error):
        raise _truncated(data, 0) from None
    if pos > len(data):
        raise _truncated(data, 0)
    bounds[count] = pos
    return bounds


def _truncated(data: Buffer, offset: int) -> TupleDataError:
    return TupleDataError(f"truncated TupleData: the tuple starting at offset {offset} runs past the end of "
                          f"the {len(data)}-byte buffer")
