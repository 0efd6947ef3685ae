"""A change batch as the columns of the ClickHouse table it is inserted into.

A change batch holds PostgreSQL's text of every value (`change_batch_schema`). ClickHouse takes it
typed, straight into the table, with no view and no query of its own around the insert (a view's
analysis and plan cost the server more than the rest of a small batch's insert). Each native
ClickHouse type of the type mapping has a conversion whose result the text alone fixes, so Arrow
computes exactly the value of its `from_text` SQL:
- integers are parsed exactly on both sides;
- floats are rounded correctly on both sides (ClickHouse's `toFloat64`/`toFloat32` and Arrow's cast
  agree bit for bit, NaN, infinities, -0 and subnormals included). ClickHouse's own reading of a
  text column into a float column does not: it rounds some values a unit off, which is why the
  run converts rather than sending text;
- a boolean is the text `t`;
- bytea is PostgreSQL's hex output, decoded;
- UUIDs go as their text, which ClickHouse parses into the column.
A NULL in a column that holds none (a tombstone carries only its key) becomes the type's default,
as the SQL's `ifNull(..., defaultValueOfTypeName(...))` makes it: ClickHouse's
`input_format_null_as_default` does that for typed columns, and a UUID's text is filled here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from siphon_dagster.targets.base import (
    DELETED_COLUMN,
    SYNCED_AT_COLUMN,
    VERSION_COLUMN,
    SourceColumn,
    TableSchema,
    TargetError,
)
from siphon_dagster.targets.type_mapping import mapping_for

Values = pa.ChunkedArray | pa.Array
Conversion = Callable[[Values], Values]

NIL_UUID = "00000000-0000-0000-0000-000000000000"
SYNCED_AT_TYPE = pa.timestamp("us", tz="UTC")
# Arrow's compute functions called as objects with options made once: through `pc.cast` and
# `pc.equal` each call cost twice as much, which a wide table's batch paid some twenty times.
_CAST = pc.get_function("cast")
_EQUAL = pc.get_function("equal")
_TRUE_TEXT = pa.scalar("t")


def _as_is(values: Values) -> Values:
    return values


def _boolean(values: Values) -> Values:
    return _EQUAL.call([values, _TRUE_TEXT])


def _cast(arrow_type: pa.DataType) -> Conversion:
    options = pc.CastOptions.safe(arrow_type)
    return lambda values: _CAST.call([values], options)


def _hex_bytes(values: Values) -> Values:
    # PostgreSQL's bytea_output=hex: `\x` and two lower-case digits a byte.
    return pa.array([None if text is None else bytes.fromhex(text[2:]) for text in values.to_pylist()], pa.binary())


def _uuid_or_nil(values: Values) -> Values:
    return pc.fill_null(values, NIL_UUID)


# By the ClickHouse type of the mapping; bytea, stored as String, is told apart by its PostgreSQL type.
_CONVERSIONS: dict[str, Conversion] = {
    "String": _as_is,
    "Bool": _boolean,
    "Int16": _cast(pa.int16()),
    "Int32": _cast(pa.int32()),
    "Int64": _cast(pa.int64()),
    "UInt32": _cast(pa.uint32()),
    "UInt64": _cast(pa.uint64()),
    "Float32": _cast(pa.float32()),
    "Float64": _cast(pa.float64()),
    "UUID": _as_is,
}
BYTEA = "bytea"


def conversion_for(column: SourceColumn) -> Conversion:
    """How the column's text becomes the value its ClickHouse column takes."""
    mapping = mapping_for(column)
    if mapping.pg_type == BYTEA:
        return _hex_bytes
    kind = mapping.clickhouse.type
    if kind == "UUID" and (column.primary_key or not column.nullable):
        return _uuid_or_nil
    try:
        return _CONVERSIONS[kind]
    except KeyError:
        raise TargetError(f"column {column.name!r} ({column.type_name}): no batch conversion to ClickHouse {kind}") from None


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """How a table's change batches become its typed ClickHouse columns (`typed`); made once per
    column list."""

    table: TableSchema
    conversions: tuple[Conversion, ...]
    columns: tuple[str, ...]  # what the typed batch fills, in its order

    def typed(self, rows: pa.Table, synced_at_us: int | None = None) -> pa.Table:
        """`rows` (`change_batch_schema(table)`) as the table's ClickHouse columns. The version
        goes as the exact DECIMAL(38, 0) it is, which ClickHouse casts into its UInt128 column
        (Arrow has no 128-bit integer); as its digits it had cost the run a cast to text (23 ms
        for 200,000 rows) and the server their parsing;
        `_siphon_synced_at` is when the batch was made, by this process's clock."""
        columns: list[Values] = []
        for i, convert in enumerate(self.conversions):
            try:
                columns.append(convert(rows.column(i)))
            except (pa.ArrowInvalid, ValueError) as error:
                column = self.table.columns[i]
                raise TargetError(f"{self.table.schema}.{self.table.table}: column {column.name!r} "
                                  f"({column.type_name}) holds a value ClickHouse's type does not take: {error}") from error
        width = len(self.conversions)
        columns.append(rows.column(width))
        columns.append(_FLAG(rows.column(width + 1)))
        stamp = time.time_ns() // 1000 if synced_at_us is None else synced_at_us
        columns.append(pa.array(np.full(rows.num_rows, stamp, dtype=np.int64), SYNCED_AT_TYPE))
        return pa.table(columns, names=self.columns)


_FLAG = _cast(pa.uint8())


def plan_for(table: TableSchema) -> BatchPlan:
    return BatchPlan(table, tuple(conversion_for(column) for column in table.columns),
                     (*table.column_names, VERSION_COLUMN, DELETED_COLUMN, SYNCED_AT_COLUMN))
