"""The value rows that predate an added column hold: read from the catalog's one-element array, and
written by each target through the type mapping's conversion."""

from __future__ import annotations

import pytest

from siphon_dagster.source import single_element_text
from siphon_dagster.targets import clickhouse_sql
from siphon_dagster.targets.base import SchemaChange, SourceColumn
from siphon_dagster.targets.clickhouse import ClickHouseTarget


@pytest.mark.parametrize(("array_text", "element"), [
    # attmissingval::text as PostgreSQL 15 prints it, after ADD COLUMN c <type> DEFAULT ...
    ("{7}", "7"),
    ("{t}", "t"),
    ("{NaN}", "NaN"),
    ("{(1,1),(0,0)}", "(1,1),(0,0)"),  # box: its array delimiter is ';', so commas stay unquoted
    ('{"he said \\"hi\\" \\\\ ok"}', 'he said "hi" \\ ok'),
    ('{"2024-01-02 01:04:05+00"}', "2024-01-02 01:04:05+00"),
    ('{"\\\\x0aff"}', "\\x0aff"),  # bytea, hex output
    ('{"{1,NULL,3}"}', "{1,NULL,3}"),  # an int[] column: the element is itself an array
    ('{"{\\"a b\\",\\"c,d\\"}"}', '{"a b","c,d"}'),
    ('{"ab   "}', "ab   "),  # char(5) keeps its padding, as pgoutput and COPY print it
    ('{""}', ""),
    ('{"NULL"}', "NULL"),  # the text NULL, not a NULL: those are never stored as missing values
    ("[0:0]={5}", "5"),
])
def test_the_element_of_a_one_element_array_is_its_text_output(array_text: str, element: str) -> None:
    assert single_element_text(array_text) == element


INT4 = SourceColumn("qty", 23, "integer")
TEXT_NOT_NULL = SourceColumn("label", 25, "text", nullable=False)
BYTEA = SourceColumn("raw", 17, "bytea")


def test_clickhouse_adds_a_nullable_column_whose_default_is_the_converted_text() -> None:
    change = SchemaChange()
    assert ClickHouseTarget._alteration(INT4, None, change, "7") == "ADD COLUMN `qty` Nullable(Int32) DEFAULT toInt32('7')"
    # NOT NULL at the source is still Nullable here: only rows that predate the column take the default.
    assert ClickHouseTarget._alteration(TEXT_NOT_NULL, None, change, "it's \\ here") == (
        "ADD COLUMN `label` Nullable(String) DEFAULT 'it\\'s \\\\ here'")
    assert ClickHouseTarget._alteration(BYTEA, None, change, None) == "ADD COLUMN `raw` Nullable(String)"
    assert change.added_columns == ["qty", "label", "raw"]
    assert clickhouse_sql.backfill_default(BYTEA, "\\x0aff") == " DEFAULT unhex(substring('\\\\x0aff', 3))"
