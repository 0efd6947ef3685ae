"""How every PostgreSQL type is stored in each target, as one table.

Values cross the target seam as PostgreSQL's text output, rendered by a session pinned to
DateStyle=ISO, IntervalStyle=postgres, TimeZone=UTC, extra_float_digits=3, bytea_output=hex. For
each type the table gives, per target, the column type, the SQL that converts that text (a string
column) into the column type, and the SQL that renders the stored value back to PostgreSQL's exact
text. The design's rule decides every row: a type maps to a target type that holds every value the
PostgreSQL type can hold, or to text holding PostgreSQL's exact output; never to a lossy guess.
`DECISIONS` says why each native type was ruled out; `mapping_document()` is docs/type-mapping.md
(regenerate with `python -m siphon_dagster.targets.type_mapping > docs/type-mapping.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

from siphon_dagster.targets.base import SourceColumn
from siphon_dagster.targets.clickhouse_float import FLOAT4, FLOAT8, float_text


@dataclass(frozen=True)
class TargetType:
    """One target's column type and the SQL templates around it; `{0}` is the operand."""

    type: str
    from_text: str = "{0}"  # operand: a string expression holding PostgreSQL's text output
    to_text: str = "{0}"  # operand: the stored column; yields PostgreSQL's text output
    native: bool = True
    # ClickHouse only: its TabSeparated reading of `type` takes PostgreSQL's COPY text of the value
    # as it is, so a snapshot inserts the field into the column without `from_text`.
    reads_copy_text: bool = False

    def convert(self, text_expression: str) -> str:
        # str.replace rather than str.format: SQL may contain braces of its own.
        return self.from_text.replace("{0}", text_expression)

    def render(self, column_expression: str) -> str:
        return self.to_text.replace("{0}", column_expression)


@dataclass(frozen=True)
class TypeMapping:
    pg_type: str
    clickhouse: TargetType
    snowflake: TargetType
    why: str


DECISIONS = """\
Each decision below rules out a native type because of a value PostgreSQL accepts and the target
type cannot hold:

- **numeric**, with or without typmod, text in both targets: `NaN` is a legal value of every
  `numeric(p,s)` column (only infinities are refused there), and unconstrained numeric reaches
  131072 digits and `+-Infinity`. Neither ClickHouse `Decimal` nor Snowflake `NUMBER` holds `NaN`,
  so even `numeric(10,2)` would lose a legal value. Readers cast, e.g. `toDecimal128OrNull(c, 2)`,
  `TRY_TO_NUMBER(c, 10, 2)`.
- **date, timestamp, timestamptz**, text: PostgreSQL spans 4713 BC to 294276 AD (dates to
  5874897 AD) plus `+-infinity`; ClickHouse `Date32`/`DateTime64` cover 1900-2299 and Snowflake
  has no infinity. The text is ISO with a UTC offset, which sorts correctly for years 1000-9999;
  `parseDateTime64BestEffortOrNull(c, 6, 'UTC')` / `TRY_TO_TIMESTAMP_TZ(c)` read it.
- **time** (`24:00:00` is legal), **timetz** (keeps an offset), text.
- **interval**, text (postgres style): months and days have no fixed length.
- **arrays**, text: a PostgreSQL array column holds arrays of any dimension count with any lower
  bounds (`[0:1]={1,2}`), and ClickHouse `Array` can neither be `Nullable` nor vary its dimension
  count. The NULL-array rule: a NULL array is NULL, an empty array is `{}`, a NULL element is
  `NULL` inside the text, exactly as PostgreSQL prints it.
- **json** byte for byte (whitespace, key order, duplicate keys), **jsonb** in its canonical text:
  a `JSON`/`VARIANT` column would rewrite both.
- **float4/float8**: ClickHouse `Float32`/`Float64` (NaN, +-Infinity and -0 kept); the render
  expression reproduces PostgreSQL's exact text, including the values where PostgreSQL's shortest
  digits differ from ClickHouse's (`clickhouse_float.py`). Snowflake: text, because Snowflake's
  float-to-text conversion is not documented to print shortest round-trip digits; `TO_DOUBLE(c)`
  reads the text, `NaN` and `+-Infinity` included.
- **uuid**: ClickHouse `UUID`; Snowflake has no uuid type, text (PostgreSQL's lower-case form).
- **bytea**: the bytes themselves (ClickHouse `String`, Snowflake `BINARY`, up to 8 MB there).
- Enums, ranges, multiranges, composite and extension types: text. Domains: as their base type.
"""

