"""The embedded ClickHouse server (`siphon-clickhouse`) as a real subprocess for tests: started on a
free loopback port, stopped by the process id we started."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import clickhouse_connect
import pytest
from clickhouse_connect.driver.client import Client

from siphon_stack.process import free_port, start_process, stop_pid, wait_until


@dataclass
class EmbeddedClickHouse:
    data_dir: Path
    log_path: Path
    port: int = 0
    pid: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        process = start_process("siphon-clickhouse", self.argv(), self.log_path)
        self.pid = process.pid
        wait_until("siphon-clickhouse", self.ping, 60.0, pid=self.pid, log_path=self.log_path)

    def argv(self, port: int | None = None) -> list[str]:
        return [sys.executable, "-m", "siphon_stack.clickhouse_server", "--data-dir", str(self.data_dir),
                "--port", str(port or self.port)]  # fmt: skip

    def stop(self) -> None:
        stop_pid(self.pid)

    def ping(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/ping", timeout=1) as response:
                return response.read() == b"Ok.\n"
        except OSError:
            return False

    def client(self, **kwargs: object) -> Client:
        return clickhouse_connect.get_client(host="127.0.0.1", port=self.port, **kwargs)


def running_server(root: Path) -> Iterator[EmbeddedClickHouse]:
    server = EmbeddedClickHouse(root / "data", root / "clickhouse.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", name="embedded_clickhouse")
def embedded_clickhouse_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedClickHouse]:
    yield from running_server(tmp_path_factory.mktemp("embedded_clickhouse"))
