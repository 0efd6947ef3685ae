"""The type mapping table: total over PostgreSQL's built-in types, faithful, and documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from siphon_dagster.targets.base import SourceColumn
from siphon_dagster.targets.type_mapping import (
    ARRAY,
    ARRAY_OIDS,
    BUILTIN_TYPES,
    COMPOSITE,
    ENUM,
    RANGE,
    clickhouse_type,
    mapping_document,
    mapping_for,
    mapping_markdown,
    snowflake_type,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "type-mapping.md"

# Every type the design and the PostgreSQL manual's data type chapter name.
REQUIRED = {
    "bool", "bytea", "char", "name", "int2", "int4", "int8", "oid", "text", "varchar", "bpchar", "json", "jsonb",
    "xml", "float4", "float8", "numeric", "money", "date", "time", "timetz", "timestamp", "timestamptz", "interval",
    "uuid", "inet", "cidr", "macaddr", "macaddr8", "bit", "varbit", "tsvector", "tsquery", "point", "line", "lseg",
    "box", "path", "polygon", "circle", "pg_lsn", "xid", "xid8", "cid", "tid", "int4range", "int8range", "numrange",
    "tsrange", "tstzrange", "daterange", "int4multirange", "jsonpath", "regclass", "pg_snapshot",
}  # fmt: skip


def column(type_oid: int, type_name: str = "t", *, nullable: bool = True, key: bool = False, category: str = "", element: int = 0) -> SourceColumn:
    return SourceColumn("c", type_oid, type_name, nullable=nullable and not key, primary_key=key, category=category, element_type_oid=element)


def test_the_list_holds_every_builtin_type_once() -> None:
    names = [name for _, name, _ in BUILTIN_TYPES]
    oids = [oid for oid, _, _ in BUILTIN_TYPES] + [array for _, _, array in BUILTIN_TYPES if array]
    assert not REQUIRED - set(names)
    assert len(names) == len(set(names))
    assert len(oids) == len(set(oids))


@pytest.mark.parametrize(("oid", "name", "array_oid"), BUILTIN_TYPES, ids=[name for _, name, _ in BUILTIN_TYPES])
def test_every_builtin_type_and_its_array_map_in_both_targets(oid: int, name: str, array_oid: int) -> None:
    mapping = mapping_for(column(oid, name))
    for target in (mapping.clickhouse, mapping.snowflake):
        assert target.type
        if target.native:
            assert "{0}" in target.from_text and "{0}" in target.to_text
        else:
            assert target.convert("x") == "x" and target.render("c") == "c"
    assert mapping.why
    if array_oid:
        assert array_oid in ARRAY_OIDS
        assert mapping_for(column(array_oid, f"{name}[]", category="A", element=oid)) is ARRAY


@pytest.mark.parametrize(
    ("oid", "type_name", "clickhouse", "snowflake"),
    [
        (16, "boolean", "Bool", "BOOLEAN"),
        (21, "smallint", "Int16", "NUMBER(5,0)"),
        (23, "integer", "Int32", "NUMBER(10,0)"),
        (20, "bigint", "Int64", "NUMBER(19,0)"),
        (26, "oid", "UInt32", "NUMBER(10,0)"),
        (5069, "xid8", "UInt64", "NUMBER(20,0)"),
        (700, "real", "Float32", "VARCHAR"),
        (701, "double precision", "Float64", "VARCHAR"),
        (2950, "uuid", "UUID", "VARCHAR"),
        (17, "bytea", "String", "BINARY"),
        # NaN is legal in every numeric, typmod or not: never Decimal / NUMBER.
        (1700, "numeric", "String", "VARCHAR"),
        (1700, "numeric(10,2)", "String", "VARCHAR"),
        (1700, "numeric(38,0)", "String", "VARCHAR"),
        # Beyond the targets' ranges and +-infinity: text.
        (1082, "date", "String", "VARCHAR"),
        (1114, "timestamp without time zone", "String", "VARCHAR"),
        (1184, "timestamp with time zone", "String", "VARCHAR"),
        (1083, "time without time zone", "String", "VARCHAR"),
        (1266, "time with time zone", "String", "VARCHAR"),
        (1186, "interval", "String", "VARCHAR"),
        (114, "json", "String", "VARCHAR"),
        (3802, "jsonb", "String", "VARCHAR"),
        (790, "money", "String", "VARCHAR"),
        (869, "inet", "String", "VARCHAR"),
        (3220, "pg_lsn", "String", "VARCHAR"),
        (1007, "integer[]", "String", "VARCHAR"),
    ],
)
def test_faithful_choices(oid: int, type_name: str, clickhouse: str, snowflake: str) -> None:
    source = column(oid, type_name, nullable=False)
    assert (clickhouse_type(source), snowflake_type(source)) == (clickhouse, snowflake)


def test_nullable_rule() -> None:
    assert clickhouse_type(column(23, nullable=True)) == "Nullable(Int32)"
    assert clickhouse_type(column(23, nullable=False)) == "Int32"
    # Key columns are NOT NULL at the source and in the sorting key.
    assert clickhouse_type(column(23, key=True)) == "Int32"
    # A NULL array stays distinct from an empty one: arrays are Nullable text, not Array(...).
    assert clickhouse_type(column(1007, "integer[]", category="A", element=23)) == "Nullable(String)"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (column(16390, "mood", category="E"), ENUM),
        (column(16391, "mood[]", category="A", element=16390), ARRAY),
        (column(16392, "int4range_custom", category="R", element=23), RANGE),
        (column(16393, "pair", category="C"), COMPOSITE),
        (column(16394, "hstore", category="U"), COMPOSITE),
        (column(16395, "things[]"), ARRAY),
    ],
    ids=["enum", "enum array", "user range", "composite", "extension type", "array by name"],
)
def test_user_types_fall_back_to_text(source: SourceColumn, expected: object) -> None:
    assert mapping_for(source) is expected
    assert clickhouse_type(source) == "Nullable(String)" and snowflake_type(source) == "VARCHAR"


def test_domains_map_by_their_base_type() -> None:
    assert clickhouse_type(column(16400, "positive", category="N", element=23)) == "Nullable(Int32)"
    assert snowflake_type(column(16400, "positive", category="N", element=23)) == "NUMBER(10,0)"
    assert clickhouse_type(column(16401, "ratio", category="N", element=701)) == "Nullable(Float64)"
    assert clickhouse_type(column(16402, "price", category="N", element=1700)) == "Nullable(String)"
    # A domain over an array or an enum keeps the category's text mapping.
    assert mapping_for(column(16403, "tags", category="A", element=1009)) is ARRAY


def test_templates_substitute_only_the_operand() -> None:
    float8 = mapping_for(column(701))
    rendered = float8.clickhouse.render("`a{b}`")
    assert "{0}" not in rendered and "`a{b}`" in rendered
    assert mapping_for(column(17)).snowflake.convert('"x"') == "TO_BINARY(SUBSTR(\"x\", 3), 'HEX')"


def test_markdown_lists_every_type_and_category() -> None:
    table = mapping_markdown()
    for oid, name, _ in BUILTIN_TYPES:
        assert f"| `{name}` | {oid} |" in table
    for label in ("any array", "enum", "range, multirange", "composite", "domain"):
        assert f"| {label}" in table
    # Pipes inside SQL are escaped so every row keeps five cells.
    for line in table.splitlines():
        if line.startswith("| `"):
            assert line.replace("\\|", "").count("|") == 6, line


def test_document_is_current() -> None:
    assert DOC.read_text() == mapping_document(), (
        "docs/type-mapping.md is stale: python -m siphon_dagster.targets.type_mapping > docs/type-mapping.md"
    )


def test_readme_carries_the_current_table() -> None:
    readme = (DOC.parent.parent / "README.md").read_text()
    rows = [line for line in mapping_document().splitlines() if line.startswith("| `")]
    missing = [row for row in rows if row not in readme]
    assert not missing, f"README.md's type mapping is stale, e.g. {missing[:1]}"
