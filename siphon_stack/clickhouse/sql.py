"""Just enough of ClickHouse's lexer to do what its HTTP handler does around the parser: find where
the SQL of an INSERT ends and its inline data begins, and which output format a query asks for.

The text is scanned as bytes because an INSERT body carries binary data after its SQL; scanning is
lazy and stops at the data, so a large body is never tokenized.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache, wraps
from typing import TypeVar

_WORD = re.compile(rb"[A-Za-z0-9_$\x80-\xff]+")
_SPACE = re.compile(rb"[ \t\n\r\f\v]+")
_QUOTES = b"'\"`"
_OPENING = b"([{"
_CLOSING = b")]}"
# Statements whose answers below are remembered: a batch writer sends the same few INSERT and
# query texts again and again, and scanning them cost the server more than its HTTP handling. A
# long text (a key list, a large query) is scanned each time rather than kept.
CACHED_STATEMENTS = 1024
CACHED_STATEMENT_BYTES = 16 << 10

_Answer = TypeVar("_Answer")


def _remembered(scan: Callable[[bytes], _Answer]) -> Callable[[bytes], _Answer]:
    cached = lru_cache(maxsize=CACHED_STATEMENTS)(scan)

    @wraps(scan)
    def answer(sql: bytes) -> _Answer:
        return cached(sql) if len(sql) <= CACHED_STATEMENT_BYTES else scan(sql)

    return answer



@dataclass(frozen=True)
class Token:
    kind: str  # "word", "quoted" or "punct"
    start: int
    end: int
    depth: int  # bracket nesting level; clauses such as FORMAT only count at level 0

    def upper(self, sql: bytes) -> str:
        return sql[self.start : self.end].decode("utf-8", "replace").upper()


@dataclass(frozen=True)
class InlineInsert:
    """An INSERT whose data follows its SQL: `statement` is the INSERT without the FORMAT (or
    VALUES) clause, as chdb's streaming insert wants it."""

    statement: str
    format: str
    data_start: int
    via_select: bool  # INSERT ... SELECT ... FROM input() FORMAT x


def tokens(sql: bytes, complete: bool = True) -> Iterator[Token]:
    """Tokens outside comments. With complete=False the text is a prefix of a longer body, so a
    token that touches its end may continue beyond it and is not yielded."""
    pos, depth, size = 0, 0, len(sql)
    while pos < size:
        space = _SPACE.match(sql, pos)
        if space:
            pos = space.end()
            continue
        end, kind = _token_end(sql, pos)
        if end < 0 or (not complete and end >= size):
            return
        bracket = sql[pos] if kind == "punct" else 0
        if bracket in _CLOSING:
            depth = max(depth - 1, 0)
        yield Token(kind, pos, end, depth)
        if bracket in _OPENING:
            depth += 1
        pos = end


def _token_end(sql: bytes, pos: int) -> tuple[int, str]:
    """End of the token or comment at pos, or -1 when it is not terminated within the text."""
    if sql.startswith(b"--", pos):
        newline = sql.find(b"\n", pos)
        return (newline if newline >= 0 else len(sql)), "comment"
    if sql.startswith(b"/*", pos):
        close = sql.find(b"*/", pos + 2)
        return (close + 2 if close >= 0 else -1), "comment"
    if sql[pos] in _QUOTES:
        return _quoted_end(sql, pos), "quoted"
    word = _WORD.match(sql, pos)
    if word:
        return word.end(), "word"
    return pos + 1, "punct"


def _quoted_end(sql: bytes, pos: int) -> int:
    quote, i = sql[pos], pos + 1
    while i < len(sql):
        if sql[i] == 0x5C:  # a backslash escapes the next byte
            i += 2
        elif sql[i] == quote:
            if i + 1 < len(sql) and sql[i + 1] == quote:  # a doubled quote stands for itself
                i += 2
            else:
                return i + 1
        else:
            i += 1
    return -1


