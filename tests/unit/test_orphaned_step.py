"""A streaming step whose run worker was killed stops (and, failing that, exits) instead of applying
the stream beside the run that replaces it. Real processes: a parent that starts the step's
stand-in, then is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.processes import alive

STEP = textwrap.dedent("""
    import os, sys, threading
    from siphon_dagster.run_liveness import stop_when_orphaned
    directory, obey, hang = sys.argv[1], sys.argv[2] == "obey", sys.argv[3] == "hang"
    stopped = threading.Event()
    def log(message):
        with open(os.path.join(directory, "log"), "a") as out:
            out.write(message + "\\n")
    with stop_when_orphaned(stopped.set if obey else (lambda: None), log, grace_seconds=1.0, interval_seconds=0.1,
                            linger_seconds=0.5):
        with open(os.path.join(directory, "ready"), "w") as out:
            out.write(str(os.getpid()))
        stopped.wait(60)
    with open(os.path.join(directory, "stopped"), "w") as out:
        out.write("yes")
    if hang:  # what runs on the way out waits forever (a thread the interpreter joins at exit)
        threading.Thread(target=threading.Event().wait).start()
""")
WORKER = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
    time.sleep(120)
""")


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize(("obey", "hang"), [(True, False), (True, True), (False, False)],
                         ids=["stops", "stops_then_exits_though_its_way_out_hangs", "exits_after_grace"])
def test_a_step_stops_when_its_run_worker_is_killed(tmp_path: Path, obey: bool, hang: bool) -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER, STEP, str(tmp_path), "obey" if obey else "ignore",
                               "hang" if hang else "end"], start_new_session=True)
    try:
        _wait_for(lambda: (tmp_path / "ready").exists() and (tmp_path / "ready").read_text(), 60, "the step to start")
        step = int((tmp_path / "ready").read_text())
        time.sleep(0.3)
        assert alive(step) and not (tmp_path / "stopped").exists()  # nothing happens while the worker lives

        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()

        _wait_for(lambda: not alive(step), 30, "the step to end")
        log = (tmp_path / "log").read_text()
        assert f"the run's worker process {worker.pid} is gone" in log
        if obey:
            assert (tmp_path / "stopped").read_text() == "yes"  # left its work the ordinary way
        else:
            assert "exiting" in log and not (tmp_path / "stopped").exists()
    finally:
        # The worker leads its own process group: whatever is left of the pair goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
    time.sleep(120)
""")


def test_a_step_stops_when_the_process_that_started_its_run_worker_dies(tmp_path: Path) -> None:
    # launcher (`dagster dev`) -> worker (its code server, which outlives it) -> step
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER, STEP, str(tmp_path), "obey", "end"],
                                start_new_session=True)
    try:
        _wait_for(lambda: (tmp_path / "ready").exists() and (tmp_path / "ready").read_text(), 60, "the step to start")
        step = int((tmp_path / "ready").read_text())
        time.sleep(0.3)
        assert alive(step) and not (tmp_path / "stopped").exists()

        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()

        _wait_for(lambda: not alive(step), 30, "the step to end")
        assert f"process {launcher.pid}, which started the run's worker" in (tmp_path / "log").read_text()
        assert (tmp_path / "stopped").read_text() == "yes"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
