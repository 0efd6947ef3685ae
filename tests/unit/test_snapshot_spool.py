"""The spool between a snapshot's reader thread and its loader: every chunk, whole and in order,
a bounded lead, and a reader's failure raised to the loader after what was read."""

from __future__ import annotations

import threading
import time

import pytest

from siphon_dagster.snapshot.spool import SnapshotReadError, _Spool


def fill(spool: _Spool, chunks: list[bytes], error: BaseException | None = None) -> threading.Thread:
    def write() -> None:
        for chunk in chunks:
            if not spool.append(chunk):
                break
        spool.finish(error)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


# Every chunk in the file, some in memory and some in the file as the lead comes and goes, all in memory.
@pytest.mark.parametrize("memory_bytes", [0, 20_000, 1 << 30])
def test_the_loader_gets_every_chunk_whole_and_in_order(tmp_path, memory_bytes: int) -> None:
    chunks = [bytes([i % 256]) * (1 + i * 37 % 5000) for i in range(500)]
    spool = _Spool(str(tmp_path), max_ahead_bytes=1 << 30, memory_bytes=memory_bytes)
    writer = fill(spool, chunks)
    assert list(spool.chunks()) == chunks
    writer.join(5)
    spool.close()


def test_the_reader_stays_at_most_max_ahead_bytes_in_front(tmp_path) -> None:
    spool = _Spool(str(tmp_path), max_ahead_bytes=3000)
    writer = fill(spool, [b"x" * 1000] * 10)
    time.sleep(0.3)
    assert spool._written - spool._taken <= 4000  # it may pass the bound by the chunk that crossed it
    taken = list(spool.chunks())
    assert len(taken) == 10
    writer.join(5)
    spool.close()


def test_only_the_lead_beyond_the_memory_bound_goes_to_the_file(tmp_path) -> None:
    spool = _Spool(str(tmp_path), max_ahead_bytes=1 << 30, memory_bytes=2500)
    fill(spool, [b"x" * 1000] * 10).join(5)  # nothing taken yet: a lead of 10,000 bytes
    assert (spool._in_memory, spool._file_size) == (2000, 8000)
    taken = spool.chunks()
    assert [next(taken), next(taken)] == [b"x" * 1000] * 2
    assert spool._in_memory == 0  # the memory went with the chunks; the file holds the rest
    assert list(taken) == [b"x" * 1000] * 8
    spool.close()


def test_a_failed_read_is_raised_after_the_chunks_read_before_it(tmp_path) -> None:
    spool = _Spool(str(tmp_path), max_ahead_bytes=1 << 30)
    fill(spool, [b"a\n", b"b\n"], ConnectionError("server closed the connection"))
    received = []
    with pytest.raises(SnapshotReadError, match="server closed the connection"):
        for chunk in spool.chunks():
            received.append(chunk)
    assert received == [b"a\n", b"b\n"]
    spool.close()


def test_a_stopped_loader_stops_a_waiting_reader(tmp_path) -> None:
    spool = _Spool(str(tmp_path), max_ahead_bytes=0)
    writer = fill(spool, [b"x"] * 100)
    time.sleep(0.1)
    spool.stop()
    writer.join(5)
    assert not writer.is_alive()
    assert spool._written <= 2
    spool.close()


def test_a_missing_spool_directory_names_the_setting(tmp_path) -> None:
    with pytest.raises(SnapshotReadError, match="snapshot_spool_directory"):
        _Spool(str(tmp_path / "missing"), max_ahead_bytes=0)
