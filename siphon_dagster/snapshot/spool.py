"""A block range read as fast as PostgreSQL sends it, loaded behind it from memory and a local file.

A range's read holds a temporary slot (which holds back the source's vacuum horizon) and the
table's ACCESS SHARE lock (which makes any ALTER TABLE wait, and every query queued behind that
ALTER with it). Loading straight from the COPY would keep both for as long as the target takes,
minutes for a slow warehouse. Here a reader thread hands the COPY text on through memory and an
unlinked temporary file, and releases the slot and the transaction the moment the COPY ends, while
the loader takes the same chunks behind it: the source waits only for its own COPY, and the read
and the load still overlap. The reader runs at most `max_ahead_bytes` ahead of the loader (then it
waits, as it would without a spool). The first `MEMORY_BYTES` of the lead stay in memory, as the chunks the
reader made; only what is further ahead goes to the file, which grows with it and goes when the
range is done. A chunk kept in memory is never copied: ten default-size ranges loaded one after
another into the embedded ClickHouse took 7 - 10% less time than through the file.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from siphon_core.logs import get_logger
from siphon_dagster.partitions import BlockRange
from siphon_dagster.snapshot.blockers import WaitReport
from siphon_dagster.snapshot.reader import (
    SnapshotProgress,
    exported_snapshot,
    read_locked_range,
    snapshot_transaction,
    table_layout,
)
from siphon_dagster.targets.base import TableSchema

log = get_logger("snapshot")
MAX_AHEAD_BYTES = 2 << 30
# The lead kept in memory: a default-size range (8,192 blocks, about 60 MB of COPY text) whole.
MEMORY_BYTES = 64 << 20
PROGRESS_SECONDS = 5.0
STOP_WAIT_SECONDS = 10.0  # for a reader to notice the loader stopped, before its COPY is cancelled


class SnapshotReadError(RuntimeError):
    """Reading a range from the source failed; nothing of it may be applied."""


class _Spool:
    """Chunks appended by one thread and read back, in order and whole, by another; the first
    `memory_bytes` of the lead are kept as they are, the rest in the file."""

    def __init__(self, directory: str | None, max_ahead_bytes: int, memory_bytes: int = MEMORY_BYTES) -> None:
        try:
            self._file = tempfile.TemporaryFile(prefix="siphon-snapshot-", dir=directory)  # noqa: SIM115 (closed by close())
        except OSError as error:
            raise SnapshotReadError(f"cannot make a spool file in {directory or tempfile.gettempdir()} "
                                    f"(source.snapshot_spool_directory): {error}") from error
        self._fd = self._file.fileno()
        self._max_ahead = max_ahead_bytes
        self._memory_bytes = memory_bytes
        # Each chunk in order: the chunk itself while in memory, or (offset, size) in the file;
        # None once the loader has it.
        self._entries: list[bytes | tuple[int, int] | None] = []
        self._written = self._taken = self._in_memory = self._file_size = 0
        self._done = self._stopped = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    # -- the reader thread --

    def append(self, chunk: bytes) -> bool:
        """Keeps a chunk; False when the loader has stopped and no more is wanted."""
        with self._changed:
            while self._written - self._taken > self._max_ahead and not self._stopped:
                self._changed.wait()
            if self._stopped:
                return False
            in_memory = self._in_memory + len(chunk) <= self._memory_bytes
        entry: bytes | tuple[int, int] = chunk
        if not in_memory:
            entry = (self._file_size, len(chunk))
            view = memoryview(chunk)
            while view:
                view = view[os.write(self._fd, view):]
            self._file_size += len(chunk)
        with self._changed:
            self._entries.append(entry)
            self._written += len(chunk)
            if in_memory:
                self._in_memory += len(chunk)
            self._changed.notify_all()
        return True

    def finish(self, error: BaseException | None = None) -> None:
        with self._changed:
            self._done, self._error = True, error
            self._changed.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    # -- the loader --

    def chunks(self) -> Iterator[bytes]:
        index = 0
        while True:
            with self._changed:
                while index == len(self._entries) and not self._done:
                    self._changed.wait()
                if index == len(self._entries):
                    if self._error is not None:
                        raise SnapshotReadError(f"reading the range failed: {self._error}") from self._error
                    return
                entry, self._entries[index] = self._entries[index], None
            in_memory = isinstance(entry, bytes)
            chunk = entry if in_memory else os.pread(self._fd, entry[1], entry[0])  # type: ignore[index]
            index += 1
            with self._changed:
                self._taken += len(chunk)
                if in_memory:
                    self._in_memory -= len(chunk)
                self._changed.notify_all()
            yield chunk

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def close(self) -> None:
        self._file.close()


@dataclass
class SpooledRange:
    """What the loader of one range needs: the columns the COPY reads (under the lock), the
    version of its rows, and the COPY text's chunks as the reader makes them."""

    table: TableSchema
    consistent_point: int
    progress: SnapshotProgress
    _spool: _Spool
    _released: threading.Event
    layout: tuple[tuple[int, int], ...] = ()  # the table's storage the range was read from (table_layout)

    def chunks(self, on_progress: Callable[[SnapshotProgress], None] | None = None) -> Iterator[bytes]:
        last_report = time.monotonic()
        for chunk in self._spool.chunks():
            yield chunk
            if on_progress is not None and time.monotonic() - last_report > PROGRESS_SECONDS:
                on_progress(self.progress)
                last_report = time.monotonic()

    @property
    def source_released(self) -> bool:
        """True once the COPY has ended and its slot and transaction are gone."""
        return self._released.is_set()


