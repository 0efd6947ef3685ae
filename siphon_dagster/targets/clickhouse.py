"""The ClickHouse target: every version in a ReplacingMergeTree, current rows through a FINAL view.

All access is clickhouse-connect over HTTP, identical for the embedded local server and a real
ClickHouse. A batch is sent as text (a small one as an external table of its statement, a large
one into a staging table) and converted by ClickHouse itself with the type mapping's expressions,
so the stream and snapshots share one conversion. The version rule
needs no read-modify-write: the table's version column decides, whatever the insertion order.
The lifecycle is `sql_target.SqlTarget`'s; this module is ClickHouse's hooks.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

import clickhouse_connect
import numpy as np
import pyarrow as pa
from clickhouse_connect.driver.exceptions import ClickHouseError, OperationalError
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from siphon_core.config import ClickHouseTargetConfig
from siphon_core.logs import get_logger
from siphon_core.redaction import redact_url
from siphon_dagster.targets import clickhouse_batch
from siphon_dagster.targets import clickhouse_sql as sql
from siphon_dagster.targets.base import (
    SHADOW_SUFFIX,
    ChangesAround,
    SchemaChange,
    SourceColumn,
    TableSchema,
    TargetError,
    VersionCounts,
)
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.sql_target import SqlTarget, StoredColumn
from siphon_dagster.targets.thread_connections import ConnectionPerThread
from siphon_dagster.targets.type_mapping import clickhouse_type

_log = get_logger("targets.clickhouse")
_T = TypeVar("_T")
# How ClickHouse names an error about a setting it will not take.
_SETTING_REFUSALS = ("UNKNOWN_SETTING", "SETTING_CONSTRAINT_VIOLATION", "READONLY_SETTING", "Unknown setting")

# Replacing versions is left to merges and to the view's FINAL: the same step run on every inserted
# block (optimize_on_insert) finds nothing to replace among one snapshot's rows, and costs about a
# third of the snapshot's insert.
# A NULL in a column that holds none (a NOT NULL source column) reads as the type's default,
# as the type mapping's conversion (`ifNull`) makes it.
SNAPSHOT_INSERT_SETTINGS = {"optimize_on_insert": 0, "input_format_null_as_default": 1}
# A folded micro-batch holds each key once, or a few rows of a key that the greatest version settles
# (`superseded_rows_allowed`): replacing at insert would only do what merges and FINAL do. A NULL in a column
# that holds none becomes the type's default (`clickhouse_batch`), whatever the server's default.
BATCH_INSERT_SETTINGS = {"optimize_on_insert": 0, "input_format_null_as_default": 1, "max_insert_threads": 2,
                         "max_threads": 2}
TABLE_ALREADY_EXISTS = 57  # ClickHouse's error code
# A change batch of up to this many rows is inserted on one thread: its one block gains nothing
# from a second, and handing it between two cost the embedded ClickHouse about 5% more CPU per
# insert (200 tables, 10-row batches), which a run of hundreds of tables pays on every batch.
SMALL_BATCH_ROWS = 10_000
SMALL_BATCH_INSERT_SETTINGS = {**BATCH_INSERT_SETTINGS, "max_insert_threads": 1, "max_threads": 1}
# Up to this size a batch's insert carries its statement in front of the rows (one copy of them),
# beyond it in the URL (`_write_batch`).
INLINE_STATEMENT_MAX_BYTES = 1 << 20


def batch_insert_settings(rows: int) -> dict[str, int]:
    """The settings of a change batch's insert."""
    return SMALL_BATCH_INSERT_SETTINGS if rows <= SMALL_BATCH_ROWS else BATCH_INSERT_SETTINGS


@dataclass(frozen=True)
class _SnapshotStages:
    columns: list[str]  # what the COPY text's fields are inserted as (`sql.snapshot_input`)
    typed: list[tuple[str, str]]  # (target, its stage), the first one taking the text


