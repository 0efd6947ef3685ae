"""Every PostgreSQL type, value by value, through each target and back to PostgreSQL's own text.

A PostgreSQL table has one column per type and rows of edge values. Its text output (under the
walsender's pinned settings) goes to the target twice: as COPY text (the snapshot path) and as a
change batch (the stream path). What the target renders back must equal PostgreSQL's output for
every value. Snowflake is loaded both ways a batch can travel: INSERT ... VALUES and Parquet files
through a stage and a COPY.
"""

from __future__ import annotations

import math
import random
import struct
import uuid
from collections.abc import Iterator

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from siphon_dagster.targets.base import SourceColumn, TableSchema, Target, change_batch_schema
from siphon_dagster.targets.copy_text import iter_copy_rows
from tests.integration.test_targets_version_rule import TARGETS, assert_load_path, make_target

# The settings the producer's replication connection pins (and a snapshot's COPY session uses).
SESSION_SETTINGS = {
    "DateStyle": "ISO",
    "IntervalStyle": "postgres",
    "TimeZone": "UTC",
    "extra_float_digits": "3",
    "bytea_output": "hex",
}

USER_TYPES = [
    "CREATE TYPE {schema}.mood AS ENUM ('sad', 'ok', 'happy \"yes\"', 'ünï cödé')",
    "CREATE DOMAIN {schema}.positive AS integer CHECK (VALUE > 0)",
    "CREATE DOMAIN {schema}.ratio AS double precision",
    "CREATE DOMAIN {schema}.price AS numeric(6,2)",
    "CREATE TYPE {schema}.pair AS (n integer, label text)",
]