def _code(stream: Iterator[Token]) -> Iterator[Token]:
    return (token for token in stream if token.kind != "comment")


@_remembered
def leading_keyword(sql: bytes) -> str:
    """The statement's first keyword (upper case), "(" for a parenthesised query, "" for none."""
    first = next(_code(tokens(sql)), None)
    return first.upper(sql) if first else ""


@_remembered
def query_inline_insert(query: bytes) -> InlineInsert | None:
    """`find_inline_insert` of a request whose `query` parameter holds the whole INSERT up to its
    FORMAT name, the data all in the body: the same answer whatever the body, so it is remembered
    per query text. None when the query alone does not end where the data starts."""
    inline = find_inline_insert(query + b"\n", complete=True)
    return inline if inline is not None and inline.data_start == len(query) + 1 else None


def find_inline_insert(sql: bytes, complete: bool) -> InlineInsert | None:
    """Where an INSERT's inline data starts, per ClickHouse's parser: after `VALUES`, or after
    `FORMAT name`, the spaces that follow it and at most one line break."""
    stream = _code(tokens(sql, complete))
    first = next(stream, None)
    if first is None or first.upper(sql) != "INSERT":
        return None
    previous, via_select = first, False
    for token in stream:
        if _is_keyword(sql, previous, "FORMAT") and token.kind != "punct":
            data_start = _data_start(sql, token.end)
            if not complete and data_start >= len(sql):
                return None
            statement = sql[: previous.start].decode("utf-8", "replace")
            return InlineInsert(statement, _unquote(sql[token.start : token.end]), data_start, via_select)
        if _is_keyword(sql, token, "VALUES") and not via_select and previous.upper(sql) not in ("INTO", "TABLE", "."):
            return InlineInsert(sql[: token.start].decode("utf-8", "replace"), "Values", token.end, False)
        if _is_keyword(sql, token, "SELECT") or _is_keyword(sql, token, "WITH"):
            via_select = True
        if _is_keyword(sql, token, "INFILE"):
            return None
        previous = token
    return None


def _is_keyword(sql: bytes, token: Token, keyword: str) -> bool:
    return token.kind == "word" and token.depth == 0 and token.upper(sql) == keyword


def _data_start(sql: bytes, pos: int) -> int:
    while pos < len(sql) and sql[pos] in b" \t\f":
        pos += 1
    if sql.startswith(b"\r", pos):
        pos += 1
    if sql.startswith(b"\n", pos):
        pos += 1
    return pos


def _unquote(name: bytes) -> str:
    text = name.decode("utf-8", "replace")
    return text[1:-1] if text[:1] in ('"', "`") else text


@_remembered
def client_file_clause(sql: bytes) -> str | None:
    """"INFILE" or "OUTFILE" when the statement reads or writes a file on the client's side
    (`FROM INFILE`, `INTO OUTFILE`): only ClickHouse's own clients handle those."""
    previous: Token | None = None
    for token in _code(tokens(sql)):
        if previous is not None:
            if _is_keyword(sql, previous, "FROM") and _is_keyword(sql, token, "INFILE"):
                return "INFILE"
            if _is_keyword(sql, previous, "INTO") and _is_keyword(sql, token, "OUTFILE"):
                return "OUTFILE"
        previous = token
    return None


@_remembered
def output_format(sql: bytes) -> str | None:
    """The name in a trailing `FORMAT name [SETTINGS ...] [;]` clause of a query, if any."""
    found: str | None = None
    stream = list(_code(tokens(sql)))
    for i, token in enumerate(stream[:-1]):
        if not _is_keyword(sql, token, "FORMAT"):
            continue
        name, rest = stream[i + 1], stream[i + 2 : i + 3]
        if name.kind != "punct" and (not rest or _ends_query(sql, rest[0])):
            found = _unquote(sql[name.start : name.end])
    return found


def _ends_query(sql: bytes, token: Token) -> bool:
    return token.depth == 0 and (sql[token.start : token.end] == b";" or token.upper(sql) == "SETTINGS")
