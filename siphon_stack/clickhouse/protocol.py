"""The HTTP side of ClickHouse's interface: which URL parameters are settings, how request bodies
arrive (chunked, compressed, multipart), and how errors and results are labelled."""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from typing import BinaryIO, Protocol

import lz4.frame
import zstandard

# URL parameters ClickHouse's HTTP handler consumes itself; every other one is a setting
# (or, with the param_ prefix, a query parameter).
TRANSPORT_PARAMS = frozenset(
    {
        "query", "database", "default_format", "compress", "decompress", "user", "password", "quota_key",
        "query_id", "stacktrace", "buffer_size", "wait_end_of_query", "session_id", "session_timeout",
        "session_check", "client_protocol_version", "close_session", "role",
    }
)  # fmt: skip
_EXTERNAL_SUFFIXES = ("_format", "_types", "_structure")
DEFAULT_SESSION_TIMEOUT = 60
MAX_SESSION_TIMEOUT = 3600
READ_SIZE = 1 << 20
_SETTING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ENGINE_ERROR = re.compile(r"Code: (\d+)\..*", re.DOTALL)
_ERROR_NAME = re.compile(r"\(([A-Z][A-Z0-9_]+)\)\s*$")

# ClickHouse's exceptionCodeToHTTPStatus, by error name; every other error is a 500.
_HTTP_STATUS = {
    **dict.fromkeys(("UNKNOWN_USER", "WRONG_PASSWORD", "AUTHENTICATION_FAILED", "ACCESS_DENIED"), 403),
    **dict.fromkeys(
        (
            "BAD_ARGUMENTS", "CANNOT_COMPILE_REGEXP", "CANNOT_PARSE_TEXT", "CANNOT_PARSE_ESCAPE_SEQUENCE",
            "CANNOT_PARSE_QUOTED_STRING", "CANNOT_PARSE_DATE", "CANNOT_PARSE_DATETIME", "CANNOT_PARSE_NUMBER",
            "CANNOT_PARSE_DOMAIN_VALUE_FROM_STRING", "CANNOT_PARSE_IPV4", "CANNOT_PARSE_IPV6",
            "CANNOT_PARSE_INPUT_ASSERTION_FAILED", "CANNOT_PARSE_UUID", "DUPLICATE_COLUMN", "ILLEGAL_COLUMN",
            "UNKNOWN_ELEMENT_IN_AST", "UNKNOWN_TYPE_OF_AST_NODE", "THERE_IS_NO_COLUMN", "TOO_DEEP_AST",
            "TOO_BIG_AST", "UNEXPECTED_AST_STRUCTURE", "SYNTAX_ERROR", "INCORRECT_DATA", "TYPE_MISMATCH",
            "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE",
        ),
        400,
    ),
    **dict.fromkeys(
        (
            "UNKNOWN_TABLE", "UNKNOWN_FUNCTION", "UNKNOWN_IDENTIFIER", "UNKNOWN_TYPE", "UNKNOWN_STORAGE",
            "UNKNOWN_DATABASE", "UNKNOWN_SETTING", "UNKNOWN_DIRECTION_OF_SORTING", "UNKNOWN_AGGREGATE_FUNCTION",
            "UNKNOWN_FORMAT", "UNKNOWN_DATABASE_ENGINE", "UNKNOWN_TYPE_OF_QUERY", "UNKNOWN_ROLE",
        ),
        404,
    ),
    "REQUIRED_PASSWORD": 401,
    "TIMEOUT_EXCEEDED": 408,
    "HTTP_LENGTH_REQUIRED": 411,
    "QUERY_IS_TOO_LARGE": 413,
    "NOT_IMPLEMENTED": 501,
    "SOCKET_TIMEOUT": 503,
    "CANNOT_OPEN_FILE": 503,
    "CANNOT_SCHEDULE_TASK": 503,
}  # fmt: skip

# ClickHouse's numbers for the errors this server reports itself.
_CODES = {
    "BAD_ARGUMENTS": 36,
    "NOT_IMPLEMENTED": 48,
    "SYNTAX_ERROR": 62,
    "UNKNOWN_FORMAT": 73,
    "UNKNOWN_TYPE_OF_QUERY": 78,
    "UNKNOWN_COMPRESSION_METHOD": 89,
    "UNKNOWN_SETTING": 115,
    "READONLY": 164,
    "CANNOT_DECOMPRESS": 271,
    "INTO_OUTFILE_NOT_ALLOWED": 358,
    "SESSION_NOT_FOUND": 372,
    "SESSION_IS_LOCKED": 373,
    "INVALID_SESSION_TIMEOUT": 374,
    "CANNOT_SCHEDULE_TASK": 439,
    "AUTHENTICATION_FAILED": 516,
    "STD_EXCEPTION": 1001,
}


