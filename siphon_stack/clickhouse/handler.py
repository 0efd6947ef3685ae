"""ClickHouse's HTTP interface on top of the engine: one request runs one statement."""

from __future__ import annotations

import base64
import hmac
import json
import secrets
import socket
import ssl
import sys
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import chain
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from siphon_stack.clickhouse.engine import Connection, Engine, Result
from siphon_stack.clickhouse.protocol import (
    ClickHouseError,
    ExternalTable,
    RequestBody,
    RequestOptions,
    content_type,
    decoded,
    external_tables,
    form_fields,
    identifier,
    request_options,
)
from siphon_stack.clickhouse.sql import (
    InlineInsert,
    client_file_clause,
    find_inline_insert,
    leading_keyword,
    output_format,
    query_inline_insert,
)

# How much of a body is scanned for an INSERT's SQL before its data streams on: the SQL sits at the
# front, and ClickHouse's own limit for it (max_query_size) is 256 KiB.
SQL_PREFIX_SIZE = 256 << 10
_SELECT_KEYWORDS = frozenset({"SELECT", "WITH", "(", "FROM"})  # chdb streams results of these only
_RESULT_KEYWORDS = _SELECT_KEYWORDS | {"SHOW", "DESCRIBE", "DESC", "EXISTS", "EXPLAIN", "CHECK"}
# What a GET may not run: ClickHouse gives GET requests readonly=2.
_MODIFYING_KEYWORDS = frozenset(
    {"INSERT", "CREATE", "DROP", "ALTER", "TRUNCATE", "RENAME", "EXCHANGE", "OPTIMIZE", "SYSTEM", "DELETE",
     "UPDATE", "ATTACH", "DETACH", "UNDROP", "GRANT", "REVOKE", "KILL", "BACKUP", "RESTORE", "MOVE"}
)  # fmt: skip
# Formats whose output for a whole result is the concatenation of their output per block, so blocks
# can be sent as chdb produces them. Other formats (JSON, Arrow, Parquet, ...) wrap a result in a
# header and footer and are sent once complete.
_STREAMED_FORMATS = frozenset(
    {"Native", "RowBinary", "TabSeparated", "TSV", "TabSeparatedRaw", "TSVRaw", "CSV", "JSONEachRow",
     "JSONLines", "NDJSON", "JSONCompactEachRow", "JSONStringsEachRow"}
)  # fmt: skip
# Names chdb's Python API turns into Python objects; a ClickHouse server knows no such formats.
_PYTHON_FORMATS = frozenset({"dataframe", "arrowtable", "datastore", "debug"})


@dataclass(frozen=True)
class Credentials:
    """The one user the server accepts, as ClickHouse's HTTP interface takes it: basic authentication
    or the X-ClickHouse-User/X-ClickHouse-Key headers."""

    user: str
    password: str = field(repr=False)

    def accepts(self, headers: dict[str, str], params: dict[str, str]) -> tuple[bool, str]:
        """Whether the request logs in as this user, and the user name it gave."""
        user, password = params.get("user"), params.get("password")
        if "x-clickhouse-user" in headers:
            user, password = headers["x-clickhouse-user"], headers.get("x-clickhouse-key", "")
        authorization = headers.get("authorization", "")
        if authorization[:6].lower() == "basic ":
            try:
                user, _, password = base64.b64decode(authorization[6:], validate=True).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return False, "?"
        user = user or "default"
        right = hmac.compare_digest(user.encode(), self.user.encode()) & hmac.compare_digest(
            (password or "").encode(), self.password.encode())
        return right, user


class ClickHouseHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], engine: Engine, credentials: Credentials | None = None,
                 tls: ssl.SSLContext | None = None):
        super().__init__(address, ClickHouseHandler)
        self.engine = engine
        self.display_name = socket.gethostname()
        self.credentials = credentials
        self.tls = tls

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = super().get_request()
        if self.tls is not None:
            # The handshake runs in the request's own thread (on first read), so a slow or
            # plain-text client holds up no one else.
            connection = self.tls.wrap_socket(connection, server_side=True, do_handshake_on_connect=False)
        return connection, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ssl.SSLError, ConnectionError, TimeoutError)):
            # A client that does not speak TLS, or hung up: one line, not a traceback.
            print(f"siphon-clickhouse: connection from {client_address[0]} dropped: {type(error).__name__}",
                  file=sys.stderr, flush=True)
            return
        super().handle_error(request, client_address)


