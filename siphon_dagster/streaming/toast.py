"""Unchanged TOASTed values of folded rows, filled on the driver.

PostgreSQL does not send a TOASTed value that an UPDATE left unchanged; the target must keep the
stored value, never NULL (DESIGN.md, section 3). For each such value of a folded row, in order:
1. the batch's earlier changes of the key, or of the old key when the row comes from a
   primary-key update (followed back through chains of key updates);
2. the target's current row of that key, when the batch does not reach back far enough;
3. the source, re-read by the row's own primary key: what it holds now is at least as new.
The batch history is read back from Spark only for the keys concerned, and only when a folded
row has such values, so batches without them pay nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from siphon_core.logs import get_logger
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.tuple_data import decode_tuple
from siphon_dagster.streaming.decode import value_column
from siphon_dagster.streaming.source_rows import SourceRowReader
from siphon_dagster.targets.base import TableSchema, Target

_log = get_logger("streaming.toast")
# Decoded rows (with `_version`) of the given keys, with the value columns at the given positions:
# the batch history a lineage is followed through.
HistoryReader = Callable[[list[bytes], list[int]], pa.Table]
_MAX_KEY_UPDATE_CHAIN = 64


class UnchangedValueError(RuntimeError):
    """An unchanged TOASTed value has nowhere to come from; the message names the table and key."""


@dataclass
class ToastStats:
    from_batch: int = 0
    from_target: int = 0
    from_source: int = 0
    missing_at_source: int = 0

    @property
    def total(self) -> int:
        return self.from_batch + self.from_target + self.from_source + self.missing_at_source


@dataclass
class _Request:
    row: int  # index of the folded row being filled
    positions: set[int]
    key: bytes | None  # the key whose stored row supplies the values; None: re-read from the source
    before: Decimal | None = None  # follow the key's batch history below this version


@dataclass
class _Fills:
    values: dict[int, dict[int, str | None]] = field(default_factory=lambda: defaultdict(dict))
    stats: ToastStats = field(default_factory=ToastStats)
    # Rows the source no longer holds under their key: they are left out of the batch (see _from_source).
    dropped: set[int] = field(default_factory=set)


def fill_unchanged(folded: pa.Table, table: TableSchema, target: Target, source: SourceRowReader | None,
                   history: HistoryReader) -> tuple[pa.Table, ToastStats]:
    """`folded` as `fold.fold` returns it, values already cast to strings; returns it filled."""
    # Rows are picked out vectorized: most batches have none, and their rows are many.
    marked = pc.and_(pc.greater(pc.fill_null(pc.list_value_length(folded.column("_unchanged")), 0), 0),
                     pc.not_equal(folded.column("_op"), pa.scalar(pb.DELETE, pa.int8())))
    rows = np.flatnonzero(marked.to_numpy(zero_copy_only=False)).tolist() if folded.num_rows else []
    if not rows:
        return folded, ToastStats()
    unchanged = folded.column("_unchanged").to_pylist()
    keys = folded.column("_key").to_pylist()
    versions = folded.column("_version").to_pylist()
    resets = folded.column("_reset").to_pylist()
    origins = folded.column("_origin").to_pylist()
    fills = _Fills()
    lineage: list[_Request] = []
    fresh: list[_Request] = []
    for r in rows:
        if not resets[r]:
            lineage.append(_Request(r, set(unchanged[r]), keys[r], versions[r]))  # earlier changes of the key
        elif origins[r] is not None:
            lineage.append(_Request(r, set(unchanged[r]), origins[r], versions[r]))  # the old key's row
        else:
            fresh.append(_Request(r, set(unchanged[r]), None))  # an insert under an older column list
    stored = _follow_lineage(lineage, history, fills)
    fresh += _from_target(stored, table, target, fills)
    _from_source(fresh, keys, table, source, fills)
    patched = _patch(folded, fills.values)
    if fills.dropped:
        keep = [r not in fills.dropped for r in range(patched.num_rows)]
        patched = patched.filter(pa.array(keep, pa.bool_()))
    return patched, fills.stats


def _follow_lineage(requests: list[_Request], history: HistoryReader, fills: _Fills) -> list[_Request]:
    """Follows each old key's batch history back from the key update; returns what is still open."""
    open_requests: list[_Request] = []
    for _ in range(_MAX_KEY_UPDATE_CHAIN):
        if not requests:
            return open_requests
        keys = sorted({r.key for r in requests if r.key is not None})
        by_key = _history_by_key(history(keys, sorted(set().union(*(r.positions for r in requests)))))
        following: list[_Request] = []
        for request in requests:
            rest = _walk(request, by_key.get(request.key, []), fills)  # type: ignore[arg-type]
            if rest is not None:
                (following if rest.before is not None else open_requests).append(rest)
        requests = following
    raise UnchangedValueError(f"a chain of more than {_MAX_KEY_UPDATE_CHAIN} primary-key updates in one batch")


