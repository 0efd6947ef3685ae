"""A snapshot range whose text arrives short at ClickHouse is never applied.

A snapshot's COPY text streams to the server as a chunked body. A proxy in front of the embedded
server forwards such a body but leaves out one of its chunks, as a transport that resent only the
rest of a stream would: the server takes the lines it got and answers as if all were there. The
target compares the stage's rows with the lines it sent and must refuse the range whole.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from siphon_dagster.targets.base import TargetError
from tests.integration.http_proxy import Proxy, clickhouse_target_via
from tests.integration.test_targets_version_rule import NOTES, batch, row


class ChunkDroppingProxy(Proxy):
    """Forwards every request to `upstream` as it comes, except that the second chunk of a chunked
    body whose request line holds `marker` is left out."""

    def __init__(self, upstream: tuple[str, int], marker: bytes) -> None:
        self.marker = marker
        self.dropped_chunks = 0
        super().__init__(upstream)

    def forward(self, client: socket.socket, server: socket.socket) -> None:
        with client.makefile("rb") as reader:
            while head := _read_head(reader):
                server.sendall(head)
                fields = [line.lower() for line in head.split(b"\r\n")[1:]]
                if b"transfer-encoding: chunked" in fields:
                    self._forward_chunks(reader, server, drop_second=self.marker in head.split(b"\r\n", 1)[0])
                else:
                    length = next((int(f.split(b":", 1)[1]) for f in fields if f.startswith(b"content-length:")), 0)
                    server.sendall(reader.read(length))

    def _forward_chunks(self, reader: object, server: socket.socket, drop_second: bool) -> None:
        index = 0
        while True:
            size_line = reader.readline()  # type: ignore[attr-defined]
            size = int(size_line.split(b";")[0], 16)
            data = reader.read(size + 2)  # type: ignore[attr-defined]  # the chunk and its CRLF
            if size == 0:
                server.sendall(size_line + data)
                return
            index += 1
            if drop_second and index == 2:
                self.dropped_chunks += 1
                continue
            server.sendall(size_line + data)


def _read_head(reader: object) -> bytes:
    lines = []
    while True:
        line = reader.readline()  # type: ignore[attr-defined]
        if not line:
            return b""
        lines.append(line)
        if line == b"\r\n":
            return b"".join(lines)


@pytest.fixture
def proxy(clickhouse_url: str) -> Iterator[ChunkDroppingProxy]:
    url = urlparse(clickhouse_url)
    started = ChunkDroppingProxy((url.hostname or "127.0.0.1", url.port or 8123), marker=b"TabSeparated")
    yield started
    started.close()


def test_a_snapshot_range_that_reached_the_server_short_is_refused_and_nothing_of_it_applied(
        proxy: ChunkDroppingProxy, unique_name: str) -> None:
    target = clickhouse_target_via(proxy, unique_name)
    try:
        target.ensure_table(NOTES)
        target.apply_rows(NOTES, batch(NOTES, [row(1, "streamed", 1, 10)]))
        chunks = [f"{key}\tsnapshot\t{key}\n".encode() for key in range(2, 8)]  # one line per chunk

        with pytest.raises(TargetError, match="staged 5 rows of 6 sent"):
            target.apply_copy_text(NOTES, iter(chunks), 20)

        assert proxy.dropped_chunks == 1
        assert target.current_rows_as_text(NOTES) == [("1", "streamed", "1")]
        client = target._connect()  # noqa: SLF001 - the database's tables, beyond the target's view
        tables = [name for (name,) in client.query(f"SHOW TABLES FROM `{unique_name}`").result_rows]
        assert not [name for name in tables if "_siphon_stage_" in name]  # the stage went with the range
    finally:
        target.close()
