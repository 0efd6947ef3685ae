"""The chdb side: one data directory, many connections to it.

chdb lets one process open many connections to its data directory, each with its own current
database, settings and temporary tables, and runs their queries in parallel (the GIL is released
while the engine works). So a request without a session gets a fresh connection, which is what a
ClickHouse query context is, and each HTTP session keeps one connection of its own.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import chdb

from siphon_stack.clickhouse.protocol import ClickHouseError, RequestOptions, identifier, quote

Result = Any  # chdb's query_result: get_memview(), rows_read(), bytes_read(), rows_written(), elapsed()

# The most data one chdb streaming insert is given (see Connection.insert), and the formats whose
# rows each end at a line break (a line break inside a value is escaped), where an insert can be cut.
SEGMENT_BYTES = 64 << 20
READ_AHEAD_PIECES = 32  # pieces of the request body (up to 1 MiB each) read while a segment finishes
_LINE_FORMATS = frozenset({"TabSeparated", "TSV", "TabSeparatedRaw", "TSVRaw", "LineAsString"})

# Server settings the engine starts with (chdb takes them as parameters of its first connection).
# Every MergeTree table has two background tasks: one looks for merges and old parts to remove, the
# other serves the engine's streaming reads, which nothing here uses. With nothing to do each slept
# 0.1 s, growing by a tenth each time, plus up to 1 s at random, and an insert wakes them and starts
# that over. So a table written every few seconds was looked at several times a second, each look a
# thread's wake-up. With 400 tables (200 tables and their truncation records) written 40 times a
# second, an insert cost the engine 11.0 - 11.4 ms of CPU, merges included; 8.3 - 8.4 ms with both
# tasks asleep 5 s. Merges are still chosen the moment an insert lands, and outdated parts go a few
# seconds later.
ENGINE_SETTINGS = {
    "background_processing_pool_thread_sleep_seconds_if_nothing_to_do": "5",
    "background_streaming_processing_pool_thread_sleep_seconds_if_nothing_to_do": "5",
}


@dataclass
class InsertSummary:
    """What the inserts of one request wrote, summed over its segments."""

    rows_written: int = 0
    bytes_written: int = 0
    elapsed: float = 0.0

    def add(self, result: Any) -> None:
        self.rows_written += result.rows_written
        self.bytes_written += result.bytes_written
        self.elapsed += result.elapsed


class Connection:
    """A chdb connection with the request-scoped behaviour of ClickHouse's HTTP sessions: the
    `database` and settings of a request apply to that request only, while `USE` and `SET`
    statements change the session."""

    def __init__(self, raw: Any, keeps_state: bool):
        self.raw = raw
        self._keeps_state = keeps_state
        self._own_database = self._current_database = "default"
        # The session's own values of settings a request overrode, read once: a batch writer sends
        # the same few settings with every request, and reading them each time cost more than the
        # request. Forgotten when a SET statement may have changed them.
        self._session_values: dict[str, str] = {}
        self._overridden: dict[str, None] = {}  # settings the last request gave values of its own, in order
        # What this connection last set each setting to: a request whose settings are already in
        # force runs no SET (each statement costs the engine as much as a small query).
        self._in_force: dict[str, str] = {}

    def prepare(self, database: str | None, settings: dict[str, str], statement: str) -> None:
        if statement == "SET":
            # What SET changes belongs to the session, so it must not be undone as a request override.
            self._apply({name: self._session_values[name] for name in self._overridden
                         if name in self._session_values})
            self._overridden.clear()
            self._session_values.clear()
            self._in_force.clear()
        else:
            self._override(settings)
        target = database or self._own_database
        if target != self._current_database:
            self.execute(f"USE {identifier(target)}")
            self._current_database = target

    def finish(self, statement: str) -> None:
        if statement == "USE":
            database = self.query("SELECT currentDatabase()", "TabSeparated").bytes().decode().strip()
            self._own_database = self._current_database = database
        if statement == "SET":
            self._in_force.clear()  # the statement may have set anything

    def _override(self, settings: dict[str, str]) -> None:
        """Puts the request's settings in force, and the session's own values back for settings the
        previous request overrode and this one does not, in one SET of what differs."""
        if self._keeps_state:
            self._remember([name for name in settings if name not in self._session_values])
        wanted = {name: self._session_values[name] for name in self._overridden
                  if name not in settings and name in self._session_values}
        wanted.update(settings)
        self._apply(wanted)
        self._overridden = dict.fromkeys(settings)

    def _apply(self, values: dict[str, str]) -> None:
        changes = {name: value for name, value in values.items()
                   if self._in_force.get(name, self._session_values.get(name)) != value}
        if changes:
            self.execute("SET " + ", ".join(f"{name} = {quote(value)}" for name, value in changes.items()))
            self._in_force.update(changes)

    def _remember(self, names: list[str]) -> None:
        if not names:
            return
        listed = ", ".join(quote(name) for name in names)
        rows = self.query(f"SELECT name, value FROM system.settings WHERE name IN ({listed})", "JSONEachRow")
        for line in rows.bytes().splitlines():
            row = json.loads(line)
            self._session_values[row["name"]] = row["value"]

    def execute(self, sql: str) -> Result:
        return self.query(sql, "TabSeparated")

    def query(self, sql: str, output_format: str, params: dict[str, str] | None = None) -> Result:
        try:
            return self.raw.query(sql, output_format, params=params or {})
        except Exception as error:
            raise ClickHouseError.from_engine(error) from None

    def stream(self, sql: str, output_format: str, params: dict[str, str]) -> Iterator[Result]:
        """The result block by block; chdb formats each block as a whole document of its own."""
        try:
            blocks = self.raw.send_query(sql, output_format, params=params)
        except Exception as error:
            raise ClickHouseError.from_engine(error) from None
        try:
            while True:
                try:
                    block = blocks.fetch()
                except Exception as error:
                    raise ClickHouseError.from_engine(error) from None
                if block is None:
                    return
                yield block
        finally:
            blocks.cancel()

    def insert(self, statement: str, input_format: str, data: Iterable[bytes]) -> InsertSummary:
        """Streams the data into `statement` as it arrives.

        chdb holds every byte of a streaming insert, and about as much again, until the insert
        finishes, where a ClickHouse server holds a block at a time. So data in a format whose rows
        end at line breaks is cut, at a line break, into inserts of about `SEGMENT_BYTES` each:
        memory stays bounded whatever the body's size. While a segment finishes (chdb converts and
        writes it then), a thread reads on, so the client is not held up. As with a ClickHouse
        server, whose large inserts are written block by block, the rows of segments already
        finished stay written when a later one fails.
        """
        summary = InsertSummary()
        inserter = self._start_insert(statement, input_format)
        cut_at_lines = input_format in _LINE_FORMATS
        size = 0
        with closing(_read_ahead(data) if cut_at_lines else (piece for piece in data)) as pieces:
            try:
                for piece in pieces:
                    if cut_at_lines and size + len(piece) >= SEGMENT_BYTES and (cut := piece.rfind(b"\n") + 1):
                        inserter.append(piece[:cut])
                        summary.add(inserter.finish())
                        inserter = None
                        piece, size = piece[cut:], 0
                    if piece:
                        if inserter is None:
                            inserter = self._start_insert(statement, input_format)
                        inserter.append(piece)
                        size += len(piece)
                if inserter is not None:
                    summary.add(inserter.finish())
                return summary
            except (ClickHouseError, ConnectionError):
                if inserter is not None:
                    inserter.cancel()
                raise
            except Exception as error:
                if inserter is not None:
                    inserter.cancel()
                raise ClickHouseError.from_engine(error) from None

    def _start_insert(self, statement: str, input_format: str) -> Any:
        try:
            return self.raw.send_insert(statement, input_format)
        except Exception as error:
            raise ClickHouseError.from_engine(error) from None

    def close(self) -> None:
        self.raw.close()


_END = object()


def _read_ahead(pieces: Iterable[bytes], depth: int = READ_AHEAD_PIECES) -> Iterator[bytes]:
    """The pieces, read on a thread up to `depth` pieces ahead of the consumer. The thread is
    stopped and joined before this generator ends, so the source is never read by two threads."""
    ahead: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stopped = threading.Event()

    def offer(item: Any) -> bool:
        while not stopped.is_set():
            try:
                ahead.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for piece in pieces:
                if not offer(piece):
                    return
            offer(_END)
        except BaseException as error:  # handed to the consumer, which raises it
            offer(error)

    reader = threading.Thread(target=read, name="insert-read-ahead", daemon=True)
    reader.start()
    try:
        while (item := ahead.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stopped.set()
        reader.join()


@dataclass
class _Session:
    connection: Connection
    lock: threading.Lock
    expires: float


class Engine:
    """Owns the data directory for the server's lifetime and hands out connections to it."""

    def __init__(self, data_dir: str):
        self._path = f"{data_dir}?{urlencode(ENGINE_SETTINGS)}"
        # Opening the directory takes its lock; this connection holds it until close().
        self._anchor = chdb.connect(self._path)
        info = self._anchor.query("SELECT version(), timezone()", "TabSeparated").bytes().decode()
        self.version, self.timezone = info.rstrip("\n").split("\t")
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closing = False

    @contextmanager
    def lease(self, options: RequestOptions) -> Iterator[Connection]:
        self._enter()
        try:
            if options.session_id is None:
                connection = Connection(chdb.connect(self._path), keeps_state=False)
                try:
                    yield connection
                finally:
                    connection.close()
            else:
                with self._session(options) as connection:
                    yield connection
        finally:
            self._leave()

    @contextmanager
    def _session(self, options: RequestOptions) -> Iterator[Connection]:
        session_id = options.session_id or ""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                if options.session_check:
                    raise ClickHouseError.of("SESSION_NOT_FOUND", f"Session {session_id} not found")
                session = _Session(Connection(chdb.connect(self._path), True), threading.Lock(), 0.0)
                self._sessions[session_id] = session
            if not session.lock.acquire(blocking=False):
                raise ClickHouseError.of("SESSION_IS_LOCKED", f"Session {session_id} is locked by a concurrent client")
        try:
            yield session.connection
        finally:
            session.expires = time.monotonic() + options.session_timeout
            if options.close_session:
                with self._lock:
                    self._sessions.pop(session_id, None)
                session.connection.close()
            session.lock.release()

    def expire_sessions(self) -> None:
        """Closes sessions idle past their timeout, as ClickHouse does. Sessions are only taken
        under the engine lock, so one found idle here cannot be taken before it is removed."""
        now = time.monotonic()
        with self._lock:
            expired = [sid for sid, s in self._sessions.items() if s.expires < now and not s.lock.locked()]
            sessions = [self._sessions.pop(session_id) for session_id in expired]
        for session in sessions:
            session.connection.close()

    def _enter(self) -> None:
        with self._lock:
            if self._closing:
                raise ClickHouseError.of("CANNOT_SCHEDULE_TASK", "The server is shutting down")
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    def close(self, grace_seconds: float) -> bool:
        """Lets running requests finish (up to the grace period), then closes every connection.
        Returns whether all requests had finished."""
        with self._lock:
            self._closing = True
            finished = self._idle.wait_for(lambda: self._active == 0, timeout=grace_seconds)
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.connection.close()
        self._anchor.close()
        return finished
