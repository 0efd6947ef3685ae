"""The lifecycle every SQL target shares, written once: tables and their current-rows view, the
version rule's writes to the live table and the resync's shadow, reads, the checks' reads, the
shadow's swap. A target supplies a dialect (`sql_dialect.SqlDialect`: how its SQL is spelled) and
the hooks below marked abstract: how it talks to its server, reads its catalog, follows a changed
source column, and loads rows (a change batch into a staging table, the staging table into a
table, a snapshot's COPY text into tables).
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa

from siphon_dagster.targets.base import (
    BucketDigest,
    ChangesAround,
    SchemaChange,
    SourceColumn,
    TableSchema,
    TargetColumn,
    TargetError,
    TargetRow,
    change_batch_schema,
)
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.sql_dialect import SqlDialect, check_columns, view_columns

_Item = TypeVar("_Item")

# How long a stream write whose live table was missing waits for it to come back: a swap by
# renames takes a few statements, well under a second.
LIVE_TABLE_RETURN_SECONDS = 10.0


@dataclass(frozen=True)
class StoredColumn:
    """A column as the target's catalog reports it."""

    name: str
    type: str  # the target's spelling, as `SqlDialect.described_type` gives it
    in_key: bool  # part of the stored table's key


def chunks(items: Sequence[_Item], size: int) -> Iterator[Sequence[_Item]]:
    """`items` in slices of at most `size`: the values one lookup statement binds."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def target_rows(rows: Iterable[Sequence[Any]], width: int) -> dict[tuple[str, ...], TargetRow]:
    """Rows of `SqlDialect.latest_rows` (key..., hash, version, deleted, latest truncation) by key;
    a row older than the latest TRUNCATE reads as deleted by it."""
    found = {}
    for row in rows:
        key = tuple(row[:width])
        digest, version, deleted, truncated = row[width], int(row[width + 1]), bool(row[width + 2]), int(row[width + 3] or 0)
        if version <= truncated:
            found[key] = TargetRow(None, truncated, True)
        else:
            found[key] = TargetRow(None if deleted else digest, version, deleted)
    return found


class SqlTarget(ABC):
    """`base.Target` for a SQL database, over the hooks of a subclass and its dialect."""

    dialect: SqlDialect
    driver_error: type[Exception]  # what the driver raises for a refused statement
    namespace: tuple[str, ...]  # where the tables live: the database, and the schema if any
    # How the last apply reached the staging table ("stage", "insert"; None where there is one
    # way), and the statements it ran: the streaming report and the benchmarks read them.
    last_load_path: str | None = None
    last_load_statements = 0
    _statements = 0
    _connection: Any = None
    # How long a stream write may trust an earlier lookup of the table's resync shadow (0: every
    # write looks). A resync waits longer than this between creating the shadow and reading its
    # first range (siphon_dagster.resync), so a write the shadow needs always finds it.
    shadow_lookup_seconds = 0.0
    superseded_rows_allowed = False  # see base.Target
    _shadows_seen: ShadowLookups | None = None  # shared with the target's siblings

    @property
    def name(self) -> str:
        return self.dialect.name

    # -- hooks: the server --------------------------------------------------------------------------

    @abstractmethod
    def _open(self) -> Any:
        """A new connection (client) to the target; TargetError naming the settings when unreachable."""

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the target is, for messages: its address without credentials."""

    @abstractmethod
    def _run(self, statement: str, params: Any, **options: Any) -> Any:
        """Runs a statement; the driver's own error when refused."""

    @abstractmethod
    def _query(self, statement: str, params: Any) -> list:
        """Runs a query and returns its rows; the driver's own error when refused."""

    @abstractmethod
    def _stored_columns(self, names: TableNames, name: str) -> list[StoredColumn]:
        """The columns of table or view `name` (bare), in order; none when it does not exist."""

    # -- hooks: schema changes and loads ------------------------------------------------------------

    @abstractmethod
    def _follow_column(self, names: TableNames, targets: Sequence[str], column: SourceColumn,
                       current: str | None, change: SchemaChange, backfill: str | None) -> bool:
        """Makes the tables' column (`current`: its stored type, None when missing) follow the
        source's, filling `change`; whether a table changed. `backfill` as in `ensure_table`."""

    def _load_batch(self, names: TableNames, staging: str, rows: pa.Table) -> None:
        """Fills the staging table with a change batch (`change_batch_schema`): a hook of the
        default `_write_batch`."""
        raise NotImplementedError

    def _apply_staged(self, names: TableNames, target: str, staging: str) -> None:
        """Applies the staging table's rows to `target` under the version rule: a hook of the
        default `_write_batch`."""
        raise NotImplementedError

    @abstractmethod
    def _load_snapshot(self, names: TableNames, chunks: Iterable[bytes], version: int, targets: Sequence[str]) -> int:
        """Applies COPY text, every row at `version`, to each of `targets` in order; rows applied."""

    # -- connection and statements --------------------------------------------------------------------------------

    def sibling(self) -> SqlTarget:
        """A target of the same configuration for another table of a streaming run; a target
        whose connections can serve many tables at once shares them with its siblings."""
        sibling = type(self)(self.config)  # type: ignore[call-arg, attr-defined]
        self._share_shadow_lookups(sibling)
        return sibling

    def _share_shadow_lookups(self, sibling: SqlTarget) -> None:
        """Siblings trust the same look-ups of resync tables for `shadow_lookup_seconds`."""
        sibling.shadow_lookup_seconds = self.shadow_lookup_seconds
        if self._shadows_seen is None:
            self._shadows_seen = ShadowLookups()
        sibling._shadows_seen = self._shadows_seen

    def _connect(self) -> Any:
        """The connection, opened on first use."""
        if self._connection is None:
            self._connection = self._open()
        return self._connection

    def ping(self) -> None:
        self._query("SELECT 1", None)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _names(self, table: TableSchema) -> TableNames:
        return TableNames(table=table, target=self.name, namespace=self.namespace, quote=self.dialect.quote)

    def _execute(self, names: TableNames, what: str, statement: str, params: Any = None, **options: Any) -> Any:
        """Runs a statement; a refusal becomes a TargetError naming the table and `what` was done."""
        self._statements += 1
        try:
            return self._run(statement, params, **options)
        except self.driver_error as error:
            raise TargetError(names.describe(f"{what} failed: {error}")) from error

    def _fetch(self, names: TableNames, what: str, statement: str, params: Any = None) -> list:
        self._statements += 1
        try:
            return self._query(statement, params)
        except self.driver_error as error:
            raise TargetError(names.describe(f"{what} failed: {error}")) from error

    # -- tables -------------------------------------------------------------------------------------

    def ensure_table(self, table: TableSchema, backfill: Mapping[str, str] | None = None) -> SchemaChange:
        check_columns(table)
        names = self._names(table)
        change = SchemaChange()
        stored = self._created_or_stored(names, table)
        altered = False
        if stored is None:
            change.created = True
        else:
            stored_key = sorted(c.name for c in stored if c.in_key)
            source_key = sorted(c.name for c in table.key_columns)
            if stored_key != source_key:
                change.incompatible.append(f"primary key: the source's is {source_key}, the table's is {stored_key}")
            existing = {c.name: c.type for c in stored}
            targets = self._write_targets(names)
            backfill = backfill or {}
            for column in table.columns:
                followed = self._follow_column(names, targets, column, existing.get(column.name), change,
                                               backfill.get(column.name))
                altered = followed or altered
        # A table made just now has no view of its columns yet (both statements make or replace).
        if change.created or altered or [c.name for c in self._stored_columns(names, names.bare("view"))] \
                != view_columns(table):
            # New table, new or dropped source columns: the view lists exactly the source's columns.
            # A view keeps the column types it was created with, so an altered type remakes it too.
            self._execute(names, "creating the truncations table", self.dialect.create_truncations(names))
            self._execute(names, "creating the current-rows view", self.dialect.create_view(names))
        return change

    def describe_columns(self, table: TableSchema) -> list[TargetColumn]:
        names = self._names(table)
        return [TargetColumn(c.name, c.type) for c in self._stored_columns(names, names.table_name)]

    def drop_table(self, table: TableSchema) -> None:
        names = self._names(table)
        self._execute(names, "dropping the view", f"DROP VIEW IF EXISTS {names.view}")
        for target in (names.live, names.shadow, names.truncations):
            self._execute(names, "dropping a table", f"DROP TABLE IF EXISTS {target}")

    def table_exists(self, table: TableSchema) -> bool:
        names = self._names(table)
        return self._table_exists(names, names.table_name)

    def _created_or_stored(self, names: TableNames, table: TableSchema) -> list[StoredColumn] | None:
        """The live table's stored columns, or None when it was missing and was made just now."""
        stored = self._stored_columns_if_exists(names, names.table_name)
        if stored:
            return stored
        self._execute(names, "creating the table", self.dialect.create_table(names.live, table))
        return None

    def _stored_columns_if_exists(self, names: TableNames, name: str) -> list[StoredColumn]:
        """`_stored_columns`; a target whose catalog query costs more than an existence test and
        grows with the number of tables asks whether the table exists first."""
        return self._stored_columns(names, name)

    def _table_exists(self, names: TableNames, name: str) -> bool:
        """Whether table `name` (bare) exists; a target with a cheaper test than reading its
        catalog's columns overrides this (it runs once per applied batch)."""
        return bool(self._stored_columns(names, name))

    def _shadow_exists(self, names: TableNames) -> bool:
        return self._table_exists(names, names.bare("shadow"))

    def _write_targets(self, names: TableNames, stream: bool = False) -> list[str]:
        # The resync table first, then the live one: a swap between the two writes leaves the rows
        # in the table that ends up live either way (see siphon_dagster.resync).
        exists = self._stream_shadow_exists(names) if stream else self._shadow_exists(names)
        return ([names.shadow] if exists else []) + [names.live]

    def _stream_shadow_exists(self, names: TableNames) -> bool:
        """`_shadow_exists`, trusted for `shadow_lookup_seconds`: a stream write looks it up at most
        that often per table. The time is taken before the lookup, so an answer is never older
        than it says; a write to a shadow gone since is skipped by `_write_shadow_again`. A target that
        can list its resync tables in one statement (`_listed_shadows`) answers every sibling's
        tables with that one statement: a run of 200 tables otherwise sent 20 look-ups a second."""
        if self.shadow_lookup_seconds <= 0:
            return self._shadow_exists(names)
        if self._shadows_seen is None:
            self._shadows_seen = ShadowLookups()
        return self._shadows_seen.exists(names.bare("shadow"), self.shadow_lookup_seconds,
                                         lambda: self._shadow_exists(names), lambda: self._listed_shadows(names))

    def _listed_shadows(self, names: TableNames) -> set[str] | None:
        """The bare names of every resync table in the table's namespace, or None when the target
        looks each one up on its own."""
        return None

    def _write_each(self, names: TableNames, targets: Sequence[str], write: Callable[[str], object]) -> None:
        for target in targets:
            try:
                write(target)
            except TargetError:
                if target == names.shadow:
                    self._write_shadow_again(names, write)
                    continue
                if target == names.live and self._live_table_back(names):
                    # A swap by renames (an engine without an atomic swap) leaves the live name
                    # empty for a moment: the write is tried once more against the table that is
                    # live now. The version rule makes the second write harmless; a lasting
                    # fault fails it the same way.
                    write(target)
                    continue
                raise

    def _write_shadow_again(self, names: TableNames, write: Callable[[str], object]) -> None:
        """After a failed write to the resync table. Gone since it was looked up (swapped in and
        dropped, or abandoned): skipped, the live write that follows reaches the table that is live
        now. Still there: written once more. A swap by renames puts the previous live table at the
        resync name between its last rename and the drop, so the name can be empty at the first
        write and taken at the look; a write to that table is dropped with it. A lasting fault
        fails the second write the same way."""
        if self._shadow_exists(names):
            try:
                write(names.shadow)
                return
            except TargetError:
                if self._shadow_exists(names):
                    raise
        if self._shadows_seen is not None:
            self._shadows_seen.gone(names.bare("shadow"))

    def _live_table_back(self, names: TableNames) -> bool:
        """Whether the live table exists, waiting up to `LIVE_TABLE_RETURN_SECONDS` for a swap by
        renames to put it back."""
        deadline = time.monotonic() + LIVE_TABLE_RETURN_SECONDS
        while True:
            if self._table_exists(names, names.table_name):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    # -- writes -------------------------------------------------------------------------------------

    @contextmanager
    def _staging_table(self, names: TableNames) -> Iterator[str]:
        """A staging table with the table's positional text columns, dropped on the way out."""
        staging = self.dialect.stage_reference(names, f"_siphon_stage_{uuid.uuid4().hex}")
        self._execute(names, "creating a staging table", self.dialect.create_stage(staging, names.table))
        try:
            yield staging
        finally:
            self._execute(names, "dropping a staging table", f"DROP TABLE IF EXISTS {staging}")

    def _write_staged(self, names: TableNames, staging: str, targets: Sequence[str]) -> None:
        self._write_each(names, targets, lambda target: self._apply_staged(names, target, staging))

    def apply_rows(self, table: TableSchema, rows: pa.Table) -> int:
        if rows.num_rows == 0:
            return 0
        names = self._names(table)
        expected = change_batch_schema(table)
        if rows.schema.names != expected.names:
            raise TargetError(names.describe(f"batch columns {rows.schema.names} differ from {expected.names}"))
        started = self._statements
        self._write_batch(names, rows, self._write_targets(names, stream=True))
        self.last_load_statements = self._statements - started
        return rows.num_rows

    def _write_batch(self, names: TableNames, rows: pa.Table, targets: Sequence[str]) -> None:
        """Writes a change batch to each of `targets`, in order, under the version rule. By default
        the batch is loaded into a staging table of its own (`_load_batch`) and applied from there
        (`_apply_staged`); a target that can send rows with their statement overrides this."""
        with self._staging_table(names) as staging:
            self._load_batch(names, staging, rows)
            self._write_staged(names, staging, targets)

    def apply_copy_text(
        self, table: TableSchema, chunks: Iterable[bytes], version: int, *, shadow: bool = False
    ) -> int:
        names = self._names(table)
        started = self._statements
        targets = [names.shadow] if shadow else self._write_targets(names)
        count = self._load_snapshot(names, chunks, version, targets)
        self.last_load_statements = self._statements - started
        return count

    def tombstone_all(self, table: TableSchema, version: int) -> int:
        names = self._names(table)
        count = self._fetch(names, "counting rows to tombstone", *self.dialect.count_older(names, version))[0][0]
        self._write_each(names, self._write_targets(names, stream=True), lambda target: self._execute(
            names, "tombstoning every row", *self.dialect.tombstone_all(target, table, version)))
        self._execute(names, "recording the truncate", *self.dialect.record_truncation(names, version))
        return int(count)

    # -- reads --------------------------------------------------------------------------------------

    def read_current_values(
        self, table: TableSchema, keys: Sequence[tuple[str, ...]], columns: Sequence[str]
    ) -> dict[tuple[str, ...], dict[str, str | None]]:
        names = self._names(table)
        width = len(table.key_columns)
        found: dict[tuple[str, ...], dict[str, str | None]] = {}
        for part in chunks(keys, self.dialect.keys_per_lookup):
            statement = self.dialect.current_values(names, part, columns)
            for row in self._fetch(names, "reading current values", *statement):
                found[tuple(row[:width])] = dict(zip(columns, row[width:], strict=True))
        return found

    def current_rows_as_text(self, table: TableSchema) -> list[tuple[str | None, ...]]:
        names = self._names(table)
        return [tuple(row) for row in self._fetch(names, "reading current rows", self.dialect.current_rows(names))]

    def count_current(self, table: TableSchema) -> int:
        names = self._names(table)
        return int(self._fetch(names, "counting current rows", f"SELECT COUNT(*) FROM {names.view}")[0][0])

    def max_version(self, table: TableSchema) -> int:
        names = self._names(table)
        # As text: a wide integer must not pass through a float anywhere on the way.
        value = self._fetch(names, "reading the greatest version", self.dialect.max_version(names))[0][0]
        return int(value) if value is not None else 0

    # -- checks -------------------------------------------------------------------------------------

    def expected_column_type(self, column: SourceColumn) -> str:
        return self.dialect.described_type(column)

    def column_type_matches(self, column: SourceColumn, stored: str) -> bool:
        return self.dialect.type_matches(column, stored)

    def changes_around(self, table: TableSchema, version: int, limit: int) -> ChangesAround:
        names = self._names(table)
        rows = self._fetch(names, "reading rows around a version", *self.dialect.changes_around(names, version, limit))
        counts, keys = self.dialect.read_changes_around(rows)
        return ChangesAround(counts, keys if len(keys) <= limit else None)

    def bucket_digests(self, table: TableSchema, digits: int) -> dict[str, BucketDigest]:
        names = self._names(table)
        rows = self._fetch(names, "computing bucket digests", self.dialect.bucket_digests(names, digits))
        return {bucket: BucketDigest(int(count), value) for bucket, count, value in rows}

    def bucket_rows(self, table: TableSchema, digits: int,
                    buckets: Sequence[str]) -> dict[tuple[str, ...], TargetRow]:
        names = self._names(table)
        found: dict[tuple[str, ...], TargetRow] = {}
        for part in chunks(buckets, self.dialect.keys_per_lookup):
            rows = self._fetch(names, "reading rows of buckets", *self.dialect.bucket_rows(names, digits, part))
            found.update(target_rows(rows, len(table.key_columns)))
        return found

    def key_rows(self, table: TableSchema, keys: Sequence[tuple[str, ...]]) -> dict[tuple[str, ...], TargetRow]:
        names = self._names(table)
        found: dict[tuple[str, ...], TargetRow] = {}
        for part in chunks(keys, self.dialect.keys_per_lookup):
            rows = self._fetch(names, "reading rows by key", *self.dialect.key_rows(names, part))
            found.update(target_rows(rows, len(table.key_columns)))
        return found

    # -- resync -------------------------------------------------------------------------------------

    def create_shadow(self, table: TableSchema) -> None:
        check_columns(table)
        names = self._names(table)
        self._execute(names, "dropping an old resync table", f"DROP TABLE IF EXISTS {names.shadow}")
        self._execute(names, "creating the resync table", self.dialect.create_table(names.shadow, table))

    def swap_shadow(self, table: TableSchema) -> None:
        names = self._names(table)
        if not self._shadow_exists(names):
            raise TargetError(names.describe("no resync table to swap in; run create_shadow first"))
        try:
            self._execute(names, "swapping in the resync table", self.dialect.swap(names))
        except TargetError:
            retired = names.qualified(f"{names.table_name}__retired_{uuid.uuid4().hex[:8]}")
            for statement in self.dialect.swap_by_renames(names, retired):
                self._execute(names, "swapping in the resync table by renames", statement)
        self._execute(names, "dropping the previous table", f"DROP TABLE IF EXISTS {names.shadow}")
        self._execute(names, "recreating the current-rows view", self.dialect.create_view(names))

    def drop_shadow(self, table: TableSchema) -> None:
        names = self._names(table)
        self._execute(names, "dropping the resync table", f"DROP TABLE IF EXISTS {names.shadow}")


