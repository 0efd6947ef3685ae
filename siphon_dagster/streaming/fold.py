"""The fold: per primary key, only the latest change of a micro-batch survives.

The version rule makes this safe: a target keeps the greatest version of each row, so earlier
changes of a key in the same batch would be overwritten anyway. A DELETE wins over earlier changes;
a later INSERT wins over the DELETE because its version is greater. Changes at or before the
batch's last TRUNCATE are dropped (the truncate tombstones their keys anyway).

It runs on Arrow tables in Spark's Python workers (siphon_dagster.streaming.spark_plan): once over
each task's decoded changes before the shuffle, once over each key bucket after it. Folding parts
first is exact: the latest change of a key is the latest of its parts' latest changes.

The latest row keeps its values as one TupleData (`_row`); its unchanged TOASTed values are filled
afterwards from the batch's history of the key, the target or the source
(siphon_dagster.streaming.toast).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb

VERSION_TYPE = pa.decimal128(38, 0)
_NEWEST_FIRST = [("_key", "ascending"), ("_lsn", "descending"), ("_pos", "descending")]


def fold_changes(changes: pa.Table, truncated_at: int | None = None) -> pa.Table:
    """One row per key, its latest change, in the layout of `changes` (decode.DECODED_SCHEMA).

    `truncated_at` is the version of the batch's last TRUNCATE, if any.
    """
    rows = changes.filter(pc.not_equal(changes.column("_op"), pa.scalar(pb.TRUNCATE, pa.int8())))
    if truncated_at is not None:
        rows = rows.filter(_after(rows, truncated_at))
    if rows.num_rows < 2:
        return rows
    order = pc.sort_indices(rows, sort_keys=_NEWEST_FIRST)
    keys = rows.column("_key").take(order)
    # Sorted by key, newest first: a row whose key differs from the row before it is its key's
    # latest. Only the keys are reordered; the rows are copied once, survivors only.
    changed = pc.not_equal(keys.slice(1), keys.slice(0, rows.num_rows - 1))
    first = pa.chunked_array([pa.array([True]), *changed.chunks]) if isinstance(changed, pa.ChunkedArray) else \
        pa.concat_arrays([pa.array([True]), changed])
    return rows.take(pc.filter(order, first))


def with_version(rows: pa.Table) -> pa.Table:
    """Adds `_version` = naming.row_version(_lsn, _pos) as DECIMAL(38, 0), exact for any LSN."""
    shifted = pc.multiply(rows.column("_lsn").cast(pa.decimal128(19, 0)), pa.scalar(1 << 32, pa.decimal128(10, 0)))
    version = pc.add(shifted, rows.column("_pos").cast(pa.decimal128(19, 0))).cast(VERSION_TYPE)
    return rows.append_column(pa.field("_version", VERSION_TYPE), version)


def _after(rows: pa.Table, version: int) -> pa.ChunkedArray:
    lsn, position = naming.split_version(version)
    lsns, positions = rows.column("_lsn"), rows.column("_pos")
    return pc.or_(pc.greater(lsns, lsn), pc.and_(pc.equal(lsns, lsn), pc.greater(positions, position)))