class ClickHouseTarget(SqlTarget):
    dialect = sql.dialect
    driver_error = ClickHouseError
    # ReplacingMergeTree keeps each key's greatest version, in a part and across parts alike.
    superseded_rows_allowed = True

    def __init__(self, config: ClickHouseTargetConfig, shared: ConnectionPerThread | None = None) -> None:
        self.config = config
        self.dialect = sql.ClickHouseDialect(config.table_settings)
        self.database = config.database
        self.namespace = (config.database,)
        self._shared = shared  # the clients of the target this one is a sibling of
        self._sibling_clients: ConnectionPerThread | None = None  # the clients this target's siblings share
        # The conversions of the last table written (a run's target serves one table).
        self._batch_plan: clickhouse_batch.BatchPlan | None = None
        # The database's table names when the first of a run's tables was made sure of, shared by
        # the siblings (`_created_or_stored`); None for a target of its own.
        self._tables_at_start: TablesAtStart | None = None

    def sibling(self) -> ClickHouseTarget:
        """A target of the same server for another table of a streaming run: its statements go
        through clients shared by every sibling, one per thread. Their requests all carry the
        batch settings (a small batch's insert one thread fewer), so a server session seldom
        switches settings between statements."""
        if self._sibling_clients is None:
            self._sibling_clients = ConnectionPerThread(lambda: self._open(settings=BATCH_INSERT_SETTINGS))
        sibling = ClickHouseTarget(self.config, shared=self._sibling_clients)
        sibling.dialect = self.dialect  # a default table setting the server refuses is left out once for all
        self._share_shadow_lookups(sibling)
        if self._tables_at_start is None:
            self._tables_at_start = TablesAtStart()
        sibling._tables_at_start = self._tables_at_start
        return sibling

    def close(self) -> None:
        if self._shared is not None:
            self._connection = None  # the clients belong to the target this one is a sibling of
            return
        super().close()
        if self._sibling_clients is not None:
            self._sibling_clients.close()
            self._sibling_clients = None

    # -- connection ------------------------------------------------------------------------------

    def _connect(self) -> Any:
        return self._shared.connection() if self._shared is not None else super()._connect()

    def _open(self, settings: dict[str, Any] | None = None) -> Any:
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
                settings=settings,
            )
            client.command(f"CREATE DATABASE IF NOT EXISTS {sql.quote(self.database)}")
        except Exception as error:  # connection errors come from urllib3 as well as the driver
            raise TargetError(
                f"clickhouse: cannot reach {redact_url(self.config.url)} (database {self.database}): {error}; "
                "check targets.clickhouse.url in siphon.yaml and that the server is running"
            ) from error
        return client

    @property
    def location(self) -> str:
        url = urlparse(self.config.url)
        return f"{url.scheme}://{url.hostname}{f':{url.port}' if url.port else ''} (database {self.database})"

    def _run(self, statement: str, params: Any, settings: dict | None = None) -> Any:
        return self._connect().command(statement, parameters=params, settings=settings)

    def _query(self, statement: str, params: Any) -> list:
        return self._connect().query(statement, parameters=params).result_rows

    def _stored_columns(self, names: TableNames, name: str) -> list[StoredColumn]:
        rows = self._fetch(
            names,
            "reading columns",
            "SELECT name, type, is_in_sorting_key FROM system.columns "
            "WHERE database = {db:String} AND table = {t:String} ORDER BY position",
            {"db": self.database, "t": name},
        )
        return [StoredColumn(column, kind, bool(in_key)) for column, kind, in_key in rows]

    def _table_exists(self, names: TableNames, name: str) -> bool:
        # From the database's metadata: several times faster than a query of system.columns.
        return bool(int(self._execute(names, "looking for a table", f"EXISTS TABLE {names.qualified(name)}")))

    def _created_or_stored(self, names: TableNames, table: TableSchema) -> list[StoredColumn] | None:
        """A run's tables skip the question whether they exist (`TablesAtStart`). One the
        database had when the run began has its columns read at once (a run started again after
        a kill asked it of every table). One it did not have is made at once: of the six
        statements that make a table that question was the slowest while a run of hundreds of new
        tables made them sixteen at a time. One made since (by a snapshot) refuses, and is then
        read as any existing table; one dropped since is looked for and made as before."""
        listing = self._tables_at_start
        if listing is None:
            return super()._created_or_stored(names, table)
        if listing.had(names.table_name, lambda: self._table_names(names)):
            return self._stored_columns(names, names.table_name) or super()._created_or_stored(names, table)
        try:
            self._execute(names, "creating the table", self.dialect.create_table(names.live, table, if_not_exists=False))
            listing.made(names.table_name)
            return None
        except TargetError as error:
            if not _already_exists(error.__cause__):
                raise
        return super()._created_or_stored(names, table)

    def _table_names(self, names: TableNames) -> frozenset[str]:
        rows = self._fetch(names, "listing the database's tables",
                           "SELECT name FROM system.tables WHERE database = {db:String}", {"db": self.database})
        return frozenset(name for (name,) in rows)

    def _stored_columns_if_exists(self, names: TableNames, name: str) -> list[StoredColumn]:
        # system.columns lists every table of the database before it filters (8 ms each at 500
        # tables, 4.7 at 100): a run's first batches of hundreds of new tables paid it twice each.
        return self._stored_columns(names, name) if self._table_exists(names, name) else []

    def _listed_shadows(self, names: TableNames) -> set[str] | None:
        rows = self._fetch(names, "looking for resync tables",
                           "SELECT name FROM system.tables WHERE database = {db:String} AND endsWith(name, {s:String})",
                           {"db": self.database, "s": SHADOW_SUFFIX})
        return {name for (name,) in rows}

    # -- schema changes --------------------------------------------------------------------------

    def _follow_column(self, names: TableNames, targets: Sequence[str], column: SourceColumn,
                       current: str | None, change: SchemaChange, backfill: str | None) -> bool:
        alteration = self._alteration(column, current, change, backfill)
        for target in targets if alteration else ():
            self._execute(names, f"altering column {column.name!r}", f"ALTER TABLE {target} {alteration}")
        return alteration is not None

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
            return f"MODIFY COLUMN {sql.dialect.column_definition(column)}"  # it became nullable
        widened = _widened(current, expected)
        if widened is not None and not column.primary_key:  # a sorting key column's type cannot change
            return f"MODIFY COLUMN {sql.quote(column.name)} {widened}"
        change.incompatible.append(
            f"{column.name}: source type {column.type_name} maps to {expected}, "
            f"the table has {current}"
        )
        return None

    # -- checks ----------------------------------------------------------------------------------

    def changes_around(self, table: TableSchema, version: int, limit: int) -> ChangesAround:
        """Counted through the view (FINAL) first, several times cheaper than grouping every key:
        that read is consistent when the rows at or below the version are as many after the keys
        were read as before (once the stream passed the version, every write is above it, so a
        key leaving them lowers the count). When the stream moved it, the one-scan read decides."""
        names = self._names(table)
        before = self._quick_counts(names, version)
        keys = [tuple(row) for row in self._fetch(names, "reading the keys changed after a version",
                                                  *self.dialect.changed_keys(names, version, limit))]
        if self._quick_counts(names, version).at_or_below == before.at_or_below:
            return ChangesAround(before, keys if len(keys) <= limit else None)
        return super().changes_around(table, version, limit)

    def _quick_counts(self, names: TableNames, version: int) -> VersionCounts:
        below, above, tombstones = (
            int(value)
            for statement in self.dialect.quick_counts(names, version)
            for value in self._fetch(names, "counting rows around a version", *statement)[0]
        )
        return VersionCounts(below, above, tombstones)

    # -- tables ----------------------------------------------------------------------------------

    def ensure_table(self, table: TableSchema, backfill: Mapping[str, str] | None = None) -> SchemaChange:
        return self._with_table_settings(lambda: super(ClickHouseTarget, self).ensure_table(table, backfill))

    def create_shadow(self, table: TableSchema) -> None:
        self._with_table_settings(lambda: super(ClickHouseTarget, self).create_shadow(table))

    def _with_table_settings(self, make: Callable[[], _T]) -> _T:
        """`make()`, which creates tables with `table_settings`. A setting the server refuses is an
        error when siphon.yaml gives it; one of Siphon's defaults is left out, with one warning, and
        the tables are made again without it."""
        while True:
            try:
                return make()
            except TargetError as error:
                refused = _refused_settings(error, self.dialect.table_settings)
                if not refused:
                    raise
                if "table_settings" in self.config.model_fields_set:
                    raise TargetError(f"{error}; the server refuses the table setting(s) {refused}: set "
                                      "targets.clickhouse.table_settings in siphon.yaml without them ({} for none)") from error
                _log.warning("the server refuses table settings Siphon sets by default: tables are made without them",
                             server=self.location, settings=refused)
                for name in refused:
                    self.dialect.table_settings.pop(name, None)

    def drop_table(self, table: TableSchema) -> None:
        names = self._names(table)
        # Landing tables and their views: how earlier versions inserted stream batches.
        landings = self._fetch(names, "listing landing tables",
                               "SELECT name FROM system.tables WHERE database = {db:String} AND startsWith(name, {p:String})"
                               " AND NOT endsWith(name, '_view')",
                               {"db": self.database, "p": f"{names.table_name}{sql.LANDING_INFIX}"})
        for (bare,) in landings:
            self._execute(names, "dropping a landing view", f"DROP VIEW IF EXISTS {names.qualified(bare + '_view')}")
            self._execute(names, "dropping a landing table", f"DROP TABLE IF EXISTS {names.qualified(bare)}")
        super().drop_table(table)

    # -- loads -----------------------------------------------------------------------------------

    def _write_batch(self, names: TableNames, rows: pa.Table, targets: Sequence[str]) -> None:
        """One insert of the batch's typed columns into each target (`clickhouse_batch`): the
        statement names its columns, so a writer still on an older column list keeps writing
        when another has added one."""
        plan = self._batch_plan
        if plan is None or (plan.table is not names.table and plan.table != names.table):
            plan = self._batch_plan = clickhouse_batch.plan_for(names.table)
        typed = plan.typed(rows)
        # A small batch goes out as one bytes object with the statement in front of the rows: for a
        # small batch of a wide table, the statement in the URL, which the HTTP library escapes
        # character by character, took half the client's time of an insert (1.5 ms, 0.75 ms in the
        # body). A large one goes as its stream's pieces, the statement in the URL.
        small = typed.get_total_buffer_size() <= INLINE_STATEMENT_MAX_BYTES
        body: bytes | ArrowStream = _arrow_stream_bytes(typed) if small else ArrowStream.of(typed)
        settings = batch_insert_settings(typed.num_rows)
        self._write_each(names, targets, lambda target: self._insert_typed(names, target, typed.column_names, body,
                                                                           settings))

    def _insert_typed(self, names: TableNames, target: str, columns: list[str], body: bytes | ArrowStream,
                      settings: dict[str, int]) -> None:
        self._statements += 1
        # The driver no longer sends a body again on a connection the server closed, so that is done
        # here: a batch's rows carry their versions, and one applied twice changes nothing.
        try:
            for attempt in Retrying(retry=retry_if_exception_type(OperationalError), stop=stop_after_attempt(2),
                                    reraise=True):
                with attempt:
                    if isinstance(body, ArrowStream):
                        # A list of pieces is sent piece by piece, and again whole on a retry; its
                        # length given, without chunked encoding's copy of each piece.
                        self._connect().raw_insert(target, columns, insert_block=list(body.pieces), settings=settings,
                                                   fmt="ArrowStream", transport_settings={"Content-Length": str(body.size)})
                    else:
                        self._connect().raw_insert(target, columns, insert_block=body, settings=settings,
                                                   fmt="ArrowStream")
        except ClickHouseError as error:
            raise TargetError(names.describe(f"applying a batch to {target} failed: {error}")) from error

    @contextmanager
    def _snapshot_stages(self, names: TableNames, targets: Sequence[str], version: int) -> Iterator[_SnapshotStages]:
        """A stage per target, the first one taking the COPY text; all are dropped on the way out."""
        base = f"_siphon_stage_{uuid.uuid4().hex}"
        typed = [(target, names.qualified(f"{base}_{i}")) for i, target in enumerate(targets)]
        made: list[str] = []
        try:
            for target, stage in typed:
                self._execute(names, "creating a staging table", sql.create_snapshot_stage(stage, target))
                made.append(stage)
            reading = sql.snapshot_input(typed[0][1], names.table, version)
            self._execute(names, "preparing a staging table", reading.alteration)
            yield _SnapshotStages(reading.columns, typed)
        except BaseException:
            # A load cut off mid-stream leaves its session busy at the server for a moment: the
            # clean-up below then runs in a new session instead of failing on the locked one.
            self.close()
            raise
        finally:
            for stage in made:
                self._execute(names, "dropping a staging table", f"DROP TABLE IF EXISTS {stage}")

    def _load_snapshot(self, names: TableNames, chunks: Iterable[bytes], version: int, targets: Sequence[str]) -> int:
        """The text streams into a stage with the first target's structure, converted as it is
        parsed (`sql.snapshot_input`), and is copied from there into the other targets' stages;
        when every row is there the stages' parts are attached to the targets. Nothing of a
        partial load is ever applied."""
        sent = {"rows": 0, "unterminated": False}

        def counted() -> Iterator[bytes]:
            # The chunks stream straight into the HTTP request; only the row count is kept here.
            for chunk in chunks:
                if chunk:
                    sent["rows"] += _line_breaks(chunk)
                    sent["unterminated"] = not chunk.endswith(b"\n")
                    yield chunk

        with self._snapshot_stages(names, targets, version) as stages:
            first = stages.typed[0][1]
            try:
                # PostgreSQL's COPY text escapes (\b \f \n \r \t \v \\ and \N for NULL) are the
                # escapes ClickHouse's TabSeparated reads, so the bytes need no rewriting.
                self._connect().raw_insert(first, stages.columns, insert_block=counted(), fmt="TabSeparated",
                                           settings=SNAPSHOT_INSERT_SETTINGS)
            except ClickHouseError as error:
                raise TargetError(names.describe(f"loading COPY text failed: {error}")) from error
            expected = sent["rows"] + (1 if sent["unterminated"] else 0)
            # Rows of one snapshot have distinct keys and one version, so no merge of the stage
            # can have collapsed any: its count is what arrived.
            staged = int(self._fetch(names, "counting staged rows", f"SELECT count() FROM {first}")[0][0])
            if staged != expected:
                # A transport retry could resend only the rest of a stream: never apply a partial load.
                raise TargetError(names.describe(f"staged {staged} rows of {expected} sent; the snapshot must be retried"))
            for _, stage in stages.typed[1:]:
                self._execute(names, "copying a staged snapshot", sql.copy_stage(stage, first, names.table))
            typed_of = dict(stages.typed)
            self._write_each(names, targets, lambda target: self._execute(
                names, "applying a snapshot", sql.attach_stage(target, typed_of[target])))
        return expected