@dataclass
class Reply:
    """What is left to send once the engine is done. It goes out after the session is released:
    a client sends the session's next query as soon as it has read the answer."""

    headers: list[tuple[str, str]] | None  # None once a streamed answer's headers are out
    payload: Any = b""
    result: Result | None = None  # owns the payload's memory


@dataclass
class Statement:
    """The SQL of a request and, for an INSERT with inline data, that data as it arrives."""

    sql: bytes
    inline: InlineInsert | None = None
    data: Iterator[bytes] = field(default_factory=lambda: iter(()))
    external: list[ExternalTable] = field(default_factory=list)


class ClickHouseHandler(BaseHTTPRequestHandler):
    server: ClickHouseHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive, and chunked responses for streamed results
    timeout = 300  # seconds a socket read or write may stall, as ClickHouse's http_receive_timeout
    disable_nagle_algorithm = True
    _started = False  # whether this request's response has begun

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        self._handle()

    def do_POST(self) -> None:  # noqa: N802
        self._handle()

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Successful requests are not logged; failures are, one line each."""

    def _handle(self) -> None:
        self._started = False
        url = urlsplit(self.path)
        params = dict(parse_qsl(url.query, keep_blank_values=True))
        headers = {name.lower(): value for name, value in self.headers.items()}
        body = RequestBody(self.rfile, headers)
        if url.path == "/ping" or (self.command == "GET" and not params.get("query")):
            body.drain()
            self._send(200, [("Content-Type", "text/html; charset=UTF-8")], b"Ok.\n")
            return
        query_id = params.get("query_id") or str(uuid.uuid4())
        credentials = self.server.credentials
        if credentials is not None:
            accepted, user = credentials.accepts(headers, params)
            if not accepted:
                # The body is read and dropped, unparsed, so the connection can answer the next request.
                self._fail(ClickHouseError.of("AUTHENTICATION_FAILED", f"{user}: Authentication failed: password is "
                                              "incorrect, or there is no user with such name"), body, query_id)
                return
        try:
            self._serve(params, headers, body, query_id)
        except ClickHouseError as error:
            self._fail(error, body, query_id)
        except (ConnectionError, TimeoutError) as error:
            self.close_connection = True
            self.log_error("query %s: connection lost: %s", query_id, error)
        except Exception as error:  # a bug of ours must still answer like ClickHouse
            self._fail(ClickHouseError.of("STD_EXCEPTION", f"{type(error).__name__}: {error}"), body, query_id)

    def _serve(self, params: dict[str, str], headers: dict[str, str], body: RequestBody, query_id: str) -> None:
        form = headers.get("content-type", "").startswith("multipart/form-data")
        statement = self._form_statement(params, headers, body) if form else self._statement(params, headers, body)
        options = request_options(params, headers, query_id, form)
        with self.server.engine.lease(options) as connection:
            reply = self._execute(connection, statement, options)
        if reply.headers is None:
            self.wfile.write(reply.payload)
        else:
            self._send(200, reply.headers, reply.payload)

    def _execute(self, connection: Connection, statement: Statement, options: RequestOptions) -> Reply:
        keyword = leading_keyword(statement.sql)
        if self.command == "GET" and keyword in _MODIFYING_KEYWORDS:
            raise ClickHouseError.of("READONLY", "Cannot execute query in readonly mode. For queries over HTTP, "
                                     "method GET implies readonly. You should use method POST for modifying queries")
        connection.prepare(options.database, options.settings, keyword)
        with _external_tables(connection, statement.external):
            if statement.inline is not None:
                reply = self._insert(connection, statement.inline, statement.data, options)
            else:
                reply = self._query(connection, statement.sql, keyword, options)
        connection.finish(keyword)
        return reply

    def _statement(self, params: dict[str, str], headers: dict[str, str], body: RequestBody) -> Statement:
        """ClickHouse reads the `query` parameter, a line break, then the body as one text; an
        INSERT's data starts where its SQL ends and is streamed on from there."""
        text = params["query"].encode() + b"\n" if params.get("query") else b""
        pieces = decoded(body.pieces(), headers.get("content-encoding", ""))
        known = query_inline_insert(text[:-1]) if text else None
        if known is not None:
            return Statement(text, known, pieces)
        head, ended = _read_at_least(pieces, SQL_PREFIX_SIZE)
        text += head
        # A driver that sends a small INSERT's statement in front of its rows ends the statement
        # with a line break: its first line is then a whole INSERT, whose answer is remembered.
        # Tokens never span a line break outside quotes and comments, and a line that ends inside
        # either is no whole INSERT, so the answer is the one a scan of the body would give.
        line_end = text.find(b"\n")
        known = query_inline_insert(text[:line_end]) if line_end > 0 else None
        if known is not None:
            return Statement(text[: line_end + 1], known, chain([text[line_end + 1 :]], pieces))
        inline = find_inline_insert(text, complete=ended)
        if inline is None and not ended:
            text += b"".join(pieces)
            inline = find_inline_insert(text, complete=True)
        if inline is None:
            return Statement(text)
        return Statement(text[: inline.data_start], inline, chain([text[inline.data_start :]], pieces))

    def _form_statement(self, params: dict[str, str], headers: dict[str, str], body: RequestBody) -> Statement:
        """A multipart form carries the query and its parameters as fields and external tables as
        files; the body is then no part of the query."""
        raw = b"".join(decoded(body.pieces(), headers.get("content-encoding", "")))
        fields, files = form_fields(raw, headers["content-type"])
        params.update(fields)
        sql = params.get("query", "").encode()
        inline = find_inline_insert(sql, complete=True)
        data = iter([sql[inline.data_start :]]) if inline else iter(())
        return Statement(sql[: inline.data_start] if inline else sql, inline, data, external_tables(files, params))

    def _insert(self, connection: Connection, inline: InlineInsert, data: Iterator[bytes], options: RequestOptions) -> Reply:
        if inline.via_select:
            raise ClickHouseError.of("NOT_IMPLEMENTED", "INSERT ... SELECT with data in the request (input()) is "
                                     "not supported by the embedded server; insert the data with INSERT ... FORMAT")
        written = connection.insert(inline.statement, inline.format, data)
        summary = _summary(written_rows=written.rows_written, written_bytes=written.bytes_written,
                           elapsed=written.elapsed)
        return Reply(self._result_headers(None, options, summary))

    def _query(self, connection: Connection, sql: bytes, keyword: str, options: RequestOptions) -> Reply:
        text = sql.decode("utf-8", "replace")
        if not text.strip():
            raise ClickHouseError.of("SYNTAX_ERROR", "Empty query")
        _refuse_client_files(sql)
        result_format = output_format(sql) or options.default_format
        if result_format.lower() in _PYTHON_FORMATS:
            raise ClickHouseError.of("UNKNOWN_FORMAT", f"Unknown format {result_format}")
        if keyword in _SELECT_KEYWORDS and result_format in _STREAMED_FORMATS:
            with closing(connection.stream(text, result_format, options.query_params)) as blocks:
                return self._send_blocks(blocks, result_format, options)
        result = connection.query(text, result_format, options.query_params)
        shown_format = result_format if keyword in _RESULT_KEYWORDS else None
        return Reply(self._result_headers(shown_format, options, _result_summary(result)), _payload(result), result)

    def _send_blocks(self, blocks: Iterator[Result], result_format: str, options: RequestOptions) -> Reply:
        """A result of one block goes out whole, with its exact summary. A longer one is streamed
        as chunks; an error after the first chunk is written into the stream the way ClickHouse
        (25.11+) does it, between `__exception__` markers carrying a tag announced in a header."""
        first = next(blocks, None)
        second = next(blocks, None) if first is not None else None
        if first is None:
            return Reply(self._result_headers(result_format, options, _summary()))
        if second is None:
            return Reply(self._result_headers(result_format, options, _result_summary(first)), _payload(first), first)
        tag = secrets.token_hex(8)
        headers = self._result_headers(result_format, options, _result_summary(first))
        headers.append(("X-ClickHouse-Exception-Tag", tag))
        chunked = self.request_version != "HTTP/1.0"
        if chunked:
            headers.append(("Transfer-Encoding", "chunked"))
        else:
            self.close_connection = True
        self._start(200, headers)
        try:
            for block in chain([first, second], blocks):
                self._write(_payload(block), chunked)
        except ClickHouseError as error:
            self.log_error("query %s: failed while streaming its result: %s", options.query_id, _first_line(error))
            self._write(self._exception_block(error, tag), chunked)
            self.close_connection = True
        return Reply(None, b"0\r\n\r\n" if chunked else b"")

    def _write(self, payload: Any, chunked: bool) -> None:
        if chunked:
            self.wfile.write(b"%x\r\n" % len(payload))
            self.wfile.write(payload)
            self.wfile.write(b"\r\n")
        else:
            self.wfile.write(payload)

    def _exception_block(self, error: ClickHouseError, tag: str) -> bytes:
        message = f"{error.text} (version {self.server.engine.version})".encode()
        return b"__exception__\r\n%s\r\n%s\n%d %s\r\n__exception__\r\n" % (tag.encode(), message, len(message),
                                                                         tag.encode())

    def _result_headers(
        self, result_format: str | None, options: RequestOptions, summary: dict[str, str]
    ) -> list[tuple[str, str]]:
        headers = [
            ("Content-Type", content_type(result_format)),
            ("X-ClickHouse-Query-Id", options.query_id),
            ("X-ClickHouse-Timezone", options.settings.get("session_timezone") or self.server.engine.timezone),
            ("X-ClickHouse-Summary", json.dumps(summary, separators=(",", ":"))),
        ]
        if result_format is not None:
            headers.append(("X-ClickHouse-Format", result_format))
        return headers

    def _fail(self, error: ClickHouseError, body: RequestBody, query_id: str) -> None:
        self.log_error("query %s: %s", query_id, _first_line(error))
        if self._started:
            self.close_connection = True
            return
        try:
            body.drain()  # so the client reads the answer, and the connection can serve the next request
        except (ConnectionError, TimeoutError):
            self.close_connection = True
            return
        headers = [
            ("Content-Type", "text/plain; charset=UTF-8"),
            ("X-ClickHouse-Query-Id", query_id),
            ("X-ClickHouse-Exception-Code", str(error.code)),
        ]
        self._send(error.status, headers, f"{error.text} (version {self.server.engine.version})\n".encode())

    def _send(self, status: int, headers: list[tuple[str, str]], payload: Any) -> None:
        self._start(status, [*headers, ("Content-Length", str(len(payload)))])
        self.wfile.write(payload)

    def _start(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.send_response(status)
        self.send_header("X-ClickHouse-Server-Display-Name", self.server.display_name)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self._started = True


def _refuse_client_files(sql: bytes) -> None:
    """chdb would read or write such a file here, on the server; ClickHouse's server refuses."""
    clause = client_file_clause(sql)
    if clause == "INFILE":
        raise ClickHouseError.of("UNKNOWN_TYPE_OF_QUERY", "Query has infile and was send directly to server")
    if clause == "OUTFILE":
        raise ClickHouseError.of("INTO_OUTFILE_NOT_ALLOWED", "INTO OUTFILE is not allowed")


def _first_line(error: ClickHouseError) -> str:
    return next(iter(error.text.splitlines()), error.name)


def _read_at_least(pieces: Iterator[bytes], size: int) -> tuple[bytes, bool]:
    """At least `size` bytes from the front of the pieces (fewer if they end: then True)."""
    parts: list[bytes] = []
    total = 0
    for piece in pieces:
        parts.append(piece)
        total += len(piece)
        if total >= size:
            return b"".join(parts), False
    return b"".join(parts), True


@contextmanager
def _external_tables(connection: Connection, tables: list[ExternalTable]) -> Iterator[None]:
    created: list[str] = []
    try:
        for table in tables:
            name = identifier(table.name)
            connection.execute(f"CREATE TEMPORARY TABLE {name} ({table.structure}) ENGINE = Memory")
            created.append(name)
            connection.insert(f"INSERT INTO {name}", table.format, [table.data])
        yield
    finally:
        for name in created:
            connection.execute(f"DROP TEMPORARY TABLE IF EXISTS {name}")


def _payload(result: Result) -> memoryview:
    """The result's bytes without a copy; they live as long as the result does."""
    return result.get_memview().view()


def _result_summary(result: Result) -> dict[str, str]:
    return _summary(
        read_rows=result.storage_rows_read(),
        read_bytes=result.storage_bytes_read(),
        written_rows=result.rows_written(),
        written_bytes=result.bytes_written(),
        result_rows=result.rows_read(),
        result_bytes=result.size(),
        elapsed=result.elapsed(),
    )


def _summary(elapsed: float = 0.0, **counts: int) -> dict[str, str]:
    """X-ClickHouse-Summary: ClickHouse sends every figure as a string."""
    names = ("read_rows", "read_bytes", "written_rows", "written_bytes", "total_rows_to_read", "result_rows",
             "result_bytes")  # fmt: skip
    summary = {name: str(counts.get(name, 0)) for name in names}
    summary["elapsed_ns"] = str(int(elapsed * 1e9))
    return summary