class ClickHouseError(Exception):
    """An error as ClickHouse reports it: `Code: N. DB::Exception: message. (NAME)`."""

    def __init__(self, code: int, name: str, text: str):
        super().__init__(text)
        self.code, self.name, self.text = code, name, text

    @classmethod
    def of(cls, name: str, message: str) -> ClickHouseError:
        code = _CODES[name]
        return cls(code, name, f"Code: {code}. DB::Exception: {message}. ({name})")

    @classmethod
    def from_engine(cls, error: BaseException) -> ClickHouseError:
        """chdb's exceptions carry ClickHouse's text, sometimes behind a prefix of its own."""
        text = str(error)
        match = _ENGINE_ERROR.search(text)
        if not match:
            return cls.of("STD_EXCEPTION", text.rstrip(". ") or type(error).__name__)
        name = _ERROR_NAME.search(match.group(0))
        return cls(int(match.group(1)), name.group(1) if name else "", match.group(0).strip())

    @property
    def status(self) -> int:
        return _HTTP_STATUS.get(self.name, 500)


@dataclass
class RequestOptions:
    """What a request asks for beyond its SQL, from URL parameters and X-ClickHouse-* headers."""

    query_id: str
    database: str | None = None
    default_format: str = "TabSeparated"
    session_id: str | None = None
    session_timeout: int = DEFAULT_SESSION_TIMEOUT
    session_check: bool = False
    close_session: bool = False
    settings: dict[str, str] = field(default_factory=dict)
    query_params: dict[str, str] = field(default_factory=dict)


def request_options(params: dict[str, str], headers: dict[str, str], query_id: str, form: bool) -> RequestOptions:
    """Everything but `param_*` and ClickHouse's own parameters is a setting. With a multipart form,
    `<table>_format`, `_types` and `_structure` describe external tables instead, as in ClickHouse."""
    _refuse_native_compression(params)
    options = RequestOptions(
        query_id=params.get("query_id") or headers.get("x-clickhouse-query-id") or query_id,
        database=headers.get("x-clickhouse-database") or params.get("database") or None,
        default_format=headers.get("x-clickhouse-format") or params.get("default_format") or "TabSeparated",
        session_id=params.get("session_id") or None,
        session_timeout=_session_timeout(params.get("session_timeout")),
        session_check=_flag(params.get("session_check")),
        close_session=_flag(params.get("close_session")),
    )
    for key, value in params.items():
        if key.startswith("param_"):
            options.query_params[key[len("param_") :]] = value
        elif key and key not in TRANSPORT_PARAMS and not (form and key.endswith(_EXTERNAL_SUFFIXES)):
            options.settings[_setting_name(key)] = value
    return options


def _refuse_native_compression(params: dict[str, str]) -> None:
    # ClickHouse's own block compression (compress=1 / decompress=1) is not HTTP Content-Encoding;
    # answering it uncompressed would corrupt what the client reads.
    for key in ("compress", "decompress"):
        if _flag(params.get(key)):
            raise ClickHouseError.of("NOT_IMPLEMENTED", f"The '{key}' parameter (ClickHouse block compression) "
                                     "is not supported here; use HTTP compression (Content-Encoding) instead")


def _flag(value: str | None) -> bool:
    return (value or "0").strip().lower() in ("1", "true")


def _session_timeout(value: str | None) -> int:
    if value is None:
        return DEFAULT_SESSION_TIMEOUT
    if not value.isdigit():
        raise ClickHouseError.of("INVALID_SESSION_TIMEOUT", f"Invalid session timeout: '{value}'")
    if int(value) > MAX_SESSION_TIMEOUT:
        raise ClickHouseError.of("INVALID_SESSION_TIMEOUT", f"Session timeout '{value}' is larger than "
                                 f"max_session_timeout: {MAX_SESSION_TIMEOUT}")
    return int(value)


def _setting_name(name: str) -> str:
    # Names end up in SET statements, so anything but an identifier is refused here.
    if not _SETTING_NAME.match(name):
        raise ClickHouseError.of("UNKNOWN_SETTING", f"Unknown setting '{name}'")
    return name


