"""The embedded server's reading of an INSERT: the remembered answer for a query parameter is the
one a scan of the whole request gives."""

from __future__ import annotations

import pytest

from siphon_stack.clickhouse.sql import find_inline_insert, output_format, query_inline_insert


@pytest.mark.parametrize("query", [
    "INSERT INTO db.t (a, `b c`) FORMAT Arrow",
    "INSERT INTO db.t FORMAT TabSeparated  ",
    "insert into \"db\".\"t\" (x) format \"ArrowStream\"",
    "INSERT INTO t /* FORMAT Native */ (a) FORMAT CSV",
])
@pytest.mark.parametrize("body", [b"", b"1\t2\n", b"\nFORMAT x\n", b"\x00\xff binary"])
def test_a_remembered_query_reads_as_the_whole_request_does(query: str, body: bytes) -> None:
    text = query.encode() + b"\n" + body
    scanned = find_inline_insert(text, complete=True)
    remembered = query_inline_insert(query.encode())
    assert remembered is not None and scanned is not None
    assert (remembered.statement, remembered.format, remembered.data_start) == \
        (scanned.statement, scanned.format, scanned.data_start)


@pytest.mark.parametrize("query", [
    "INSERT INTO t VALUES (1)",            # the data is in the query itself
    "INSERT INTO t FORMAT TSV 1\t2",        # the same after FORMAT
    "INSERT INTO t FORMAT TSV\n",           # the query's own line break ends the SQL
    "INSERT INTO t",                        # FORMAT (or VALUES) comes in the body
    "SELECT 1 FORMAT JSON",
])
def test_a_query_that_does_not_end_where_the_data_starts_is_scanned_with_its_body(query: str) -> None:
    assert query_inline_insert(query.encode()) is None


def test_remembered_answers_stay_right_for_long_and_repeated_texts() -> None:
    long = b"SELECT " + b", ".join(b"%d" % i for i in range(10_000)) + b" FORMAT JSONEachRow"
    assert output_format(long) == "JSONEachRow"
    assert output_format(b"SELECT 1 FORMAT CSV") == output_format(b"SELECT 1 FORMAT CSV") == "CSV"


@pytest.mark.parametrize(("body", "taken"), [
    (b"INSERT INTO t (a, b) FORMAT ArrowStream\n\xff\x00\n\x01", True),   # the statement's own line
    (b"INSERT INTO t (`a\nb`) FORMAT CSV\n1", False),                     # a line break inside a quoted name
    (b"INSERT INTO t /* a\n comment */ FORMAT CSV\n1", False),             # ... inside a comment
    (b"INSERT INTO t -- FORMAT CSV\nFORMAT TSV\n1", False),               # a comment to the end of the line
    (b"INSERT INTO t FORMAT CSV 1,2\n3,4\n", False),                      # data on the statement's line
    (b"INSERT INTO t VALUES (1)\n", False),
    (b"INSERT INTO t\nFORMAT CSV\n1", False),
])
def test_a_bodys_first_line_is_its_statement_only_when_a_scan_of_the_body_agrees(body: bytes, taken: bool) -> None:
    # The server takes a body's first line as its statement (a remembered answer) when that line
    # alone is a whole INSERT ending where the data starts; otherwise it scans the body.
    scanned = find_inline_insert(body, complete=True)
    first_line = query_inline_insert(body[: body.find(b"\n")])
    assert scanned is not None
    assert (first_line is not None) == taken
    if first_line is not None:
        assert (first_line.statement, first_line.format, first_line.data_start) == \
            (scanned.statement, scanned.format, scanned.data_start)
