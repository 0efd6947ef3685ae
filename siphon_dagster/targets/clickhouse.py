"""The ClickHouse target: every version in a ReplacingMergeTree, current rows through a FINAL view.

All access is clickhouse-connect over HTTP, identical for the embedded local server and a real
ClickHouse. A batch is loaded as text into a staging table and converted by ClickHouse itself with
the type mapping's expressions, so the stream and snapshots share one conversion. The version rule
needs no read-modify-write: the table's version column decides, whatever the insertion order.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import clickhouse_connect
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from clickhouse_connect.driver.exceptions import ClickHouseError

from siphon_core.config import ClickHouseTargetConfig
from siphon_core.redaction import redact_url
from siphon_dagster.targets import clickhouse_digest as digest
from siphon_dagster.targets import clickhouse_sql as sql
from siphon_dagster.targets.base import (
    BucketDigest,
    SchemaChange,
    SourceColumn,
    TableSchema,
    TargetColumn,
    TargetError,
    TargetRow,
    VersionCounts,
    change_batch_schema,
)
from siphon_dagster.targets.type_mapping import clickhouse_type

KEYS_PER_LOOKUP = 5000
# Replacing versions is left to merges and to the view's FINAL: the same step run on every inserted
# block (optimize_on_insert) finds nothing to replace among one snapshot's rows, and costs about a
# third of the snapshot's insert.
SNAPSHOT_INSERT_SETTINGS = {"optimize_on_insert": 0}
# A folded micro-batch holds each key once: the same holds for its inserts.
BATCH_INSERT_SETTINGS = {"optimize_on_insert": 0, "max_insert_threads": 2, "max_threads": 2}


@dataclass(frozen=True)
class _SnapshotStages:
    text: str  # where the COPY text is inserted (a Null table)
    counts: str  # rows that reached it, per block
    typed: list[tuple[str, str]]  # (target, its stage with the target's structure)


class ClickHouseTarget:
    name = "clickhouse"

    def __init__(self, config: ClickHouseTargetConfig) -> None:
        self.config = config
        self.database = config.database
        self._client: Any = None

    # -- connection ------------------------------------------------------------------------------

    def _connect(self) -> Any:
        if self._client is None:
            url = urlparse(self.config.url)
            secure = url.scheme == "https"
            try:
                client = clickhouse_connect.get_client(
                    host=url.hostname or "127.0.0.1",
                    port=url.port or (8443 if secure else 8123),
                    username=self.config.username,
                    password=self.config.password,
                    secure=secure,
                    verify=self.config.verify,
                    ca_cert=self.config.ca_file if secure else None,
                )
                client.command(f"CREATE DATABASE IF NOT EXISTS {sql.quote(self.database)}")
            except Exception as error:  # connection errors come from urllib3 as well as the driver
                raise TargetError(
                    f"clickhouse: cannot reach {redact_url(self.config.url)} (database {self.database}): {error}; "
                    "check targets.clickhouse.url in siphon.yaml and that the server is running"
                ) from error
            self._client = client
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _names(self, table: TableSchema) -> sql.TableNames:
        return sql.TableNames(table=table, database=self.database)

    def _command(self, names: sql.TableNames, what: str, statement: str, parameters: dict | None = None,
                 settings: dict | None = None) -> Any:
        try:
            return self._connect().command(statement, parameters=parameters, settings=settings)
        except ClickHouseError as error:
            raise TargetError(names.describe(f"{what} failed: {error}")) from error

    def _rows(self, names: sql.TableNames, what: str, statement: str, parameters: dict | None = None) -> list:
        try:
            return self._connect().query(statement, parameters=parameters).result_rows
        except ClickHouseError as error:
            raise TargetError(names.describe(f"{what} failed: {error}")) from error

    # -- tables ----------------------------------------------------------------------------------

    def _table_columns(self, names: sql.TableNames, table_name: str) -> list[TargetColumn]:
        rows = self._rows(
            names,
            "reading columns",
            "SELECT name, type FROM system.columns WHERE database = {db:String} AND table = {t:String} ORDER BY position",
            {"db": self.database, "t": table_name},
        )
        return [TargetColumn(name, kind) for name, kind in rows]

    def _shadow_exists(self, names: sql.TableNames) -> bool:
        return bool(int(self._command(names, "looking for a resync table", f"EXISTS TABLE {names.shadow}")))

    def _write_targets(self, names: sql.TableNames) -> list[str]:
        # The resync table first, then the live one: a swap between the two writes leaves the rows
        # in the table that ends up live either way (see siphon_dagster.resync).
        return ([names.shadow] if self._shadow_exists(names) else []) + [names.live]

    def _write_each(self, names: sql.TableNames, targets: Sequence[str], write: Callable[[str], object]) -> None:
        for target in targets:
            try:
                write(target)
            except TargetError:
                # The resync table went (swapped in and dropped, or abandoned) after it was looked
                # up: the live write that follows reaches the table that is live now.
                if target == names.shadow and not self._shadow_exists(names):
                    continue
                raise

    def ensure_table(self, table: TableSchema, backfill: Mapping[str, str] | None = None) -> SchemaChange:
        sql.check_columns(table)
        names = self._names(table)
        change = SchemaChange()
        existing = {c.name: c.type for c in self._table_columns(names, names.table_name)}
        altered = False
        if not existing:
            self._command(names, "creating the table", sql.create_table(names.live, table))
            change.created = True
        else:
            self._check_key(names, change)
            targets = self._write_targets(names)
            backfill = backfill or {}
            for column in table.columns:
                alteration = self._alteration(column, existing.get(column.name), change, backfill.get(column.name))
                for target in targets if alteration else ():
                    self._command(names, f"altering column {column.name!r}", f"ALTER TABLE {target} {alteration}")
                altered = altered or alteration is not None
        view = [c.name for c in self._table_columns(names, names.view_name)]
        if altered or view != sql.view_columns(table):
            # New table, new or dropped source columns: the view lists exactly the source's columns.
            # A view keeps the column types it was created with, so an altered type remakes it too.
            self._command(names, "creating the truncations table", sql.create_truncations(names))
            self._command(names, "creating the current-rows view", sql.create_view(names))
        return change

    def _check_key(self, names: sql.TableNames, change: SchemaChange) -> None:
        rows = self._rows(
            names,
            "reading the sorting key",
            "SELECT name FROM system.columns WHERE database = {db:String} AND table = {t:String} "
            "AND is_in_sorting_key ORDER BY position",
            {"db": self.database, "t": names.table_name},
        )
        stored = sorted(row[0] for row in rows)
        source = sorted(c.name for c in names.table.key_columns)
        if stored != source:
            change.incompatible.append(
                f"primary key: the source's is {source}, the table is ordered by {stored}"
            )

    @staticmethod
    def _alteration(column: SourceColumn, current: str | None, change: SchemaChange,
                    backfill: str | None = None) -> str | None:
        """The ALTER TABLE clause that makes a column follow the source, or None."""
        expected = clickhouse_type(column)
        if current is None:
            change.added_columns.append(column.name)
            # Rows written before the column existed hold the backfill value, or NULL, where a NOT
            # NULL column's default (0, '') would invent one.
            nullable = expected if expected.startswith("Nullable(") else f"Nullable({expected})"
            return f"ADD COLUMN {sql.quote(column.name)} {nullable}{sql.backfill_default(column, backfill)}"
        if current in (expected, f"Nullable({expected})"):
            return None  # a column that became NOT NULL keeps accepting NULL: nothing to do
        if expected == f"Nullable({current})" and not column.primary_key:
            return f"MODIFY COLUMN {sql.column_definition(column)}"  # it became nullable
        widened = _widened(current, expected)
        if widened is not None and not column.primary_key:  # a sorting key column's type cannot change
            return f"MODIFY COLUMN {sql.quote(column.name)} {widened}"
        change.incompatible.append(
            f"{column.name}: source type {column.type_name} maps to {expected}, "
            f"the table has {current}"
        )
        return None

    def describe_columns(self, table: TableSchema) -> list[TargetColumn]:
        names = self._names(table)
        return self._table_columns(names, names.table_name)

    def drop_table(self, table: TableSchema) -> None:
        names = self._names(table)
        self._command(names, "dropping the view", f"DROP VIEW IF EXISTS {names.view}")
        for target in (names.live, names.shadow, names.truncations):
            self._command(names, "dropping a table", f"DROP TABLE IF EXISTS {target}")

    # -- writes ----------------------------------------------------------------------------------

    @contextmanager
    def _stage(self, names: sql.TableNames) -> Iterator[str]:
        stage = names.qualified(f"_siphon_stage_{uuid.uuid4().hex}")
        self._command(names, "creating a staging table", sql.create_stage(stage, names.table))
        try:
            yield stage
        finally:
            self._command(names, "dropping a staging table", f"DROP TABLE IF EXISTS {stage}")

    def apply_rows(self, table: TableSchema, rows: pa.Table) -> int:
        if rows.num_rows == 0:
            return 0
        names = self._names(table)
        expected = change_batch_schema(table)
        if rows.schema.names != expected.names:
            raise TargetError(names.describe(f"batch columns {rows.schema.names} differ from {expected.names}"))
        width = len(table.columns)
        # Staging names are positional; the version travels as text (ClickHouse parses it as UInt128).
        staged = pa.table(
            [rows.column(i) for i in range(width)]
            + [pc.cast(rows.column(width), pa.string()), pc.cast(rows.column(width + 1), pa.uint8())],
            names=[sql.stage_column(i) for i in range(width)] + [sql.STAGE_VERSION, sql.STAGE_DELETED],
        )
        with self._stage(names) as stage:
            try:
                self._connect().insert_arrow(stage, staged)
            except ClickHouseError as error:
                raise TargetError(names.describe(f"staging {rows.num_rows} rows failed: {error}")) from error
            self._write_each(names, self._write_targets(names), lambda target: self._command(
                names, "applying a batch", sql.insert_from_stage(target, stage, table), settings=BATCH_INSERT_SETTINGS))
        return rows.num_rows

    @contextmanager
    def _snapshot_stages(self, names: sql.TableNames, targets: list[str], version: int) -> Iterator[_SnapshotStages]:
        """A text stage whose materialized views convert into one typed stage per target and count
        the rows; everything is dropped on the way out."""
        base = f"_siphon_stage_{uuid.uuid4().hex}"
        stages = _SnapshotStages(names.qualified(base), names.qualified(f"{base}_rows"),
                                 [(target, names.qualified(f"{base}_{i}")) for i, target in enumerate(targets)])
        views = [names.qualified(f"{base}_count")] + [names.qualified(f"{base}_convert_{i}") for i in range(len(targets))]
        tables = [stages.text, stages.counts] + [typed for _, typed in stages.typed]
        try:
            self._command(names, "creating a staging table", sql.create_text_stage(stages.text, names.table))
            self._command(names, "creating a staging table", sql.create_counted_rows(stages.counts))
            self._command(names, "creating a staging view", sql.count_text_rows(views[0], stages.text, stages.counts))
            for (target, typed), view in zip(stages.typed, views[1:], strict=True):
                self._command(names, "creating a staging table", sql.create_typed_stage(typed, target))
                self._command(names, "creating a staging view",
                              sql.convert_text_stage(view, stages.text, base, typed, names.table, "siphon_version"),
                              {"siphon_version": version})
            yield stages
        except BaseException:
            # A load cut off mid-stream leaves its session busy at the server for a moment: the
            # clean-up below then runs in a new session instead of failing on the locked one.
            self.close()
            raise
        finally:
            for view in views:
                self._command(names, "dropping a staging view", f"DROP VIEW IF EXISTS {view}")
            for table in tables:
                self._command(names, "dropping a staging table", f"DROP TABLE IF EXISTS {table}")

    def apply_copy_text(
        self, table: TableSchema, chunks: Iterable[bytes], version: int, *, shadow: bool = False
    ) -> int:
        """The text streams into a Null table whose materialized views convert it, once, into a
        stage per target with the target's own structure; when every row is there the stages'
        parts are attached to the targets. Nothing of a partial load is ever applied."""
        names = self._names(table)
        sent = {"rows": 0, "unterminated": False}

        def counted() -> Iterator[bytes]:
            # The chunks stream straight into the HTTP request; only the row count is kept here.
            for chunk in chunks:
                if chunk:
                    sent["rows"] += _line_breaks(chunk)
                    sent["unterminated"] = not chunk.endswith(b"\n")
                    yield chunk

        targets = [names.shadow] if shadow else self._write_targets(names)
        columns = [sql.stage_column(i) for i in range(len(table.columns))]
        with self._snapshot_stages(names, targets, version) as stages:
            try:
                # PostgreSQL's COPY text escapes (\b \f \n \r \t \v \\ and \N for NULL) are the
                # escapes ClickHouse's TabSeparated reads, so the bytes need no rewriting.
                self._connect().raw_insert(stages.text, columns, insert_block=counted(), fmt="TabSeparated",
                                           settings=SNAPSHOT_INSERT_SETTINGS)
            except ClickHouseError as error:
                raise TargetError(names.describe(f"loading COPY text failed: {error}")) from error
            expected = sent["rows"] + (1 if sent["unterminated"] else 0)
            staged = int(self._rows(names, "counting staged rows",
                                    f"SELECT sum({sql.quote(sql.COUNTED_ROWS)}) FROM {stages.counts}")[0][0])
            if staged != expected:
                # A transport retry could resend only the rest of a stream: never apply a partial load.
                raise TargetError(names.describe(f"staged {staged} rows of {expected} sent; the snapshot must be retried"))
            typed_of = dict(stages.typed)
            self._write_each(names, targets, lambda target: self._command(
                names, "applying a snapshot", sql.attach_stage(target, typed_of[target])))
        return expected

    def tombstone_all(self, table: TableSchema, version: int) -> int:
        names = self._names(table)
        parameters = {"siphon_version": version}
        count = self._rows(
            names,
            "counting rows to tombstone",
            f"SELECT count() FROM {names.view} WHERE {sql.quote(sql.VERSION_COLUMN)} < {{siphon_version:UInt128}}",
            parameters,
        )[0][0]
        self._write_each(names, self._write_targets(names), lambda target: self._command(
            names, "tombstoning every row", sql.tombstone_keys(target, table, "siphon_version"), parameters))
        self._command(names, "recording the truncate", sql.record_truncation(names, "siphon_version"), parameters)
        return int(count)

    # -- reads -----------------------------------------------------------------------------------

    def read_current_values(
        self, table: TableSchema, keys: Sequence[tuple[str, ...]], columns: Sequence[str]
    ) -> dict[tuple[str, ...], dict[str, str | None]]:
        names = self._names(table)
        key_names = [c.name for c in table.key_columns]
        selected = sql.rendered_columns(table, key_names + list(columns))
        found: dict[tuple[str, ...], dict[str, str | None]] = {}
        for start in range(0, len(keys), KEYS_PER_LOOKUP):
            part = [list(key) for key in keys[start : start + KEYS_PER_LOOKUP]]
            rows = self._rows(
                names,
                "reading current values",
                f"SELECT {', '.join(selected)} FROM {names.view} WHERE {sql.key_filter(table, 'siphon_keys')}",
                {"siphon_keys": part},
            )
            for row in rows:
                found[tuple(row[: len(key_names)])] = dict(zip(columns, row[len(key_names) :], strict=True))
        return found

    def current_rows_as_text(self, table: TableSchema) -> list[tuple[str | None, ...]]:
        names = self._names(table)
        selected = sql.rendered_columns(table, list(table.column_names))
        statement = f"SELECT {', '.join(selected)} FROM {names.view} ORDER BY {sql.key_order(table)}"
        return [tuple(row) for row in self._rows(names, "reading current rows", statement)]

    def count_current(self, table: TableSchema) -> int:
        names = self._names(table)
        return int(self._rows(names, "counting current rows", f"SELECT count() FROM {names.view}")[0][0])

    def max_version(self, table: TableSchema) -> int:
        names = self._names(table)
        # As text: a UInt128 aggregate must not pass through a float anywhere on the way.
        statement = f"SELECT toString(max({sql.quote(sql.VERSION_COLUMN)})) FROM {names.live}"
        return int(self._rows(names, "reading the greatest version", statement)[0][0])

    # -- checks ----------------------------------------------------------------------------------

    @property
    def location(self) -> str:
        url = urlparse(self.config.url)
        return f"{url.scheme}://{url.hostname}{f':{url.port}' if url.port else ''} (database {self.database})"

    def expected_column_type(self, column: SourceColumn) -> str:
        return clickhouse_type(column)

    def column_type_matches(self, column: SourceColumn, stored: str) -> bool:
        # A column added later, or one that became NOT NULL, stays Nullable (see _alteration).
        expected = clickhouse_type(column)
        return stored in (expected, f"Nullable({expected})")

    def version_counts(self, table: TableSchema, version: int) -> VersionCounts:
        names = self._names(table)
        current, deleted = digest.version_counts(names)
        below, above = self._rows(names, "counting rows around a version", current, {"v": version})[0]
        tombstones = self._rows(names, "counting deletions after a version", deleted, {"v": version})[0][0]
        return VersionCounts(int(below), int(above), int(tombstones))

    def bucket_digests(self, table: TableSchema, digits: int) -> dict[str, BucketDigest]:
        names = self._names(table)
        rows = self._rows(names, "computing bucket digests", digest.bucket_digests(names), {"digits": digits})
        return {bucket: BucketDigest(int(count), value) for bucket, count, value in rows}

    def bucket_rows(self, table: TableSchema, digits: int,
                    buckets: Sequence[str]) -> dict[tuple[str, ...], TargetRow]:
        names = self._names(table)
        statement = digest.latest_rows(names, digest.bucket_filter(table))
        rows = self._rows(names, "reading rows of buckets", statement, {"digits": digits, "buckets": list(buckets)})
        return digest.target_rows(rows, len(table.key_columns))

    def key_rows(self, table: TableSchema, keys: Sequence[tuple[str, ...]]) -> dict[tuple[str, ...], TargetRow]:
        names = self._names(table)
        found: dict[tuple[str, ...], TargetRow] = {}
        for start in range(0, len(keys), KEYS_PER_LOOKUP):
            part = [list(key) for key in keys[start : start + KEYS_PER_LOOKUP]]
            statement = digest.latest_rows(names, sql.key_filter(table, "siphon_keys"))
            rows = self._rows(names, "reading rows by key", statement, {"siphon_keys": part})
            found.update(digest.target_rows(rows, len(table.key_columns)))
        return found

    def rows_after(self, table: TableSchema, version: int, limit: int) -> dict[tuple[str, ...], TargetRow]:
        names = self._names(table)
        statement = digest.latest_rows(names, digest.changed_after(names)) + " LIMIT {n:UInt64}"
        rows = self._rows(names, "reading rows changed after a version", statement, {"v": version, "n": limit + 1})
        return digest.target_rows(rows, len(table.key_columns))

    # -- resync ----------------------------------------------------------------------------------

    def create_shadow(self, table: TableSchema) -> None:
        sql.check_columns(table)
        names = self._names(table)
        self._command(names, "dropping an old resync table", f"DROP TABLE IF EXISTS {names.shadow}")
        self._command(names, "creating the resync table", sql.create_table(names.shadow, table))

    def swap_shadow(self, table: TableSchema) -> None:
        names = self._names(table)
        if not self._shadow_exists(names):
            raise TargetError(names.describe("no resync table to swap in; run create_shadow first"))
        try:
            # Atomic databases exchange both names in one step: readers see the old or the new table.
            self._connect().command(f"EXCHANGE TABLES {names.live} AND {names.shadow}")
        except ClickHouseError:
            # Ordinary databases cannot exchange; one RENAME statement moves both names.
            retired = names.qualified(f"{names.table_name}__retired_{uuid.uuid4().hex[:8]}")
            self._command(
                names,
                "swapping in the resync table",
                f"RENAME TABLE {names.live} TO {retired}, {names.shadow} TO {names.live}, {retired} TO {names.shadow}",
            )
        self._command(names, "dropping the previous table", f"DROP TABLE IF EXISTS {names.shadow}")
        self._command(names, "recreating the current-rows view", sql.create_view(names))

    def drop_shadow(self, table: TableSchema) -> None:
        names = self._names(table)
        self._command(names, "dropping the resync table", f"DROP TABLE IF EXISTS {names.shadow}")


def _line_breaks(chunk: bytes) -> int:
    # bytes.count looks at a byte at a time; a vectorized comparison counts a snapshot's gigabytes
    # of COPY text several times faster.
    return int(np.count_nonzero(np.frombuffer(chunk, dtype=np.uint8) == 0x0A))


# A source type widened in place (ALTER COLUMN ... TYPE bigint): every stored value fits the wider type.
_WIDER = {"Int16": ("Int32", "Int64"), "Int32": ("Int64",), "Float32": ("Float64",)}


def _widened(current: str, expected: str) -> str | None:
    """The column's new type, nullable as it is now, when `expected` widens `current`; else None."""
    def bare(kind: str) -> tuple[str, bool]:
        return (kind[len("Nullable("):-1], True) if kind.startswith("Nullable(") else (kind, False)

    stored, nullable = bare(current)
    wanted, _ = bare(expected)
    if wanted not in _WIDER.get(stored, ()):
        return None
    return f"Nullable({wanted})" if nullable else wanted
