"""fakesnow's server mode: a Snowflake-compatible endpoint for the real snowflake-connector-python."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from siphon_stack.process import port_accepts, start_process, stop_pid, wait_until

ACCOUNT = "fakesnow"
USER = "siphon"
PASSWORD = "siphon"


@dataclass
class FakesnowServer:
    root: Path
    port: int

    @property
    def log_path(self) -> Path:
        return self.root / "fakesnow.log"

    def start(self, timeout: float = 60.0) -> int:
        databases = self.root / "databases"
        databases.mkdir(parents=True, exist_ok=True)
        # fakesnow keeps a stage's files in a directory it makes under TMPDIR when imported and
        # never removes: inside the server's root, they go when the stack's directory goes.
        scratch = self.root / "tmp"
        scratch.mkdir(parents=True, exist_ok=True)
        process = start_process(
            "fakesnow",
            [sys.executable, "-m", "siphon_stack.fakesnow_server", "-s", "--host", "127.0.0.1", "-p", str(self.port), "-d", str(databases)],
            self.log_path,
            env={"TMPDIR": str(scratch)},
        )
        wait_until("fakesnow", lambda: port_accepts(self.port), timeout, pid=process.pid, log_path=self.log_path)
        return process.pid

    def environment(self) -> dict[str, str]:
        return {
            "SIPHON_SNOWFLAKE_ACCOUNT": ACCOUNT,
            "SIPHON_SNOWFLAKE_USER": USER,
            "SIPHON_SNOWFLAKE_PASSWORD": PASSWORD,
            "SIPHON_SNOWFLAKE_HOST": "127.0.0.1",
            "SIPHON_SNOWFLAKE_PORT": str(self.port),
            "SIPHON_SNOWFLAKE_PROTOCOL": "http",
        }

    @staticmethod
    def stop(pid: int) -> None:
        stop_pid(pid)
