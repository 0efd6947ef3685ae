"""The demo's commands (the checks, `status`) each leave the lines of their latest run in their log,
not those of every demo the kept records saw before."""

import os
import sys
from pathlib import Path

from demo.run import _Commands


def test_a_commands_log_holds_its_latest_run_only(tmp_path: Path) -> None:
    log = tmp_path / "checks.log"
    commands = _Commands()
    for line in ("PASS  first demo", "PASS  second demo"):
        commands.run([sys.executable, "-c", f"print({line!r})"], dict(os.environ), log)
    assert log.read_text().splitlines() == ["PASS  second demo"]


def test_a_stopped_demo_runs_no_more_commands_and_keeps_the_last_log(tmp_path: Path) -> None:
    log = tmp_path / "status.log"
    commands = _Commands()
    commands.run([sys.executable, "-c", "print('OK')"], dict(os.environ), log)
    commands.stop()
    commands.run([sys.executable, "-c", "print('later')"], dict(os.environ), log)
    assert log.read_text().splitlines() == ["OK"]