# column -> (type, values of rows 2.. as PostgreSQL input text; row 1 is all NULL). Rows without
# a value for a column hold NULL there.
COLUMNS: dict[str, tuple[str, list[str | None]]] = {
    "bool": ("boolean", ["t", "f"]),
    "int2": ("smallint", ["-32768", "32767", "0"]),
    "int4": ("integer", ["-2147483648", "2147483647", "0"]),
    "int8": ("bigint", ["-9223372036854775808", "9223372036854775807", "0"]),
    "float4": ("real", ["3.14", "NaN", "Infinity", "-Infinity", "-0", "1e-45", "3.4028235e+38", "-1.2e-05", "100000", "1e+06"]),
    "float8": ("double precision", ["0.1", "NaN", "Infinity", "-Infinity", "-0", "5e-324", "1.7976931348623157e+308",
                                    "0.30000000000000004", "123456789012345.6", "1e+15", "0.0001", "1e-05"]),
    "numeric": ("numeric", ["1e-30", "1" + "0" * 300 + ".5", "NaN", "Infinity", "-Infinity", "-0.00100", "0",
                            "12345678901234567890123456789012345678901234567890"]),
    "numeric_10_2": ("numeric(10,2)", ["12345678.91", "NaN", "-0.5", "0"]),
    "numeric_38_0": ("numeric(38,0)", ["99999999999999999999999999999999999999", "NaN", "-1"]),
    "money": ("money", ["1234.56", "-92233720368547758.08", "0"]),
    "text": ("text", ["héllo\tworld\nnew\\line \"q\" 's", "", " ", "NULL", "\\N", "ü日本語🎉", "\r\b\f\v\x01\x7f|end"]),
    "varchar": ("character varying(20)", ["abc", "trailing  "]),
    "bpchar": ("character(5)", ["ab", "abcde"]),
    "name": ("name", ["a name"]),
    "char1": ('"char"', ["x", "\\"]),
    "bytea": ("bytea", ["\\x0001027f80ff", "\\x", "\\x00", "\\x5c6e0a09"]),
    "date": ("date", ["2024-02-29", "infinity", "-infinity", "4713-01-01 BC", "5874897-12-31", "0001-01-01", "1899-12-31", "2300-01-01"]),
    "time": ("time", ["00:00:00", "24:00:00", "23:59:59.999999", "12:34:56.789"]),
    "timetz": ("time with time zone", ["12:34:56+05:30", "00:00:00-15:59", "24:00:00+15:59"]),
    "timestamp": ("timestamp", ["2024-01-02 03:04:05.123456", "infinity", "-infinity", "4713-01-01 00:00:00 BC",
                                "294276-12-31 23:59:59.999999", "1899-12-31 23:59:59", "2300-01-01 00:00:00"]),
    "timestamptz": ("timestamp with time zone", ["2024-01-02 03:04:05.123456+02", "infinity", "-infinity",
                                                 "4713-01-01 00:00:00+00 BC", "294276-12-31 23:59:59.999999+00", "1900-01-01 00:00:00+00"]),
    "timestamp3": ("timestamp(3)", ["2024-01-02 03:04:05.123456"]),
    "interval": ("interval", ["1 year 2 mons 3 days 04:05:06.789", "-1 mons +1 day -00:00:01", "0", "178000000 years",
                              "-00:00:00.000001"]),
    "json": ("json", ['{"b": 1,  "a": [1, 2], "a": null}', "[]", ' "x" ', '{"k":"\\u00e9\\t"}']),
    "jsonb": ("jsonb", ['{"b": 1, "a": {"c": [1, 2.50]}, "a": 2}', "null", '[1, "two", {"3": 4}]', '"é\\t"']),
    "uuid": ("uuid", ["A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11", "00000000-0000-0000-0000-000000000000"]),
    "inet": ("inet", ["192.168.0.1", "10.0.0.0/8", "::1", "2001:db8::1/64"]),
    "cidr": ("cidr", ["10.0.0.0/8", "2001:db8::/32"]),
    "macaddr": ("macaddr", ["08:00:2B:01:02:03"]),
    "macaddr8": ("macaddr8", ["08:00:2b:01:02:03:04:05"]),
    "bit": ("bit(4)", ["1010"]),
    "varbit": ("bit varying", ["", "101"]),
    "xml": ("xml", ['<a b="1">x &amp; y</a>', "text only"]),
    "tsvector": ("tsvector", ["a fat cat sat", "'with space':1A"]),
    "tsquery": ("tsquery", ["fat & (rat | cat)"]),
    "point": ("point", ["(1.5,-2)", "(NaN,Infinity)"]),
    "line": ("line", ["{1,-1,0}"]),
    "lseg": ("lseg", ["[(0,0),(1,1)]"]),
    "box": ("box", ["(1,1),(0,0)"]),
    "path": ("path", ["[(0,0),(1,1),(2,0)]", "((0,0),(1,1))"]),
    "polygon": ("polygon", ["((0,0),(1,1),(1,0))"]),
    "circle": ("circle", ["<(0,0),1.5>"]),
    "oid": ("oid", ["4294967295", "0"]),
    "xid": ("xid", ["4294967295", "3"]),
    "cid": ("cid", ["4294967295"]),
    "xid8": ("xid8", ["18446744073709551615", "0"]),
    "pg_lsn": ("pg_lsn", ["FFFFFFFF/FFFFFFFF", "0/0"]),
    "tid": ("tid", ["(4294967295,65535)"]),
    "regclass": ("regclass", ["pg_class"]),
    "regtype": ("regtype", ["integer"]),
    "pg_snapshot": ("pg_snapshot", ["10:20:10,14,15"]),
    "jsonpath": ("jsonpath", ["$.a[*] ? (@ > 1)"]),
    "int4range": ("int4range", ["[1,10)", "empty", "(,5]"]),
    "int8range": ("int8range", ["[-9223372036854775808,9223372036854775807)"]),
    "numrange": ("numrange", ["(1.5,)", "[-Infinity,Infinity]"]),
    "tstzrange": ("tstzrange", ['["2024-01-01 00:00:00+00",infinity)']),
    "daterange": ("daterange", ["[2024-01-01,2024-02-01)"]),
    "int4multirange": ("int4multirange", ["{[1,3), [5,7)}", "{}"]),
    "int4_array": ("integer[]", ["{1,NULL,3}", "{}", "{{1,2},{3,4}}", "[0:1]={5,6}"]),
    "text_array": ("text[]", ['{"a b","c,d","NULL",NULL,"\\"q\\"","é\\\\",""}']),
    "float8_array": ("double precision[]", ["{NaN,Infinity,-0,1e-300}"]),
    "bytea_array": ("bytea[]", ['{"\\\\x00ff",NULL}']),
    "timestamptz_array": ("timestamp with time zone[]", ['{infinity,"2024-01-01 00:00:00+00"}']),
    "numeric_array": ("numeric[]", ["{NaN,1.50}"]),
    "mood": ("{schema}.mood", ["ok", 'happy "yes"', "ünï cödé"]),
    "mood_array": ("{schema}.mood[]", ['{sad,"happy \\"yes\\""}']),
    "positive": ("{schema}.positive", ["5"]),
    "ratio": ("{schema}.ratio", ["1e-05", "NaN"]),
    "price": ("{schema}.price", ["1.50", "NaN"]),
    "pair": ("{schema}.pair", ['(1,"a b")', "(,)"]),
}  # fmt: skip

