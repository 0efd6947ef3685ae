"""Runs' output is kept for the UI by `FileComputeLogManager` without mirror processes."""

from __future__ import annotations

import os
import subprocess
import sys

import dagster as dg
import pytest

from siphon_dagster.compute_logs import FileComputeLogManager, mirrored_to_file


@dg.op
def speaks() -> None:
    print("to stdout from the op")
    print("to stderr from the op", file=sys.stderr)


@dg.job(executor_def=dg.in_process_executor)
def speaking_job() -> None:
    speaks()


def test_a_run_keeps_its_output_for_the_ui_and_starts_no_process(tmp_path, monkeypatch) -> None:
    started: list[object] = []
    real_popen = subprocess.Popen

    def counting_popen(*args, **kwargs):
        started.append(args[0] if args else kwargs.get("args"))
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", counting_popen)
    overrides = {"compute_logs": {"module": "siphon_dagster.compute_logs", "class": "FileComputeLogManager",
                                  "config": {"base_dir": str(tmp_path / "logs")}}}
    with dg.instance_for_test(overrides=overrides) as instance:
        assert isinstance(instance.compute_log_manager, FileComputeLogManager)
        result = speaking_job.execute_in_process(instance=instance)
        assert result.success
        captured = [e for e in instance.all_logs(result.run_id) if e.dagster_event
                    and e.dagster_event.event_type_value == "LOGS_CAPTURED"]
        file_key = captured[0].dagster_event.logs_captured_data.file_key
        log_key = instance.compute_log_manager.build_log_key_for_run(result.run_id, file_key)
        data = instance.compute_log_manager.get_log_data(log_key)
    assert b"to stdout from the op" in data.stdout and b"to stderr from the op" in data.stderr
    assert not [a for a in started if "tail" in str(a) or "watch_orphans" in str(a)]


def test_without_base_dir_the_logs_go_under_dagster_home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    manager = FileComputeLogManager.from_config_value(None, {})
    assert manager._base_dir == os.path.join(str(tmp_path), "storage")  # noqa: SLF001
    monkeypatch.delenv("DAGSTER_HOME")
    with pytest.raises(ValueError, match="base_dir, or DAGSTER_HOME"):
        FileComputeLogManager.from_config_value(None, {})


def test_a_capture_still_shows_the_output_where_it_went_and_keeps_native_and_child_writes(tmp_path) -> None:
    path = tmp_path / "out.log"
    script = f"""
import os, subprocess, sys
from siphon_dagster.compute_logs import mirrored_to_file
with mirrored_to_file(sys.stdout, {str(path)!r}):
    print("from python", flush=True)
    os.write(1, b"from the descriptor\\n")
    subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
print("after the capture", flush=True)
"""
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    kept = path.read_text()
    for line in ("from python", "from the descriptor", "from a child"):
        assert line in shown and line in kept, (line, shown, kept)
    assert shown.endswith("after the capture\n") and "after the capture" not in kept


def test_a_capture_keeps_the_file_when_the_terminal_has_gone(tmp_path) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the terminal is gone: writes to it fail with EPIPE
    path = tmp_path / "out.log"
    with os.fdopen(write_end, "w") as gone, mirrored_to_file(gone, str(path)):
        gone.write("first\n")
        gone.flush()
        gone.write("second\n")
        gone.flush()
    assert path.read_text() == "first\nsecond\n"
