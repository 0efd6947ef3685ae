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