@contextmanager
def spooled_range(dsn: str, schema: str, table: str, block_range: BlockRange,
                  columns: Callable[[], TableSchema], progress: SnapshotProgress,
                  on_wait: Callable[[str], None] | None = None, directory: str | None = None,
                  max_ahead_bytes: int = MAX_AHEAD_BYTES, wait_limit_seconds: float = 0.0,
                  on_blocked: Callable[[WaitReport], None] | None = None) -> Iterator[SpooledRange]:
    """Reads `block_range` under a temporary slot's exported snapshot, holding the table's lock
    until its COPY ends, and hands the chunks on through a spool file in `directory`.

    `columns` runs once the table is locked: the columns it reads from the current catalog then
    cannot change until the COPY has read them. Leaving the block before the
    chunks are exhausted stops the read.
    """
    source = ExitStack()
    spool: _Spool | None = None
    reader: threading.Thread | None = None
    released = threading.Event()
    try:
        slot = source.enter_context(exported_snapshot(dsn, on_wait=on_wait, table=f"{schema}.{table}",
                                                      wait_limit_seconds=wait_limit_seconds,
                                                      on_blocked=on_blocked))
        reading = source.enter_context(snapshot_transaction(dsn, slot.snapshot_name, schema, table))
        layout = table_layout(reading, schema, table)
        read_columns = columns()
        spool = _Spool(directory, max_ahead_bytes)
        reader = threading.Thread(target=_read_into, name=f"snapshot reader {schema}.{table}", daemon=True,
                                  args=(reading, read_columns, block_range, progress, spool, source, released))
        reader.start()
        yield SpooledRange(read_columns, slot.consistent_point, progress, spool, released, layout)
    finally:
        if spool is not None:
            spool.stop()
        if reader is not None:
            reader.join(STOP_WAIT_SECONDS)
            if reader.is_alive():  # waiting on a stalled server: cancel the COPY (safe from this thread)
                log.warning("a snapshot's COPY did not stop; cancelling it at the server")
                try:
                    reading.cancel()
                except Exception as error:
                    log.warning("cancelling a snapshot's COPY failed: %s", error)
            reader.join()
        source.close()  # the reader released it already, unless it never started
        if spool is not None:
            spool.close()


def _read_into(connection: psycopg.Connection[Any], table: TableSchema, block_range: BlockRange,
               progress: SnapshotProgress, spool: _Spool, source: ExitStack, released: threading.Event) -> None:
    error: BaseException | None = None
    try:
        chunks = read_locked_range(connection, table, block_range, progress)
        try:
            for chunk in chunks:
                if not spool.append(chunk):
                    break
        finally:
            chunks.close()  # a COPY left unfinished closes its connection, which ends it at the server
    except BaseException as failure:  # handed to the loader, which raises it
        error = failure
    finally:
        try:
            source.close()  # the transaction (and its lock), then the slot
            released.set()
        except Exception as failure:
            log.warning("releasing a snapshot's slot and transaction failed: %s", failure)
        spool.finish(error)
