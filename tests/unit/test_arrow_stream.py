"""A ClickHouse batch's Arrow IPC stream, kept as the writer's pieces: the same bytes as a stream
written whole, the columns' large buffers sent as they are."""

from __future__ import annotations

import pyarrow as pa
import pytest

from siphon_dagster.targets.clickhouse import ArrowStream


def _table(rows: int) -> pa.Table:
    return pa.table({
        "id": pa.array(range(rows), pa.int64()),
        "note": pa.array([f"note {i} " * (i % 7) for i in range(rows)], pa.string()),
        "maybe": pa.array([None if i % 3 else i for i in range(rows)], pa.int32()),
        "blob": pa.array([bytes([i % 256]) * (i % 11) for i in range(rows)], pa.binary()),
    })


def _written_whole(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("table", [
    _table(200_000),
    _table(200_000).slice(1_234, 50_000),
    pa.concat_tables([_table(100), _table(5_000).slice(17, 300)]),
    _table(0),
], ids=["large", "sliced", "chunked", "empty"])
def test_the_pieces_are_the_stream_written_whole(table):
    stream = ArrowStream.of(table)
    joined = stream.joined()
    assert joined == _written_whole(table)
    assert stream.size == len(joined) == sum(len(piece) for piece in stream.pieces)
    assert pa.ipc.open_stream(joined).read_all().equals(table)


def test_a_large_column_buffer_is_a_piece_of_its_own_not_a_copy():
    table = _table(200_000)
    stream = ArrowStream.of(table)
    values = table.column("id").chunk(0).buffers()[1]
    shared = [piece for piece in stream.pieces
              if isinstance(piece, memoryview) and pa.py_buffer(piece).address == values.address]
    assert len(shared) == 1 and len(shared[0]) == values.size


def test_small_messages_are_gathered_into_few_pieces():
    stream = ArrowStream.of(_table(10))
    assert len(stream.pieces) == 1
