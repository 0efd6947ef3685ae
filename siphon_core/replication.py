"""PostgreSQL's streaming replication protocol, logical flavour, over a libpq connection.

psycopg has no replication API, so this speaks the protocol through its libpq binding
(`psycopg.pq.PGconn`): replication commands go through the simple query protocol (the only one a
walsender accepts for them), the stream through COPY BOTH.

Values arrive in UTF-8, converted by the server from the database's encoding; in a SQL_ASCII
database, which has no encoding to convert from, as the stored bytes.

The walsender renders pgoutput's text values with its own session settings, which a database or
role default could change (`ALTER DATABASE ... SET DateStyle`). The connection pins them through
the startup `options`, which outrank such defaults, so the text that reaches the targets never
depends on them.
"""

from __future__ import annotations

import selectors
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple

from psycopg import OperationalError, pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from siphon_core.naming import format_lsn, parse_lsn
from siphon_core.session import PINNED_SETTINGS

# PostgreSQL's timestamps count microseconds from 2000-01-01; Unix time from 1970-01-01.
POSTGRES_EPOCH_OFFSET_US = 946_684_800_000_000

# English server messages when the role may set them (superuser only); otherwise the server's default.
_MESSAGES_SETTING = "lc_messages"

# CopyData messages of the stream: their type bytes and the fields after them (the producer's hot
# path reads them in place too).
XLOG_DATA, KEEPALIVE = b"wk"
XLOG_HEADER = struct.Struct(">QQq")  # WAL start of the data, WAL end on the server, server time
KEEPALIVE_FIELDS = struct.Struct(">QqB")  # WAL end on the server, server time, 1: reply requested
_STATUS_UPDATE = struct.Struct(">cQQQqB")
XLOG_PAYLOAD_START = 1 + XLOG_HEADER.size  # where the pgoutput message starts in a raw XLogData

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)