class TablesAtStart:
    """The database's table names, read once by the first of a run's tables to need them, and the
    tables the run made since: a hint only (a table missing from it may have been made by another
    process since, one in it dropped since)."""

    def __init__(self) -> None:
        self._names: set[str] | None = None
        self._lock = threading.Lock()

    def had(self, table: str, read: Callable[[], frozenset[str]]) -> bool:
        with self._lock:  # the run's first batches ask at once: one reads, the others wait for it
            if self._names is None:
                self._names = set(read())
            return table in self._names

    def made(self, table: str) -> None:
        """`table` was made by the run: later schema changes read it as an existing one."""
        with self._lock:
            if self._names is not None:
                self._names.add(table)


def _refused_settings(error: TargetError, settings: Iterable[str]) -> list[str]:
    """The settings a statement was refused for: named by the server's error for an unknown setting
    or one its profile does not allow (a syntax error may quote a statement's settings too)."""
    text = str(error)
    if not any(reason in text for reason in _SETTING_REFUSALS):
        return []
    return [name for name in settings if name in text]


def _already_exists(error: BaseException | None) -> bool:
    return isinstance(error, ClickHouseError) and (getattr(error, "code", None) == TABLE_ALREADY_EXISTS
                                                   or "(TABLE_ALREADY_EXISTS)" in str(error))


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


