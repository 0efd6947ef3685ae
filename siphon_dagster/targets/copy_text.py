"""Reads PostgreSQL's COPY text format incrementally (for targets that take rows, not a byte stream).

One row per line, fields separated by tabs, `\\N` for NULL, and backslash escapes: COPY TO writes
`\\b \\f \\n \\r \\t \\v \\\\`; COPY FROM also accepts `\\ooo` octal and `\\xhh` hex, read here too. A raw
newline only ever ends a row (a newline inside a value is written `\\n`), so rows split on it even
when a chunk boundary falls inside a row.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

_ESCAPE = re.compile(rb"\\(?:([0-7]{1,3})|x([0-9A-Fa-f]{1,2})|(.))", re.DOTALL)
_SIMPLE = {b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t", b"v": b"\v"}


def _unescape(match: re.Match[bytes]) -> bytes:
    octal, hexadecimal, other = match.groups()
    if octal is not None:
        return bytes([int(octal, 8) & 0xFF])
    if hexadecimal is not None:
        return bytes([int(hexadecimal, 16)])
    return _SIMPLE.get(other, other)


def parse_line(line: bytes) -> list[str | None]:
    return [None if field == b"\\N" else _ESCAPE.sub(_unescape, field).decode() for field in line.split(b"\t")]


def iter_copy_rows(chunks: Iterable[bytes]) -> Iterator[list[str | None]]:
    """Rows of COPY text as lists of values (None for NULL); holds at most one chunk plus one row."""
    pending = bytearray()
    for chunk in chunks:
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            yield parse_line(bytes(pending[start:end]))
            start = end + 1
        del pending[:start]
    if pending:
        yield parse_line(bytes(pending))