ROW_COUNT = 1 + max(len(values) for _, values in COLUMNS.values())

# How the catalog describes a column, as the producer's relation metadata would.
CATALOG_QUERY = """
SELECT a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod), a.atttypmod, NOT a.attnotnull,
       coalesce(a.attnum = ANY (i.indkey), false), t.typcategory,
       CASE t.typtype WHEN 'd' THEN t.typbasetype WHEN 'b' THEN t.typelem ELSE 0 END::int
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary
WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


class Source:
    """The PostgreSQL side: the all-types table, its catalog description and its text output."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.connection = psycopg.connect(dsn, autocommit=True)
        for name, value in SESSION_SETTINGS.items():
            self.connection.execute("SELECT set_config(%s, %s, false)", (name, value))
        self.schema = schema
        self.table = sql.Identifier(schema, "all_types")

    def create(self) -> None:
        self.connection.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema)))
        for statement in USER_TYPES:
            self.connection.execute(statement.format(schema=sql.Identifier(self.schema).as_string(self.connection)))
        columns = [sql.SQL("id integer PRIMARY KEY")]
        for name, (kind, _values) in COLUMNS.items():
            columns.append(sql.SQL("{} {}").format(sql.Identifier(name), sql.SQL(self._type(kind))))
        self.connection.execute(sql.SQL("CREATE TABLE {} ({})").format(self.table, sql.SQL(", ").join(columns)))
        names = sql.SQL(", ").join([sql.Identifier("id"), *(sql.Identifier(n) for n in COLUMNS)])
        casts = sql.SQL(", ").join(
            [sql.SQL("%s::integer"), *(sql.SQL("%s::" + self._type(kind)) for kind, _ in COLUMNS.values())]
        )
        insert = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(self.table, names, casts)
        for number in range(ROW_COUNT):
            values = [values[number - 1] if 0 < number <= len(values) else None for _, values in COLUMNS.values()]
            self.connection.execute(insert, [str(number), *values])

    def _type(self, kind: str) -> str:
        return kind.format(schema=sql.Identifier(self.schema).as_string(self.connection))

    def schema_for(self, table_name: str) -> TableSchema:
        rows = self.connection.execute(CATALOG_QUERY, (self.table.as_string(self.connection),)).fetchall()
        columns = tuple(
            SourceColumn(name, oid, type_name, modifier, nullable, key, category, element)
            for name, oid, type_name, modifier, nullable, key, category, element in rows
        )
        return TableSchema(self.schema, table_name, columns)

    def text_rows(self) -> list[tuple[str | None, ...]]:
        """PostgreSQL's output functions' text, straight from libpq (no client-side parsing)."""
        cursor = self.connection.cursor()
        cursor.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(self.table))
        result = cursor.pgresult
        assert result is not None
        return [
            tuple(None if (v := result.get_value(r, c)) is None else bytes(v).decode() for c in range(result.nfields))
            for r in range(result.ntuples)
        ]

    def copy_chunks(self) -> list[bytes]:
        with self.connection.cursor().copy(sql.SQL("COPY (SELECT * FROM {} ORDER BY id) TO STDOUT").format(self.table)) as copy:
            return [bytes(data) for data in copy]


@pytest.fixture(scope="module")
def source(postgres_dsn: str) -> Iterator[Source]:
    src = Source(postgres_dsn, f"round_trip_{uuid.uuid4().hex[:8]}")
    src.create()
    yield src
    src.connection.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(src.schema)))
    src.connection.close()


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest, unique_name: str) -> Iterator[Target]:
    built = make_target(request, request.param, unique_name)
    yield built
    built.close()


@pytest.fixture
def variant(request: pytest.FixtureRequest) -> str:
    return request.node.callspec.params["target"]


def test_copy_text_reader_matches_postgres(source: Source) -> None:
    """The COPY text parser (used by row-based targets) decodes exactly what PostgreSQL printed."""
    assert [tuple(r) for r in iter_copy_rows(source.copy_chunks())] == source.text_rows()
    # Chunk boundaries may fall anywhere, even inside an escape sequence.
    data = b"".join(source.copy_chunks())
    assert [tuple(r) for r in iter_copy_rows(data[i : i + 7] for i in range(0, len(data), 7))] == source.text_rows()


