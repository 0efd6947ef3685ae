"""A change batch's text as the typed columns a ClickHouse table takes."""

from __future__ import annotations

import math
import struct

import pyarrow as pa
import pytest

from siphon_dagster.targets import clickhouse_batch
from siphon_dagster.targets.base import SourceColumn, TableSchema, TargetError, change_batch_schema
from siphon_dagster.targets.type_mapping import BY_OID

TABLE = TableSchema("public", "Odd Table", (
    SourceColumn("id", 20, "bigint", nullable=False, primary_key=True),
    SourceColumn("flag", 16, "boolean"),
    SourceColumn("small", 21, "smallint", nullable=False),
    SourceColumn("f4", 700, "real"),
    SourceColumn("f8", 701, "double precision"),
    SourceColumn("uid", 2950, "uuid", nullable=False),
    SourceColumn("maybe uid", 2950, "uuid"),
    SourceColumn("raw", 17, "bytea"),
    SourceColumn("amount", 1700, "numeric(12,2)"),
    SourceColumn("xid", 28, "xid"),
))


def change_batch(*rows: tuple) -> pa.Table:
    width = len(TABLE.columns)
    columns = [pa.array([row[i] for row in rows], pa.string()) for i in range(width)]
    columns.append(pa.array([row[width] for row in rows], pa.decimal128(38, 0)))
    columns.append(pa.array([row[width + 1] for row in rows], pa.bool_()))
    return pa.Table.from_arrays(columns, schema=change_batch_schema(TABLE))


def test_every_type_of_the_mapping_has_a_conversion_that_keeps_null(monkeypatch: pytest.MonkeyPatch) -> None:
    columns = [SourceColumn("c", oid, "t") for oid in BY_OID]
    columns += [SourceColumn("c", 999_999, "t", category=category) for category in "AERC"]
    columns.append(SourceColumn("c", 999_999, "positive_int", element_type_oid=23))
    for column in columns:
        converted = clickhouse_batch.conversion_for(column)(pa.chunked_array([pa.array([None, "1"], pa.string())]))
        assert converted.null_count == 1 and len(converted) == 2, column
    # A ClickHouse type without a conversion is refused, naming the column.
    monkeypatch.delitem(clickhouse_batch._CONVERSIONS, "Int32")  # noqa: SLF001
    with pytest.raises(TargetError, match=r"column 'c' \(t\): no batch conversion to ClickHouse Int32"):
        clickhouse_batch.conversion_for(SourceColumn("c", 23, "t"))


def test_the_text_becomes_typed_columns_with_the_meta_columns_last() -> None:
    rows = change_batch(
        ("1", "t", "-32768", "3.4028235e+38", "5e-324", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", None, "\\x00ff10",
         "NaN", "4294967295", 2**100, False),
        ("2", None, None, "-Infinity", "NaN", None, None, "\\x", None, None, 7, True),
    )
    typed = clickhouse_batch.plan_for(TABLE).typed(rows, synced_at_us=1_700_000_000_000_000)
    assert typed.column_names == [*TABLE.column_names, "_siphon_version", "_siphon_deleted", "_siphon_synced_at"]
    data = typed.to_pydict()
    assert data["id"] == [1, 2]
    assert typed.schema.field("id").type == pa.int64()
    assert data["flag"] == [True, None]
    assert data["small"] == [-32768, None]  # NULL in a NOT NULL column: the server's default
    assert struct.pack("<f", data["f4"][0]) == struct.pack("<f", 3.4028234663852886e38)
    assert data["f8"][0] == 5e-324 and math.isnan(data["f8"][1])
    assert data["f4"][1] == -math.inf
    assert data["uid"] == ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", clickhouse_batch.NIL_UUID]
    assert data["maybe uid"] == [None, None]
    assert data["raw"] == [b"\x00\xff\x10", b""]
    assert data["amount"] == ["NaN", None]  # numeric is text
    assert data["xid"] == [4294967295, None]
    assert data["_siphon_version"] == [2**100, 7]  # the exact decimal, which the server casts to UInt128
    assert typed.schema.field("_siphon_version").type == pa.decimal128(38, 0)
    assert data["_siphon_deleted"] == [0, 1]
    assert typed.schema.field("_siphon_synced_at").type == pa.timestamp("us", tz="UTC")
    assert [v.timestamp() for v in data["_siphon_synced_at"]] == [1_700_000_000.0, 1_700_000_000.0]


def test_a_value_the_type_does_not_take_names_the_table_and_column() -> None:
    rows = change_batch(("1", "t", "70000", None, None, clickhouse_batch.NIL_UUID, None, None, None, None, 1, False))
    with pytest.raises(TargetError, match=r"public\.Odd Table: column 'small' \(smallint\)"):
        clickhouse_batch.plan_for(TABLE).typed(rows)