def _walk(request: _Request, rows: list[dict[str, Any]], fills: _Fills) -> _Request | None:
    """Fills what the key's history (newest first) knows below `request.before`; returns the rest."""
    positions = set(request.positions)
    for row in rows:
        if row["_version"] >= request.before:
            continue
        if row["_op"] == pb.DELETE:
            return _Request(request.row, positions, None)  # not possible before an update; ask the source
        unchanged = set(row["_unchanged"] or ())
        for position in positions - unchanged:
            raw = row[value_column(position)]
            fills.values[request.row][position] = None if raw is None else raw.decode()
            fills.stats.from_batch += 1
        positions &= unchanged
        if not positions:
            return None
        if row["_reset"]:
            if row["_origin"] is None:
                return _Request(request.row, positions, None)
            return _Request(request.row, positions, row["_origin"], row["_version"])
    # The lineage reaches back before the batch: the stored row of this key holds the values.
    return _Request(request.row, positions, request.key)


def _history_by_key(rows: pa.Table) -> dict[bytes, list[dict[str, Any]]]:
    by_key: dict[bytes, list[dict[str, Any]]] = defaultdict(list)
    for row in rows.to_pylist():
        by_key[row["_key"]].append(row)
    for versions in by_key.values():
        versions.sort(key=lambda row: row["_version"], reverse=True)
    return by_key


def _from_target(requests: list[_Request], table: TableSchema, target: Target, fills: _Fills) -> list[_Request]:
    """Fills from the target's current rows; returns the requests the target has no row for."""
    asked = [r for r in requests if r.key is not None and r.positions]
    missing = [r for r in requests if r.key is None and r.positions]
    if not asked:
        return missing
    names = [c.name for c in table.columns]
    columns = sorted({names[p] for r in asked for p in r.positions})
    current = target.read_current_values(table, list(dict.fromkeys(_key_text(r.key) for r in asked)), columns)  # type: ignore[arg-type]
    for request in asked:
        row = current.get(_key_text(request.key))  # type: ignore[arg-type]
        if row is None:
            missing.append(request)
            continue
        for position in request.positions:
            fills.values[request.row][position] = row.get(names[position])
            fills.stats.from_target += 1
    return missing


def _from_source(requests: list[_Request], keys: Sequence[bytes], table: TableSchema,
                 source: SourceRowReader | None, fills: _Fills) -> None:
    """Re-reads by each folded row's own key (the row as the source holds it now)."""
    if not requests:
        return
    names = [c.name for c in table.columns]
    if source is None:
        example = _key_text(keys[requests[0].row])
        raise UnchangedValueError(
            f"table {table.schema}.{table.table}: {len(requests)} row(s) (e.g. key {example}) carry unchanged "
            "TOASTed values that neither the batch nor the target holds, and no source DSN was given to re-read "
            "them; configure source.dsn for the streaming run")
    columns = sorted({names[p] for r in requests for p in r.positions})
    current = source.read_rows(table, [_key_text(keys[r.row]) for r in requests], columns)
    gone: list[tuple[str, ...]] = []
    for request in requests:
        row = current.get(_key_text(keys[request.row]))
        if row is None:
            # The key was deleted or changed since this change: that later change is in the stream
            # with a greater version and supersedes this one. Writing the row now would store an
            # unknown value that a later primary-key update could copy, so the row is left out.
            gone.append(_key_text(keys[request.row]))
            fills.dropped.add(request.row)
            fills.stats.missing_at_source += len(request.positions)
            continue
        for position in request.positions:
            fills.values[request.row][position] = row[names[position]]
            fills.stats.from_source += 1
    if gone:
        _log.info("changes of rows no longer at the source left out; later changes supersede them",
                  table=f"{table.schema}.{table.table}", rows=len(gone), keys=gone[:5])


def _patch(folded: pa.Table, values: dict[int, dict[int, str | None]]) -> pa.Table:
    by_position: dict[int, dict[int, str | None]] = defaultdict(dict)
    for row, filled in values.items():
        for position, value in filled.items():
            by_position[position][row] = value
    for position, filled in by_position.items():
        name = value_column(position)
        column = folded.column(name).to_pylist()
        for row, value in filled.items():
            column[row] = value
        index = folded.schema.get_field_index(name)
        folded = folded.set_column(index, name, pa.array(column, pa.string()))
    return folded


def _key_text(key: bytes) -> tuple[str, ...]:
    values, _ = decode_tuple(key)
    return tuple(None if v is None else bytes(v).decode() for v in values)  # type: ignore[arg-type, misc]