def assert_same_text(table: TableSchema, got: list[tuple], expected: list[tuple]) -> None:
    assert len(got) == len(expected)
    mismatches = [
        f"row id={want[0]} column {column.name} ({column.type_name}): target {have_value!r} != postgres {want_value!r}"
        for have, want in zip(got, expected, strict=True)
        for column, have_value, want_value in zip(table.columns, have, want, strict=True)
        if have_value != want_value
    ]
    assert not mismatches, "\n".join(mismatches)


def rechunked(chunks: list[bytes], size: int) -> Iterator[bytes]:
    """The same bytes cut every `size` bytes: boundaries inside rows and escape sequences."""
    data = b"".join(chunks)
    return (data[i : i + size] for i in range(0, len(data), size))


def test_snapshot_path_round_trips_every_type(source: Source, target: Target, variant: str) -> None:
    table = source.schema_for("all_types_copy")
    target.ensure_table(table)
    assert target.apply_copy_text(table, rechunked(source.copy_chunks(), 97), version=1) == ROW_COUNT
    assert_load_path(target, variant, snapshot=True)
    assert_same_text(table, target.current_rows_as_text(table), source.text_rows())


def random_floats(count: int) -> list[tuple[str, str]]:
    """(float4, float8) inputs: random bit patterns (every exponent and digit count) and large
    integers (where ClickHouse's shortest digits can sit on a rounding boundary PostgreSQL avoids)."""
    generator = random.Random(20240229)
    pairs = []
    for number in range(count):
        if number % 2:
            single = float(generator.randrange(2**24, 2**80))
            double = float(generator.randrange(2**52, 2**200))
        else:
            single = struct.unpack("<f", struct.pack("<I", generator.getrandbits(32)))[0]
            double = struct.unpack("<d", struct.pack("<Q", generator.getrandbits(64)))[0]
        # repr of a float is exact enough for PostgreSQL to read back the same value.
        pairs.append((repr(single) if math.isfinite(single) else "NaN", repr(double) if math.isfinite(double) else "NaN"))
    return pairs


def test_random_floats_round_trip(postgres_dsn: str, target: Target, variant: str, unique_name: str) -> None:
    """Thousands of random float4/float8 values print exactly as PostgreSQL prints them."""
    source = Source(postgres_dsn, unique_name)
    source.connection.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(unique_name)))
    floats = sql.Identifier(unique_name, "floats")
    source.connection.execute(sql.SQL("CREATE TABLE {} (id integer PRIMARY KEY, f4 real, f8 double precision)").format(floats))
    with source.connection.cursor() as cursor:
        cursor.executemany(
            sql.SQL("INSERT INTO {} VALUES (%s, %s::real, %s::double precision)").format(floats),
            [(i, f4, f8) for i, (f4, f8) in enumerate(random_floats(3000))],
        )
    source.table = floats
    table = source.schema_for("floats")
    target.ensure_table(table)
    target.apply_copy_text(table, iter(source.copy_chunks()), version=1)
    assert_load_path(target, variant, snapshot=True)
    expected = source.text_rows()
    assert_same_text(table, target.current_rows_as_text(table), expected)
    # The same values again as a change batch, a newer version of every row: the stream's conversion.
    schema = change_batch_schema(table)
    arrays = [pa.array(list(values), pa.string()) for values in zip(*expected, strict=True)]
    arrays += [pa.array([2] * len(expected), schema.field(len(arrays)).type), pa.array([False] * len(expected))]
    target.apply_rows(table, pa.Table.from_arrays(arrays, schema=schema))
    assert target.max_version(table) == 2
    assert_same_text(table, target.current_rows_as_text(table), expected)
    source.connection.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(unique_name)))
    source.connection.close()


def test_stream_path_round_trips_every_type(source: Source, target: Target, variant: str) -> None:
    table = source.schema_for("all_types_rows")
    target.ensure_table(table)
    expected = source.text_rows()
    columns = list(zip(*expected, strict=True))
    schema = change_batch_schema(table)
    arrays = [pa.array(list(values), pa.string()) for values in columns]
    arrays.append(pa.array([10 + i for i in range(len(expected))], schema.field(len(columns)).type))
    arrays.append(pa.array([False] * len(expected)))
    assert target.apply_rows(table, pa.Table.from_arrays(arrays, schema=schema)) == len(expected)
    assert_load_path(target, variant)
    assert_same_text(table, target.current_rows_as_text(table), expected)
    # Lookups by key render the same text.
    wanted = [c.name for c in table.columns[1:]]
    found = target.read_current_values(table, [(row[0],) for row in expected[:3]], wanted)
    assert found == {(row[0],): dict(zip(wanted, row[1:], strict=True)) for row in expected[:3]}