class ShadowLookups:
    """What a target and its siblings last learnt of their resync tables, and when: one listing
    of every resync table of the namespace when the target can list them, else one answer per
    table. Used by a run's apply threads at once: each step is one dictionary or attribute
    operation, and two threads looking up at the same moment only look up twice."""

    def __init__(self) -> None:
        self._listing: tuple[float, frozenset[str]] | None = None
        self._each: dict[str, tuple[float, bool]] = {}

    def exists(self, shadow: str, trust_seconds: float, look_up: Callable[[], bool],
               list_all: Callable[[], set[str] | None]) -> bool:
        now = time.monotonic()
        listing = self._listing
        if listing is not None and now - listing[0] < trust_seconds:
            return shadow in listing[1]
        looked = self._each.get(shadow)
        if looked is not None and now - looked[0] < trust_seconds:
            return looked[1]
        listed = list_all()
        if listed is not None:
            self._listing = (now, frozenset(listed))
            return shadow in listed
        exists = look_up()
        self._each[shadow] = (now, exists)
        return exists

    def gone(self, shadow: str) -> None:
        """`shadow` was found gone: no write goes to it until it is looked up again."""
        now = time.monotonic()
        listing = self._listing
        if listing is not None:
            self._listing = (listing[0], listing[1] - {shadow})
        self._each[shadow] = (now, False)