def _arrow_stream_bytes(table: pa.Table) -> bytes:
    """A small table as one Arrow IPC stream: 17 us for ten rows of 30 columns, where gathering
    `ArrowStream`'s pieces took 81, and writing the stream twice to size its buffer first 32."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class ArrowStream:
    """A table as an Arrow IPC stream, kept as the pieces the writer emits: the columns' own buffers
    (not copied) and the small messages between them.

    Written whole into one new buffer instead, a batch of about 100 MB now and then met memory the
    process had not touched for a while, and the copy took 1.1 - 1.3 s where it otherwise took
    0.02 - 0.04 s (a 2,000,000-change backlog of notes-shaped rows on the 2-core machine of the
    benchmarks, whose host hands such memory back and takes seconds to fault it in again)."""

    # Messages and padding the writer emits between buffers are gathered into pieces of at least
    # this many bytes, so that a socket is not sent thousands of 8-byte writes.
    SMALL_PIECE_BYTES = 64 << 10

    def __init__(self) -> None:
        self.pieces: list[bytes | memoryview] = []
        self.size = 0
        self._small: list[bytes] = []
        self._small_size = 0

    @classmethod
    def of(cls, table: pa.Table) -> ArrowStream:
        stream = cls()
        with pa.ipc.new_stream(pa.PythonFile(stream, mode="w"), table.schema) as writer:
            writer.write_table(table)
        stream._end_small()
        return stream

    def joined(self) -> bytes:
        return b"".join(self.pieces)

    # -- the file-like object pyarrow writes to -------------------------------------------------------

    def write(self, data: Any) -> int:
        size = len(data)
        self.size += size
        if size < self.SMALL_PIECE_BYTES:
            self._small.append(bytes(data))
            self._small_size += size
            if self._small_size >= self.SMALL_PIECE_BYTES:
                self._end_small()
        else:
            self._end_small()
            self.pieces.append(memoryview(data))
        return size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def _end_small(self) -> None:
        if self._small:
            self.pieces.append(b"".join(self._small))
            self._small, self._small_size = [], 0
