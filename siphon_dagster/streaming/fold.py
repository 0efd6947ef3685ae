"""The fold: per primary key, only the latest change of a micro-batch survives.

The version rule makes this safe: a target keeps the greatest version of each row, so earlier
changes of a key in the same batch would be overwritten anyway. A DELETE wins over earlier changes;
a later INSERT wins over the DELETE because its version is greater. Changes at or before the
batch's last TRUNCATE are dropped (the truncate tombstones their keys anyway).

It runs on Arrow tables (siphon_dagster.streaming.spark_plan): over each Spark task's decoded
changes in the Python workers, then on the driver over the tasks' folded pieces (`merge_pieces`).
Folding parts first is exact: the latest change of a key is the latest of its parts' latest
changes.

Keys are dictionary-encoded first, so the sort compares integers, never the key bytes. Pieces are
merged by looking up one piece's keys in the other's, so that only rows a newer copy replaces are
dropped and nothing is copied when the pieces share no key.

The latest row's unchanged TOASTed values are filled afterwards from the batch's history of the
key, the target or the source (siphon_dagster.streaming.toast).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb

VERSION_TYPE = pa.decimal128(38, 0)


def latest_indices(changes: pa.Table, truncated_at: int | None = None) -> np.ndarray:
    """Indices into `changes` (columns `_key`, `_op`, `_lsn`, `_pos`) of each key's latest change;
    TRUNCATE rows, and changes at or before `truncated_at` (the version of the batch's last
    TRUNCATE, if any), are left out."""
    keep = changes.column("_op").to_numpy() != pb.TRUNCATE
    lsns = _numpy(changes.column("_lsn"))
    positions = _numpy(changes.column("_pos"))
    if truncated_at is not None:
        lsn, position = naming.split_version(truncated_at)
        keep &= (lsns > lsn) | ((lsns == lsn) & (positions > position))
    candidates = np.flatnonzero(keep)
    if candidates.size < 2:
        return candidates
    keys = changes.column("_key")
    if candidates.size != changes.num_rows:
        keys = keys.take(pa.array(candidates))
    keys = keys.combine_chunks().dictionary_encode().indices
    key_ids = keys.to_numpy()
    # Ascending by key, then version: the last row of each key is its latest change.
    order = np.lexsort((positions[candidates], lsns[candidates], key_ids))
    sorted_ids = key_ids[order]
    last = np.empty(order.size, bool)
    last[-1] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=last[:-1])
    return candidates[order[last]]


def merge_pieces(pieces: Sequence[pa.Table]) -> pa.Table:
    """The latest row of each key among pieces that each hold a key at most once (folded, without
    TRUNCATE rows), in the layout of the pieces."""
    pieces = [piece for piece in pieces if piece.num_rows]
    if not pieces:
        raise ValueError("merge_pieces needs at least one non-empty piece")
    merged = pieces[0]
    for piece in pieces[1:]:
        merged = _merge_two(merged, piece)
    return merged


def _merge_two(first: pa.Table, second: pa.Table) -> pa.Table:
    # For each row of `second`, the row of `first` with the same key (null when there is none).
    found = pc.index_in(second.column("_key"), value_set=first.column("_key").combine_chunks())
    shared_second = np.flatnonzero(found.is_valid().to_numpy(zero_copy_only=False))
    if not shared_second.size:
        return pa.concat_tables([first, second])
    shared_first = found.drop_null().to_numpy().astype(np.int64)
    lsn_first, position_first = _numpy(first.column("_lsn"))[shared_first], _numpy(first.column("_pos"))[shared_first]
    lsn_second, position_second = (_numpy(second.column("_lsn"))[shared_second],
                                    _numpy(second.column("_pos"))[shared_second])
    second_newer = (lsn_second > lsn_first) | ((lsn_second == lsn_first) & (position_second >= position_first))
    keep_first = np.ones(first.num_rows, bool)
    keep_first[shared_first[second_newer]] = False
    keep_second = np.ones(second.num_rows, bool)
    keep_second[shared_second[~second_newer]] = False
    return pa.concat_tables([_kept(first, keep_first), _kept(second, keep_second)])


def _kept(rows: pa.Table, keep: np.ndarray) -> pa.Table:
    return rows if keep.all() else rows.filter(pa.array(keep))


def with_version(rows: pa.Table) -> pa.Table:
    """Adds `_version` = naming.row_version(_lsn, _pos) as DECIMAL(38, 0), exact for any LSN."""
    shifted = pc.multiply(rows.column("_lsn").cast(pa.decimal128(19, 0)), pa.scalar(1 << 32, pa.decimal128(10, 0)))
    version = pc.add(shifted, rows.column("_pos").cast(pa.decimal128(19, 0))).cast(VERSION_TYPE)
    return rows.append_column(pa.field("_version", VERSION_TYPE), version)


def _numpy(column: pa.ChunkedArray) -> np.ndarray:
    return column.to_numpy() if column.null_count == 0 else column.fill_null(0).to_numpy()
