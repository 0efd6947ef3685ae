"""Loading a batch into Snowflake through files: Parquet written here, `PUT` to a temporary stage,
`COPY INTO` the batch's staging table (which removes the files: `PURGE = TRUE`).

The files carry the staging table's columns exactly as the INSERT path binds them: every source
value as PostgreSQL's text, the version as text, the delete flag as a boolean. The COPY only moves
that text into the staging table; the MERGE that follows converts it with the type mapping, the
same statement whichever way the rows arrived, so both paths store the same values.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from snowflake.connector.errors import Error as SnowflakeError

from siphon_dagster.run_liveness import is_gone, worker_identity
from siphon_dagster.targets.base import TableSchema
from siphon_dagster.targets.snowflake_sql import quote
from siphon_dagster.targets.sql_dialect import staging_names

# How a batch reached the target (a target's `last_load_path`): through a staging table filled
# from Parquet files or by INSERT, or as the VALUES of its MERGE.
STAGE_PATH = "stage"
INSERT_PATH = "insert"
VALUES_PATH = "values"

# Rows per Parquet row group, and per Arrow batch built from COPY text.
ROWS_PER_GROUP = 50_000
# A file is closed and PUT once this much Arrow data (uncompressed text) went into it: Snowflake
# loads the files of one COPY in parallel and advises 100-250 MB compressed per file; the local
# disk holds one file at a time.
FILE_BYTES = 256 * 1024 * 1024

# Snowflake's "SQL access control error: Insufficient privileges to operate on schema ...".
_ACCESS_CONTROL_ERRNO = 3001
_ACCESS_CONTROL_SQLSTATE = "42501"


def staging_batch(table: TableSchema, rows: pa.Table) -> pa.Table:
    """A change batch (`change_batch_schema`) under the staging table's column names, the version
    as text: a 96-bit integer is neither a bind type every client agrees on nor a Parquet integer."""
    arrays = [rows.column(i) for i in range(rows.num_columns)]
    version = len(table.columns)
    arrays[version] = pc.cast(arrays[version], pa.string())
    return pa.Table.from_arrays(arrays, names=staging_names(table))


def copy_text_batches(table: TableSchema, rows: Iterable[list[str | None]], version: int) -> Iterator[pa.Table]:
    """Rows of a snapshot range (values as text, all with one version) as staging batches of at
    most ROWS_PER_GROUP rows, so a range of any size is held here one group at a time."""
    width = len(table.columns)
    names = staging_names(table)
    version_text = str(version)
    pending: list[list[str | None]] = []

    def flush() -> pa.Table:
        columns = [pa.array([row[i] for row in pending], pa.string()) for i in range(width)]
        columns.append(pa.array([version_text] * len(pending), pa.string()))
        columns.append(pa.array([False] * len(pending), pa.bool_()))
        pending.clear()
        return pa.Table.from_arrays(columns, names=names)

    for values in rows:
        pending.append(values)
        if len(pending) >= ROWS_PER_GROUP:
            yield flush()
    if pending:
        yield flush()


def staged_rows(batches: Iterable[pa.Table]) -> Iterator[list]:
    """The rows of staging batches as bind parameters for the INSERT path."""
    for batch in batches:
        yield from (list(row) for row in zip(*(c.to_pylist() for c in batch.columns), strict=True))


@dataclass
class ParquetFiles:
    """Staging batches written as Parquet files of about FILE_BYTES of Arrow data each in
    `directory`; each complete file is handed to `ship` (which uploads, then deletes it)."""

    directory: Path
    ship: Callable[[Path], None]
    rows: int = 0
    files: int = 0
    _bytes: int = 0  # Arrow bytes in the open file
    _writer: pq.ParquetWriter | None = field(default=None, repr=False)
    _path: Path | None = field(default=None, repr=False)

    def write(self, batch: pa.Table) -> None:
        if self._writer is None:
            self._path = self.directory / f"part-{self.files:05d}.parquet"
            self._writer = pq.ParquetWriter(self._path, batch.schema)
        self._writer.write_table(batch, row_group_size=ROWS_PER_GROUP)
        self.rows += batch.num_rows
        self._bytes += batch.nbytes
        if self._bytes >= FILE_BYTES:
            self.finish()

    def finish(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        path, self._writer, self._path, self._bytes = self._path, None, None, 0
        self.files += 1
        if path is not None:
            self.ship(path)

    def abandon(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def new_stage_name() -> str:
    return f"siphon_load_{uuid.uuid4().hex}"


def new_load_directory() -> str:
    """A directory of the stage for one load: its files, and only its, are what the COPY reads."""
    return uuid.uuid4().hex


def create_stage(stage: str) -> str:
    # Temporary: dropped with the session, so a crashed process leaves no stage (nor files) behind.
    return f"CREATE TEMPORARY STAGE {quote(stage)}"


def _string_literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def put(local_file: Path, stage: str, directory: str) -> str:
    """Uploads one file. Parquet compresses its own pages, so the file travels as written."""
    return (f"PUT {_string_literal('file://' + str(local_file))} @{quote(stage)}/{directory}/ "
            "AUTO_COMPRESS = FALSE")


def copy_into(staging_table: str, table: TableSchema, stage: str, directory: str) -> str:
    """Moves a load's files into the staging table (a reference, quoted), column by column by name,
    as they are.

    `NULL_IF = ()`: no text stands for NULL (Parquet marks NULLs itself), so a value such as `\\N`
    stays text.
    """
    names = staging_names(table)
    kinds = ["VARCHAR"] * (len(names) - 1) + ["BOOLEAN"]
    selected = ", ".join(f"$1:{quote(name)}::{kind}" for name, kind in zip(names, kinds, strict=True))
    return (
        f"COPY INTO {staging_table} ({', '.join(quote(n) for n in names)}) "
        f"FROM (SELECT {selected} FROM @{quote(stage)}/{directory}/) "
        "FILE_FORMAT = (TYPE = PARQUET NULL_IF = ()) PURGE = TRUE"
    )


def is_missing_stage_privilege(error: SnowflakeError) -> bool:
    """The role may not create a stage in the schema (Snowflake's access control error)."""
    return error.errno == _ACCESS_CONTROL_ERRNO or error.sqlstate == _ACCESS_CONTROL_SQLSTATE


# (account, user, role, database, schema) where creating a stage was refused: every target of this
# process writing there uses INSERT from then on, and the refusal is logged once.
_refused: set[tuple[str, ...]] = set()


def stage_refused(location: tuple[str, ...]) -> bool:
    return location in _refused


def refuse_stage(location: tuple[str, ...]) -> bool:
    """Records a refusal; True the first time for `location` (when to warn)."""
    first = location not in _refused
    _refused.add(location)
    return first


# A batch's Parquet files wait in a local directory until each is PUT. A process killed outright
# leaves its directory, rows of the table included: each is named for the process that made it,
# and a later load removes those of processes that have ended.
LOCAL_PREFIX = "siphon-load-"
_swept: set[str] = set()


@contextmanager
def local_load_directory(parent: str | None) -> Iterator[Path]:
    """A new directory for one load's files under `parent` (the system's temporary directory when
    None), removed afterwards; the first in a process removes those dead processes left there."""
    parent = parent or tempfile.gettempdir()
    if parent not in _swept:
        _swept.add(parent)
        sweep_dead_load_directories(Path(parent))
    owner = worker_identity().replace(":", "_")
    with tempfile.TemporaryDirectory(prefix=f"{LOCAL_PREFIX}{owner}-", dir=parent) as local:
        yield Path(local)


def sweep_dead_load_directories(parent: Path) -> list[Path]:
    """Removes the load directories under `parent` whose process has ended; returns them."""
    removed = []
    for path in parent.glob(f"{LOCAL_PREFIX}*-*"):
        # siphon-load-<host>_<pid>_<start>-<random>: the random part has no '-'.
        parts = path.name[len(LOCAL_PREFIX):].rpartition("-")[0].rsplit("_", 2)
        if len(parts) != 3 or not parts[1].isdigit() or not path.is_dir():
            continue  # not named for a process (an older version's): left alone
        if is_gone(":".join(parts)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