class ReplicationError(RuntimeError):
    """The server refused a replication command or ended the stream; `sqlstate` says why when known."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class SystemIdentity(NamedTuple):
    systemid: int
    timeline: int
    xlogpos: int
    dbname: str | None


@dataclass(frozen=True, slots=True)
class SlotInfo:
    name: str
    consistent_point: int
    snapshot_name: str | None


@dataclass(frozen=True, slots=True)
class XLogData:
    """One pgoutput message. Times are microseconds since the Unix epoch, UTC."""

    data_start: int
    wal_end: int
    server_time: int
    payload: bytes | memoryview  # a zero-copy view of the buffer libpq received, which it keeps alive


@dataclass(frozen=True, slots=True)
class Keepalive:
    wal_end: int
    server_time: int
    reply_requested: bool


class ReplicationConnection:
    """A logical replication connection (`replication=database`) to the DSN's database."""

    def __init__(self, dsn: str, application_name: str = "siphon") -> None:
        params = conninfo_to_dict(dsn)
        self._where = f"{params.get('host', 'localhost')}:{params.get('port', 5432)}/{params.get('dbname', '')}"
        base = {**params, "replication": "database", "application_name": application_name,
                "client_encoding": "UTF8"}
        pinned = " ".join(f"-c {name}={value}" for name, value in PINNED_SETTINGS.items())
        # Ours come last: PostgreSQL applies repeated -c options in order.
        options = " ".join(filter(None, [params.get("options", ""), pinned]))
        self._pgconn = self._connect({**base, "options": f"{options} -c {_MESSAGES_SETTING}=C"})
        if self._pgconn.status != pq.ConnStatus.OK and _MESSAGES_SETTING in self._error_text():
            self._pgconn.finish()
            self._pgconn = self._connect({**base, "options": options})
        if self._pgconn.status != pq.ConnStatus.OK:
            message = self._error_text()
            self._pgconn.finish()
            raise ReplicationError(f"cannot open a replication connection to {self._where}: {message}")
        self._selector: selectors.BaseSelector | None = None
        if self._pgconn.parameter_status(b"server_encoding") == b"SQL_ASCII":
            # Text in a SQL_ASCII database is bytes in no known encoding: PostgreSQL cannot convert it
            # and would reject what is not valid in the client encoding. Take the bytes as they are.
            self._command(b"SET client_encoding = 'SQL_ASCII'")

    @staticmethod
    def _connect(params: dict[str, object]) -> pq.PGconn:
        return pq.PGconn.connect(make_conninfo("", **params).encode())

    @property
    def server_version(self) -> int:
        """As server_version_num, e.g. 150004."""
        return self._pgconn.server_version

    @property
    def backend_pid(self) -> int:
        return self._pgconn.backend_pid

    def identify_system(self) -> SystemIdentity:
        result = self._command(b"IDENTIFY_SYSTEM")
        systemid, timeline, xlogpos, dbname = (result.get_value(0, i) for i in range(4))
        assert systemid is not None and timeline is not None and xlogpos is not None
        return SystemIdentity(int(systemid), int(timeline), parse_lsn(xlogpos.decode()),
                              dbname.decode() if dbname is not None else None)

    def create_slot(self, name: str, temporary: bool = False, export_snapshot: bool = False) -> SlotInfo:
        """A pgoutput slot. An exported snapshot stays importable (SET TRANSACTION SNAPSHOT) until the
        next command on this connection or its close."""
        command = b"CREATE_REPLICATION_SLOT " + self._identifier(name)
        if temporary:
            command += b" TEMPORARY"
        command += b" LOGICAL pgoutput"
        if self.server_version >= 150000:
            command += b" (SNAPSHOT 'export')" if export_snapshot else b" (SNAPSHOT 'nothing')"
        else:
            command += b" EXPORT_SNAPSHOT" if export_snapshot else b" NOEXPORT_SNAPSHOT"
        result = self._command(command)
        consistent_point = result.get_value(0, 1)
        snapshot_name = result.get_value(0, 2)
        assert consistent_point is not None
        return SlotInfo(name, parse_lsn(consistent_point.decode()),
                        snapshot_name.decode() if snapshot_name is not None else None)

    def drop_slot(self, name: str) -> None:
        self._command(b"DROP_REPLICATION_SLOT " + self._identifier(name))

    def slot_exists(self, name: str) -> bool:
        """Runs SQL on this connection, so it ends the life of a snapshot exported before."""
        literal = pq.Escaping(self._pgconn).escape_literal(name.encode())
        result = self._command(b"SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = " + literal)
        return result.ntuples > 0

    def start(
        self,
        slot: str,
        publication_names: list[str],
        start_lsn: int,
        proto_version: int | None = None,
        messages: bool = True,
        streaming: bool = False,
        binary: bool = False,
    ) -> None:
        """Starts streaming the slot's changes after `start_lsn` (0: from the slot's confirmed position)."""
        if proto_version is None:
            proto_version = 2 if self.server_version >= 140000 else 1
        if streaming and proto_version < 2:
            raise ValueError("streaming of in-progress transactions needs proto_version 2 or newer")
        if not publication_names:
            raise ValueError("start() needs at least one publication name")
        options = [
            b"proto_version " + _literal(str(proto_version).encode()),
            # pgoutput splits the list like SQL identifiers: quoting keeps case, commas and quotes.
            b"publication_names " + _literal(b",".join(self._identifier(name) for name in publication_names)),
        ]
        # Options are sent only when on: servers before 14 reject the ones they do not know.
        if messages:
            options.append(b"messages 'true'")
        if streaming:
            options.append(b"streaming 'on'")
        if binary:
            options.append(b"binary 'true'")
        command = (b"START_REPLICATION SLOT " + self._identifier(slot) + b" LOGICAL "
                   + format_lsn(start_lsn).encode() + b" (" + b", ".join(options) + b")")
        self._pgconn.send_query(command)
        result = self._pgconn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            error = self._result_error(f"START_REPLICATION SLOT {slot}", result)
            while self._pgconn.get_result() is not None:
                pass
            raise error
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._pgconn.socket, selectors.EVENT_READ)

    def read(self, timeout: float) -> XLogData | Keepalive | None:
        """The next message, or None when none arrived within `timeout` seconds."""
        batch = self.read_batch(timeout, 1)
        return batch[0] if batch else None

    def read_batch(self, timeout: float, max_messages: int = 1000) -> list[XLogData | Keepalive]:
        """Every message libpq already holds (up to `max_messages`); waits up to `timeout` seconds
        for the first one only. An empty list means nothing arrived."""
        if self._selector is None:
            raise ReplicationError("read before start(): the connection is not streaming")
        pgconn = self._pgconn
        messages: list[XLogData | Keepalive] = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                while len(messages) < max_messages:
                    nbytes, data = pgconn.get_copy_data(1)
                    if nbytes > 0:
                        messages.append(parse_copy_data(data))
                    elif nbytes == 0:
                        break
                    else:
                        raise self._end_of_stream()
                if messages:
                    return messages
                # With no time left, still take what already reached the socket (select(0)).
                remaining = max(0.0, deadline - time.monotonic())
                if not self._selector.select(remaining):
                    return messages
                pgconn.consume_input()
        except OperationalError as error:
            raise ReplicationError(f"replication stream from {self._where} failed: {error}") from None

    def read_copy_data(self, max_messages: int = 1000) -> list[memoryview]:
        """Every message libpq holds or the socket already has (up to `max_messages`), undecoded and
        without waiting: b'w' + XLogData header + pgoutput message (from `XLOG_PAYLOAD_START`), or a
        b'k' keepalive (`parse_copy_data` decodes either). The hot path of the producer."""
        if self._selector is None:
            raise ReplicationError("read before start(): the connection is not streaming")
        pgconn = self._pgconn
        get = pgconn.get_copy_data
        messages: list[memoryview] = []
        append = messages.append
        consumed_at = -1  # len(messages) when the socket was last read
        try:
            while len(messages) < max_messages:
                nbytes, data = get(1)
                if nbytes > 0:
                    append(data)
                elif nbytes == 0:
                    if consumed_at == len(messages):
                        break  # the socket had nothing more
                    consumed_at = len(messages)
                    pgconn.consume_input()
                else:
                    raise self._end_of_stream()
        except OperationalError as error:
            raise ReplicationError(f"replication stream from {self._where} failed: {error}") from None
        return messages

    def fileno(self) -> int:
        """The socket, for an event loop to wait on before a `read_batch(0)`."""
        return self._pgconn.socket

    def send_status(self, written_lsn: int, flushed_lsn: int, applied_lsn: int,
                    reply_requested: bool = False) -> None:
        """A standby status update; the server may recycle WAL up to `flushed_lsn`."""
        now = time.time_ns() // 1000 - POSTGRES_EPOCH_OFFSET_US
        message = _STATUS_UPDATE.pack(b"r", written_lsn, flushed_lsn, applied_lsn, now, reply_requested)
        try:
            self._pgconn.put_copy_data(message)
            self._pgconn.flush()
        except OperationalError as error:
            raise ReplicationError(f"sending a status update to {self._where} failed: {error}") from None

    def end_stream(self, timeout: float) -> bool:
        """Ends the stream as the protocol does: CopyDone, then what the server still sends is read
        and dropped until its own CopyDone and the command's end. The walsender handles our messages
        in order, so once its CopyDone arrives it has taken every status update sent before: a close
        without this may reach the server before the last update (or as a reset that discards it),
        and a restart would resend what was already confirmed. False when the server did not finish
        within `timeout` seconds; the connection should then just be closed."""
        if self._selector is None:
            raise ReplicationError("end_stream before start(): the connection is not streaming")
        pgconn = self._pgconn
        deadline = time.monotonic() + timeout
        try:
            pgconn.put_copy_end()
            pgconn.flush()
            while (nbytes := pgconn.get_copy_data(1)[0]) != -1:  # data past the last confirmed LSN: dropped
                if nbytes == 0 and not self._wait_for_input(deadline):
                    return False
            while True:
                while pgconn.is_busy():
                    if not self._wait_for_input(deadline):
                        return False
                result = pgconn.get_result()
                if result is None:
                    return True
                if result.status not in _OK:
                    raise self._result_error("ending the replication stream", result)
        except OperationalError as error:
            raise ReplicationError(f"ending the replication stream from {self._where} failed: {error}") from None
        finally:
            self._selector.close()
            self._selector = None

    def _wait_for_input(self, deadline: float) -> bool:
        assert self._selector is not None
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._selector.select(remaining):
            return False
        self._pgconn.consume_input()
        return True

    def close(self) -> None:
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        self._pgconn.finish()

    def __enter__(self) -> ReplicationConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _command(self, command: bytes) -> pq.PGresult:
        result = self._pgconn.exec_(command)
        if result.status not in _OK:
            raise self._result_error(command.decode(errors="replace"), result)
        return result

    def _end_of_stream(self) -> ReplicationError:
        result = self._pgconn.get_result()
        if result is not None and result.status in _OK:
            return ReplicationError(f"the server at {self._where} ended the replication stream")
        return self._result_error("replication stream", result)

    def _result_error(self, what: str, result: pq.PGresult | None) -> ReplicationError:
        primary = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY) if result is not None else None
        if primary is None:
            return ReplicationError(f"{what} on {self._where} failed: {self._error_text()}")
        assert result is not None
        message = primary.decode(errors="replace")
        for field in (pq.DiagnosticField.MESSAGE_DETAIL, pq.DiagnosticField.MESSAGE_HINT):
            extra = result.error_field(field)
            if extra:
                message += f" ({extra.decode(errors='replace')})"
        sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
        return ReplicationError(f"{what} on {self._where} failed: {message}",
                                sqlstate.decode() if sqlstate else None)

    def _error_text(self) -> str:
        return self._pgconn.error_message.decode(errors="replace").strip()

    def _identifier(self, name: str) -> bytes:
        return pq.Escaping(self._pgconn).escape_identifier(name.encode())


def parse_copy_data(data: memoryview) -> XLogData | Keepalive:
    kind = data[0]
    if kind == XLOG_DATA:
        data_start, wal_end, server_time = XLOG_HEADER.unpack_from(data, 1)
        return XLogData(data_start, wal_end, server_time + POSTGRES_EPOCH_OFFSET_US, data[XLOG_PAYLOAD_START:])
    if kind == KEEPALIVE:
        wal_end, server_time, reply = KEEPALIVE_FIELDS.unpack_from(data, 1)
        return Keepalive(wal_end, server_time + POSTGRES_EPOCH_OFFSET_US, reply == 1)
    raise ReplicationError(f"unexpected replication message type {bytes([kind])!r} in the stream")


def _literal(text: bytes) -> bytes:
    """A replication-grammar string literal. libpq's escape_literal may produce E'...', which that
    grammar does not know; it reads backslashes literally and only '' as a quote."""
    return b"'" + text.replace(b"'", b"''") + b"'"
