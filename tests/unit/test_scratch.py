"""Where a batch's transient files go, and the sweep of those a killed run left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from siphon_dagster.streaming import scratch


@pytest.fixture
def gone_pid() -> int:
    """The id of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_batch_directory_is_made_in_memory_when_there_is_room_and_named_by_its_process(tmp_path):
    directory = scratch.batch_directory(memory_root=str(tmp_path), min_free_bytes=1)
    assert os.path.dirname(directory) == str(tmp_path)
    assert os.path.basename(directory).startswith(f"{scratch.PREFIX}{os.getpid()}-")
    assert scratch.sweep(str(tmp_path)) == []  # its process (this one) lives
    assert os.path.isdir(directory)


def test_without_room_in_memory_the_usual_temporary_directory_takes_the_batch(tmp_path):
    directory = scratch.batch_directory(memory_root=str(tmp_path), min_free_bytes=1 << 62)
    try:
        assert os.path.dirname(directory) == tempfile.gettempdir()
        assert not os.listdir(tmp_path)
    finally:
        os.rmdir(directory)


def test_a_missing_memory_file_system_is_no_error(tmp_path):
    directory = scratch.batch_directory(memory_root=str(tmp_path / "absent"), min_free_bytes=1)
    try:
        assert os.path.dirname(directory) == tempfile.gettempdir()
    finally:
        os.rmdir(directory)


def test_the_sweep_removes_only_directories_of_processes_that_are_gone(tmp_path, gone_pid):
    left = tmp_path / f"{scratch.PREFIX}{gone_pid}-abc"
    (left / "nested").mkdir(parents=True)
    (left / "nested" / "results.arrows").write_bytes(b"x" * 1000)
    live = tmp_path / f"{scratch.PREFIX}{os.getpid()}-def"
    live.mkdir()
    unrelated = [tmp_path / f"{scratch.PREFIX}notapid-x", tmp_path / f"{scratch.PREFIX}{gone_pid}",
                 tmp_path / f"other-{gone_pid}-x"]
    for path in unrelated:
        path.mkdir()

    assert scratch.sweep(str(tmp_path)) == [str(left)]
    assert not left.exists()
    assert live.is_dir() and all(path.is_dir() for path in unrelated)


def test_the_first_batch_directory_of_a_process_sweeps_its_root(tmp_path, gone_pid, monkeypatch):
    monkeypatch.setattr(scratch, "_swept", set())
    left = tmp_path / f"{scratch.PREFIX}{gone_pid}-abc"
    left.mkdir()
    scratch.batch_directory(memory_root=str(tmp_path), min_free_bytes=1)
    assert not left.exists()
    left.mkdir()
    scratch.batch_directory(memory_root=str(tmp_path), min_free_bytes=1)
    assert left.exists()  # once per process and root: a batch does not list the directory each time
