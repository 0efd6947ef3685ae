"""The pieces of a Snowflake stage load that need no server: staging batches, Parquet files and
the statements (run on fakesnow in tests/integration/test_snowflake_stage_load.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from siphon_dagster.targets import snowflake_stage as stage
from siphon_dagster.targets.base import SourceColumn, TableSchema, change_batch_schema

TABLE = TableSchema("public", 'odd "name"', (
    SourceColumn("Key", 20, "bigint", nullable=False, primary_key=True),
    SourceColumn('we"ird', 17, "bytea"),
))


def test_a_change_batch_is_staged_under_positional_names_with_its_version_as_text() -> None:
    schema = change_batch_schema(TABLE)
    rows = pa.table([pa.array(["1", "2"]), pa.array(["\\x00ff", None]),
                     pa.array([10, (0xFFFFFFFF_FFFFFFFF << 32) | 7], schema.field(2).type), pa.array([False, True])],
                    schema=schema)
    staged = stage.staging_batch(TABLE, rows)
    assert staged.column_names == ["c0", "c1", "_v", "_d"]
    assert staged.column("_v").to_pylist() == ["10", "79228162514264337589248983047"]
    assert list(stage.staged_rows([staged])) == [["1", "\\x00ff", "10", False],
                                                 ["2", None, "79228162514264337589248983047", True]]


def test_copy_rows_become_batches_of_at_most_one_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage, "ROWS_PER_GROUP", 2)
    batches = list(stage.copy_text_batches(TABLE, iter([["1", None], ["2", "\\x"], ["3", ""]]), 42))
    assert [b.num_rows for b in batches] == [2, 1]
    assert batches[1].to_pylist() == [{"c0": "3", "c1": "", "_v": "42", "_d": False}]


def test_files_are_cut_by_size_and_each_shipped_once_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage, "FILE_BYTES", 1)
    shipped: list[pa.Table] = []
    files = stage.ParquetFiles(tmp_path, lambda path: shipped.append(pq.read_table(path)))
    for first in (0, 3):
        files.write(pa.table({"c0": [str(first + i) for i in range(3)]}))
    files.finish()
    assert (files.rows, files.files) == (6, 2)
    assert [t.column("c0").to_pylist() for t in shipped] == [["0", "1", "2"], ["3", "4", "5"]]


def test_statements_quote_every_name_and_keep_text_as_text() -> None:
    assert stage.create_stage('my "stage"') == 'CREATE TEMPORARY STAGE "my ""stage"""'
    assert stage.put(Path("/tmp/it's/part-00000.parquet"), "s", "d1") == (
        "PUT 'file:///tmp/it\\'s/part-00000.parquet' @\"s\"/d1/ AUTO_COMPRESS = FALSE")
    assert stage.copy_into('"t"', TABLE, "s", "d1") == (
        'COPY INTO "t" ("c0", "c1", "_v", "_d") FROM (SELECT $1:"c0"::VARCHAR, $1:"c1"::VARCHAR, '
        '$1:"_v"::VARCHAR, $1:"_d"::BOOLEAN FROM @"s"/d1/) FILE_FORMAT = (TYPE = PARQUET NULL_IF = ()) PURGE = TRUE')


def test_a_load_directory_is_named_for_its_process_and_a_later_load_removes_those_of_ended_ones(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from siphon_dagster.run_liveness import worker_identity

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    left = tmp_path / f"{stage.LOCAL_PREFIX}{worker_identity(ended.pid).replace(':', '_')}-abc123"
    left.mkdir()
    (left / "batch-0.parquet").write_bytes(b"rows of the table")
    foreign = tmp_path / f"{stage.LOCAL_PREFIX}other-host_{ended.pid}_123-x1"  # another machine's: not ours
    older = tmp_path / f"{stage.LOCAL_PREFIX}k2j3h4"  # named for no process
    for path in (foreign, older):
        path.mkdir()
    with stage.local_load_directory(str(tmp_path)) as local:
        assert local.name.startswith(f"{stage.LOCAL_PREFIX}{socket.gethostname()}_")
        assert not left.exists()
        assert foreign.exists() and older.exists()
        # This process's own directory is alive: another sweep keeps it.
        assert stage.sweep_dead_load_directories(tmp_path) == []
        assert local.exists()
    assert not local.exists()