def quote(value: str) -> str:
    """A ClickHouse string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def identifier(name: str) -> str:
    """A quoted ClickHouse identifier."""
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


class RequestBody:
    """The raw request body, read in pieces as they arrive (Content-Length or chunked)."""

    def __init__(self, stream: BinaryIO, headers: dict[str, str]):
        self._stream = stream
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        # Bytes left in the body, or with chunked encoding in the current chunk.
        self._remaining = 0 if self._chunked else int(headers.get("content-length") or 0)
        self.finished = not self._chunked and self._remaining == 0

    def pieces(self) -> Iterator[bytes]:
        while not self.finished:
            piece = self._next_chunked() if self._chunked else self._next_sized()
            if piece:
                yield piece

    def drain(self) -> None:
        """Reads what the handler did not, so the connection can serve the next request."""
        for _ in self.pieces():
            pass

    def _next_sized(self) -> bytes:
        piece = self._read(min(self._remaining, READ_SIZE))
        self._remaining -= len(piece)
        self.finished = self._remaining == 0
        return piece

    def _next_chunked(self) -> bytes:
        if self._remaining == 0:
            self._remaining = _chunk_size(self._stream.readline(1024))
            if self._remaining == 0:
                while self._stream.readline(1024).strip():  # trailer fields, then the final empty line
                    pass
                self.finished = True
                return b""
        piece = self._read(min(self._remaining, READ_SIZE))
        self._remaining -= len(piece)
        if self._remaining == 0:
            self._stream.readline(16)  # the CRLF closing the chunk
        return piece

    def _read(self, size: int) -> bytes:
        piece = self._stream.read(size)
        if len(piece) < size:
            raise ConnectionError("the client closed the connection in the middle of the request body")
        return piece


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";", 1)[0].strip(), 16)
    except ValueError:
        raise ConnectionError(f"malformed chunk size line {line[:40]!r} in a chunked request body") from None


class _Decompressor(Protocol):
    eof: bool
    unused_data: bytes

    def decompress(self, data: bytes) -> bytes: ...


_DECOMPRESSORS: dict[str, Callable[[], _Decompressor]] = {
    "gzip": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS),
    "x-gzip": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS),
    "deflate": lambda: zlib.decompressobj(zlib.MAX_WBITS),
    "zstd": lambda: zstandard.ZstdDecompressor().decompressobj(),
    "lz4": lz4.frame.LZ4FrameDecompressor,
}


def decoded(pieces: Iterator[bytes], content_encoding: str) -> Iterator[bytes]:
    """The body without its Content-Encoding. Clients compress block by block, so a body can hold
    many frames (gzip members, lz4 and zstd frames) back to back."""
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        yield from pieces
        return
    factory = _DECOMPRESSORS.get(encoding)
    if factory is None:
        raise ClickHouseError.of("UNKNOWN_COMPRESSION_METHOD", f"Unknown compression method '{encoding}'")
    decompressor, within_frame = factory(), False
    try:
        for piece in pieces:
            while piece:
                within_frame = True
                if output := decompressor.decompress(piece):
                    yield output
                piece = decompressor.unused_data if decompressor.eof else b""
                if decompressor.eof:
                    decompressor, within_frame = factory(), False
    except (zlib.error, zstandard.ZstdError, RuntimeError) as error:
        message = f"Cannot decompress the request body ({encoding}): {error}"
        raise ClickHouseError.of("CANNOT_DECOMPRESS", message) from None
    if within_frame:
        raise ClickHouseError.of("CANNOT_DECOMPRESS", f"The request body ends within a {encoding} frame")


def form_fields(body: bytes, content_type: str) -> tuple[dict[str, str], dict[str, bytes]]:
    """A multipart/form-data body: plain fields (the query and its parameters) and files
    (external tables)."""
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}
    for part in message.iter_parts():  # type: ignore[attr-defined]
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True) or b""
        if part.get_filename() is not None:
            files[name] = payload
        else:
            fields[name] = payload.decode("utf-8", "replace")
    return fields, files


@dataclass(frozen=True)
class ExternalTable:
    """A file sent with a query as a temporary table, as ClickHouse's HTTP interface allows."""

    name: str
    structure: str
    format: str
    data: bytes


def external_tables(files: dict[str, bytes], params: dict[str, str]) -> list[ExternalTable]:
    tables = []
    for name, data in files.items():
        structure = params.get(f"{name}_structure") or _structure_of_types(params.get(f"{name}_types", ""))
        if not structure:
            raise ClickHouseError.of("BAD_ARGUMENTS", f"Neither structure nor types have been provided for "
                                     f"external table {name}. Use fields {name}_structure or {name}_types to do so")
        tables.append(ExternalTable(name, structure, params.get(f"{name}_format") or "TabSeparated", data))
    return tables


def _structure_of_types(types: str) -> str:
    """`UInt8,Array(String)` names its columns _1, _2, ... as ClickHouse does."""
    columns, depth, start = [], 0, 0
    for i, char in enumerate(types + ","):
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            columns.append(types[start:i].strip())
            start = i + 1
    return ", ".join(f"_{n} {column}" for n, column in enumerate(columns, 1) if column)


_CONTENT_TYPES = (
    ("TabSeparated", "text/tab-separated-values; charset=UTF-8"),
    ("TSV", "text/tab-separated-values; charset=UTF-8"),
    ("CSV", "text/csv; charset=UTF-8; header=absent"),
    ("JSONEachRow", "application/x-ndjson; charset=UTF-8"),
    ("JSON", "application/json; charset=UTF-8"),
    ("XML", "application/xml; charset=UTF-8"),
    ("Pretty", "text/plain; charset=UTF-8"),
    ("Values", "text/plain; charset=UTF-8"),
)


def content_type(output_format: str | None) -> str:
    if output_format is None:
        return "text/plain; charset=UTF-8"
    for prefix, value in _CONTENT_TYPES:
        if output_format.startswith(prefix):
            return value
    return "application/octet-stream"