CLICKHOUSE_TEXT = TargetType("String", native=False, reads_copy_text=True)
SNOWFLAKE_TEXT = TargetType("VARCHAR", native=False)

_CH_BOOL = TargetType("Bool", "({0} = 't')", "CASE WHEN {0} THEN 't' WHEN NOT {0} THEN 'f' END", reads_copy_text=True)
_SF_BOOL = TargetType("BOOLEAN", "({0} = 't')", "CASE WHEN {0} THEN 't' WHEN NOT {0} THEN 'f' END")


def _ch_integer(ch_type: str) -> TargetType:
    return TargetType(ch_type, f"to{ch_type}({{0}})", "toString({0})", reads_copy_text=True)


def _sf_number(precision: int) -> TargetType:
    return TargetType(f"NUMBER({precision},0)", f"CAST({{0}} AS NUMBER({precision},0))", "CAST({0} AS VARCHAR)")


def _text(pg_type: str, why: str) -> TypeMapping:
    return TypeMapping(pg_type, CLICKHOUSE_TEXT, SNOWFLAKE_TEXT, why)


# Types whose values a target type holds completely. Everything else is text (see _TEXT_REASONS).
_NATIVE: dict[str, TypeMapping] = {
    m.pg_type: m
    for m in (
        TypeMapping("bool", _CH_BOOL, _SF_BOOL, "t/f"),
        TypeMapping("int2", _ch_integer("Int16"), _sf_number(5), "exact integer"),
        TypeMapping("int4", _ch_integer("Int32"), _sf_number(10), "exact integer"),
        TypeMapping("int8", _ch_integer("Int64"), _sf_number(19), "exact integer"),
        TypeMapping("oid", _ch_integer("UInt32"), _sf_number(10), "unsigned 32-bit"),
        TypeMapping("xid", _ch_integer("UInt32"), _sf_number(10), "unsigned 32-bit"),
        TypeMapping("cid", _ch_integer("UInt32"), _sf_number(10), "unsigned 32-bit"),
        TypeMapping("xid8", _ch_integer("UInt64"), _sf_number(20), "unsigned 64-bit"),
        TypeMapping(
            "float4",
            TargetType("Float32", "toFloat32({0})", float_text(FLOAT4)),
            SNOWFLAKE_TEXT,
            "ClickHouse: IEEE single, NaN/Infinity/-0 kept, shortest digits re-laid out as PostgreSQL does; "
            "Snowflake: text (float text output not guaranteed shortest round-trip)",
        ),
        TypeMapping(
            "float8",
            TargetType("Float64", "toFloat64({0})", float_text(FLOAT8)),
            SNOWFLAKE_TEXT,
            "ClickHouse: IEEE double, NaN/Infinity/-0 kept, shortest digits re-laid out as PostgreSQL does; "
            "Snowflake: text (float text output not guaranteed shortest round-trip)",
        ),
        TypeMapping(
            "uuid",
            TargetType("UUID", "toUUID({0})", "toString({0})", reads_copy_text=True),
            SNOWFLAKE_TEXT,
            "ClickHouse UUID prints the same lower-case form; Snowflake has no uuid type",
        ),
        TypeMapping(
            "bytea",
            # The bytes themselves are stored; char(92) is a backslash without literal-escaping rules.
            TargetType("String", "unhex(substring({0}, 3))", "concat(char(92), 'x', lower(hex({0})))"),
            TargetType("BINARY", "TO_BINARY(SUBSTR({0}, 3), 'HEX')", "CHR(92) || 'x' || LOWER(HEX_ENCODE({0}))"),
            "raw bytes (hex output \\x... decoded); Snowflake BINARY holds up to 8 MB",
        ),
    )
}

