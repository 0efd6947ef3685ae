"""A stream batch's insert meets a server that closes the connection without answering.

The target sends a batch again, once, whether the driver was given it as bytes (a small batch, its
statement in front of the rows) or as the pieces of its Arrow stream (a large one, its
statement in the URL), which the driver does not send twice by itself. A proxy in front of the
embedded server reads one whole request and closes the connection, as a server restarting or
dropping an idle keep-alive connection does; the batch must then arrive, once, through the next
connection.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from siphon_dagster.targets.clickhouse import INLINE_STATEMENT_MAX_BYTES
from tests.integration.http_proxy import Proxy, clickhouse_target_via
from tests.integration.test_targets_version_rule import NOTES, batch, row


class DroppingProxy(Proxy):
    """Forwards HTTP/1.1 requests to `upstream`, one at a time per connection; after
    `drop_next(marker)`, the next request whose request line or statement (the first line of its
    body) holds `marker` is read whole and its connection closed without a response."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.dropped: list[bytes] = []  # the request lines of the requests dropped
        self._marker: bytes | None = None
        self._lock = threading.Lock()
        super().__init__(upstream)

    def drop_next(self, marker: bytes) -> None:
        with self._lock:
            self._marker = marker

    def forward(self, client: socket.socket, server: socket.socket) -> None:
        pending = b""
        while True:
            request, pending = _read_request(client, pending)
            if request is None:
                return
            line = request.split(b"\r\n", 1)[0]
            statement = request.split(b"\r\n\r\n", 1)[1].split(b"\n", 1)[0]
            with self._lock:
                drop = self._marker is not None and (self._marker in line or self._marker in statement)
                if drop:
                    self._marker = None
            if drop:
                self.dropped.append(line)
                client.shutdown(socket.SHUT_RDWR)
                return
            server.sendall(request)


def _read_request(client: socket.socket, pending: bytes) -> tuple[bytes | None, bytes]:
    """One request (head and a Content-Length body) and what arrived after it; None at the end."""
    while b"\r\n\r\n" not in pending:
        piece = client.recv(1 << 20)
        if not piece:
            return None, b""
        pending += piece
    head, rest = pending.split(b"\r\n\r\n", 1)
    fields = [line.lower() for line in head.split(b"\r\n")[1:]]
    assert not any(f.startswith(b"transfer-encoding:") for f in fields), "chunked bodies are not forwarded here"
    length = next((int(f.split(b":", 1)[1]) for f in fields if f.startswith(b"content-length:")), 0)
    while len(rest) < length:
        piece = client.recv(1 << 20)
        if not piece:
            return None, b""
        rest += piece
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


@pytest.fixture
def proxy(clickhouse_url: str) -> Iterator[DroppingProxy]:
    url = urlparse(clickhouse_url)
    started = DroppingProxy((url.hostname or "127.0.0.1", url.port or 8123))
    yield started
    started.close()


@pytest.mark.parametrize("second", ["second", "s" * (INLINE_STATEMENT_MAX_BYTES + 1000)], ids=["small", "large"])
def test_a_batch_whose_connection_the_server_closed_unanswered_is_sent_again_once(proxy: DroppingProxy,
                                                                                  unique_name: str, second: str) -> None:
    target = clickhouse_target_via(proxy, unique_name)
    try:
        target.ensure_table(NOTES)
        target.apply_rows(NOTES, batch(NOTES, [row(1, "first", 1, 10)]))  # the landing exists from here on

        proxy.drop_next(b"ArrowStream")
        target.apply_rows(NOTES, batch(NOTES, [row(2, second, 2, 11), row(1, "first, changed", 3, 12)]))

        assert len(proxy.dropped) == 1  # the landing's insert, read whole and not answered
        in_url = b"ArrowStream" in proxy.dropped[0]
        assert in_url == (len(second) > INLINE_STATEMENT_MAX_BYTES)  # where the statement went
        assert target.current_rows_as_text(NOTES) == [("1", "first, changed", "3"), ("2", second, "2")]
        client = target._connect()  # noqa: SLF001 - what the table holds, beyond its current view
        stored = client.query(f"SELECT count() FROM `{unique_name}`.`public__notes`").result_rows[0][0]
        assert stored == 3  # each version once: the dropped request wrote nothing
    finally:
        target.close()