# Why each remaining built-in type is text (a target type would lose some legal value or its spelling).
_TEXT_REASONS: dict[str, str] = {
    "numeric": "NaN is legal in every numeric(p,s); unbounded numeric reaches 131072 digits and +-Infinity",
    "money": "output depends on lc_monetary (currency symbol, separators)",
    "date": "4713 BC..5874897 AD and +-infinity exceed Date32 (1900-2299) and Snowflake DATE",
    "timestamp": "4713 BC..294276 AD and +-infinity exceed DateTime64 (1900-2299) and TIMESTAMP_NTZ",
    "timestamptz": "4713 BC..294276 AD and +-infinity exceed DateTime64 (1900-2299) and TIMESTAMP_TZ; text is ISO in UTC",
    "time": "24:00:00 is legal and outside ClickHouse/Snowflake time types",
    "timetz": "carries a UTC offset no target time type keeps",
    "interval": "months and days have no fixed length; postgres-style text",
    "json": "kept byte for byte: whitespace, key order and duplicate keys",
    "jsonb": "canonical jsonb text; JSON/VARIANT types would reorder or reformat",
    "text": "text",
    "varchar": "text",
    "bpchar": "text, blank-padded as PostgreSQL prints it",
    "name": "text",
    "char": 'single byte "char"; PostgreSQL prints non-ASCII bytes as \\ooo',
    "inet": "IPv4 and IPv6 with netmask in one column; no target type holds both",
    "cidr": "network with prefix length",
    "macaddr": "text",
    "macaddr8": "text",
    "bit": "bit string",
    "varbit": "bit string",
    "xml": "kept as printed",
    "tsvector": "kept as printed",
    "tsquery": "kept as printed",
    "gtsvector": "kept as printed",
    "point": "geometric: text",
    "lseg": "geometric: text",
    "path": "geometric: text",
    "box": "geometric: text",
    "polygon": "geometric: text",
    "line": "geometric: text",
    "circle": "geometric: text",
    "pg_lsn": "X/X hexadecimal text",
    "tid": "(block,offset)",
    "regproc": "object name, resolved in the source catalog",
    "regprocedure": "object name, resolved in the source catalog",
    "regoper": "object name, resolved in the source catalog",
    "regoperator": "object name, resolved in the source catalog",
    "regclass": "object name, resolved in the source catalog",
    "regtype": "object name, resolved in the source catalog",
    "regconfig": "object name, resolved in the source catalog",
    "regdictionary": "object name, resolved in the source catalog",
    "regnamespace": "object name, resolved in the source catalog",
    "regrole": "object name, resolved in the source catalog",
    "regcollation": "object name, resolved in the source catalog",
    "refcursor": "text",
    "aclitem": "text",
    "jsonpath": "text",
    "txid_snapshot": "text",
    "pg_snapshot": "text",
    "pg_node_tree": "internal; text",
    "pg_ndistinct": "internal; text",
    "pg_dependencies": "internal; text",
    "pg_mcv_list": "internal; text",
    "pg_brin_bloom_summary": "internal; text",
    "pg_brin_minmax_multi_summary": "internal; text",
    "int4range": "range: bounds and inclusivity as printed",
    "int8range": "range: bounds and inclusivity as printed",
    "numrange": "range: bounds and inclusivity as printed",
    "tsrange": "range: bounds and inclusivity as printed",
    "tstzrange": "range: bounds and inclusivity as printed",
    "daterange": "range: bounds and inclusivity as printed",
    "int4multirange": "multirange: text",
    "int8multirange": "multirange: text",
    "nummultirange": "multirange: text",
    "tsmultirange": "multirange: text",
    "tstzmultirange": "multirange: text",
    "datemultirange": "multirange: text",
}

# PostgreSQL's built-in column types (pg_catalog, PostgreSQL 15; pseudo-types cannot be column
# types): (oid, typname, oid of its array type or 0).
BUILTIN_TYPES: tuple[tuple[int, str, int], ...] = (
    (16, "bool", 1000), (17, "bytea", 1001), (18, "char", 1002), (19, "name", 1003),
    (20, "int8", 1016), (21, "int2", 1005), (23, "int4", 1007), (24, "regproc", 1008),
    (25, "text", 1009), (26, "oid", 1028), (27, "tid", 1010), (28, "xid", 1011), (29, "cid", 1012),
    (114, "json", 199), (142, "xml", 143), (194, "pg_node_tree", 0), (600, "point", 1017),
    (601, "lseg", 1018), (602, "path", 1019), (603, "box", 1020), (604, "polygon", 1027),
    (628, "line", 629), (650, "cidr", 651), (700, "float4", 1021), (701, "float8", 1022),
    (718, "circle", 719), (774, "macaddr8", 775), (790, "money", 791), (829, "macaddr", 1040),
    (869, "inet", 1041), (1033, "aclitem", 1034), (1042, "bpchar", 1014), (1043, "varchar", 1015),
    (1082, "date", 1182), (1083, "time", 1183), (1114, "timestamp", 1115), (1184, "timestamptz", 1185),
    (1186, "interval", 1187), (1266, "timetz", 1270), (1560, "bit", 1561), (1562, "varbit", 1563),
    (1700, "numeric", 1231), (1790, "refcursor", 2201), (2202, "regprocedure", 2207),
    (2203, "regoper", 2208), (2204, "regoperator", 2209), (2205, "regclass", 2210),
    (2206, "regtype", 2211), (2950, "uuid", 2951), (2970, "txid_snapshot", 2949), (3220, "pg_lsn", 3221),
    (3361, "pg_ndistinct", 0), (3402, "pg_dependencies", 0), (3614, "tsvector", 3643),
    (3615, "tsquery", 3645), (3642, "gtsvector", 3644), (3734, "regconfig", 3735),
    (3769, "regdictionary", 3770), (3802, "jsonb", 3807), (3904, "int4range", 3905),
    (3906, "numrange", 3907), (3908, "tsrange", 3909), (3910, "tstzrange", 3911),
    (3912, "daterange", 3913), (3926, "int8range", 3927), (4072, "jsonpath", 4073),
    (4089, "regnamespace", 4090), (4096, "regrole", 4097), (4191, "regcollation", 4192),
    (4451, "int4multirange", 6150), (4532, "nummultirange", 6151), (4533, "tsmultirange", 6152),
    (4534, "tstzmultirange", 6153), (4535, "datemultirange", 6155), (4536, "int8multirange", 6157),
    (4600, "pg_brin_bloom_summary", 0), (4601, "pg_brin_minmax_multi_summary", 0),
    (5017, "pg_mcv_list", 0), (5038, "pg_snapshot", 5039), (5069, "xid8", 271),
)  # fmt: skip

ARRAY = _text("array", "any dimensions and lower bounds, NULL elements, NULL array stays NULL")
ENUM = _text("enum", "label as printed")
RANGE = _text("range / multirange", "bounds and inclusivity as printed")
COMPOSITE = _text("composite / other user type", "row or extension type, as printed")

BY_OID: dict[int, TypeMapping] = {}
for _oid, _name, _array_oid in BUILTIN_TYPES:
    BY_OID[_oid] = _NATIVE.get(_name) or _text(_name, _TEXT_REASONS[_name])
    if _array_oid:
        BY_OID[_array_oid] = ARRAY
ARRAY_OIDS = frozenset(array_oid for _, _, array_oid in BUILTIN_TYPES if array_oid)

# Categories of pg_type.typcategory that are always text whatever the type's oid.
_CATEGORY_FALLBACK = {"A": ARRAY, "E": ENUM, "R": RANGE, "C": COMPOSITE}


def mapping_for(column: SourceColumn) -> TypeMapping:
    """The mapping of a source column; domains resolve through their base type (element_type_oid)."""
    if column.type_oid in BY_OID:
        return BY_OID[column.type_oid]
    if column.type_name.endswith("]"):
        return ARRAY
    if column.category in _CATEGORY_FALLBACK:
        return _CATEGORY_FALLBACK[column.category]
    if column.element_type_oid in BY_OID:
        # A domain: pg_type gives its base type; the domain's constraints only narrow the values.
        return BY_OID[column.element_type_oid]
    return COMPOSITE


def clickhouse_type(column: SourceColumn) -> str:
    """The ClickHouse column type, Nullable when the source allows NULL (key columns never do)."""
    base = mapping_for(column).clickhouse.type
    return f"Nullable({base})" if column.nullable and not column.primary_key else base


def snowflake_type(column: SourceColumn) -> str:
    return mapping_for(column).snowflake.type


def _code(sql: str) -> str:
    # A pipe splits a markdown table cell even inside a code span unless escaped.
    return "`" + sql.replace("|", "\\|") + "`"


def _cell(target: TargetType) -> str:
    return f"`{target.type}`" if target.native else f"`{target.type}` (text)"


def mapping_markdown() -> str:
    """The mapping as a markdown table, one row per built-in type plus the type categories."""
    lines = [
        "| PostgreSQL type | oid | ClickHouse | Snowflake | why |",
        "|---|---|---|---|---|",
    ]
    for oid, name, _array_oid in sorted(BUILTIN_TYPES, key=lambda t: t[1]):
        mapping = BY_OID[oid]
        lines.append(f"| `{name}` | {oid} | {_cell(mapping.clickhouse)} | {_cell(mapping.snowflake)} | {mapping.why} |")
    for label, mapping in (
        ("any array (`_name`, `type[]`)", ARRAY),
        ("enum", ENUM),
        ("range, multirange", RANGE),
        ("composite, extension or unknown type", COMPOSITE),
    ):
        lines.append(f"| {label} | | {_cell(mapping.clickhouse)} | {_cell(mapping.snowflake)} | {mapping.why} |")
    lines.append("| domain | | as its base type | as its base type | a domain only narrows its base type's values |")
    lines += [
        "",
        "Conversions of the native mappings (`x` is the text PostgreSQL printed, `c` the stored column):",
        "",
        "| PostgreSQL type | ClickHouse in | ClickHouse out | Snowflake in | Snowflake out |",
        "|---|---|---|---|---|",
    ]
    for name, mapping in _NATIVE.items():
        cells = []
        for target in (mapping.clickhouse, mapping.snowflake):
            if not target.native:
                cells += ["x", "c"]
            elif target.type.startswith("Float"):
                cells += [_code(target.convert("x")), "PostgreSQL's exact float text (`clickhouse_float.py`)"]
            else:
                cells += [_code(target.convert("x")), _code(target.render("c"))]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Columns are `Nullable(...)` in ClickHouse when the source column is nullable and not part of the",
        "primary key. Text columns hold PostgreSQL's output under DateStyle=ISO, IntervalStyle=postgres,",
        "TimeZone=UTC, extra_float_digits=3, bytea_output=hex.",
    ]
    return "\n".join(lines) + "\n"


def mapping_document() -> str:
    """docs/type-mapping.md."""
    intro = (
        "# Type mapping\n\n"
        "Generated by `python -m siphon_dagster.targets.type_mapping` from "
        "`siphon_dagster/targets/type_mapping.py`; a unit test fails when it is stale.\n\n"
        "Every value reaches a target as PostgreSQL's text output and is converted by the target "
        "itself, with one exception: a ClickHouse change batch arrives typed, converted by the "
        "streaming run into exactly the values of the SQL below (`targets/clickhouse_batch.py`). "
        "Every column maps to a target type that holds all of the PostgreSQL type's values, "
        "or to text holding PostgreSQL's exact output. The integration test "
        "`tests/integration/test_type_round_trip.py` reads every value back and compares it with "
        "PostgreSQL's own text.\n\n"
    )
    return intro + DECISIONS + "\n" + mapping_markdown()


if __name__ == "__main__":
    print(mapping_document(), end="")
