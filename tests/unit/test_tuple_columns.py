"""The vectorized TupleData split against the per-row decoder, on every kind of value and layout."""

import random

import pyarrow as pa
import pytest

from siphon_core.wire.tuple_columns import MalformedTupleError, split_tuples
from siphon_core.wire.tuple_data import UNCHANGED_TOAST, decode_tuple, encode_tuple

LAYOUT = b"\x00\x05" b"n" b"u" b"t\x00\x00\x00\x00" b"t\x00\x00\x00\x02ab" b"b\x00\x00\x00\x02\x00\xff"


def _random_value(rng: random.Random):
    draw = rng.random()
    if draw < 0.1:
        return None
    if draw < 0.15:
        return UNCHANGED_TOAST
    if draw < 0.17:
        return bytes([rng.randrange(256)]) * rng.choice([70_000, 13, 12, 11])  # long, and around the inline size
    return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))


def _expected(rows, column):
    return [None if row is None or row[column] is UNCHANGED_TOAST else row[column] for row in rows]


def test_each_kind_of_value_is_located_as_the_row_decoder_reads_it():
    located = split_tuples(pa.array([LAYOUT]), 5)

    decoded, _ = decode_tuple(LAYOUT)
    assert [located.values(i).cast(pa.binary())[0].as_py() for i in range(5)] == \
        [None if v is UNCHANGED_TOAST else v for v in decoded]
    assert located.unchanged().to_pylist() == [[1]]


def test_rows_without_unchanged_values_say_so_without_a_walk():
    rows = [[b"1", None, b"x"], None, [b"2", b"", None]]
    located = split_tuples(pa.array([None if row is None else encode_tuple(row) for row in rows], pa.binary()), 3)
    assert not located.has_unchanged
    assert located.unchanged().to_pylist() == [None, None, None]
    assert located.unchanged([2, 0]).to_pylist() == [None, None]
    assert located.unchanged([2, 0]).type == pa.list_(pa.int32())
    assert split_tuples(pa.array([LAYOUT]), 5).has_unchanged


@pytest.mark.parametrize("seed", range(5))
def test_random_rows_split_exactly_like_the_row_decoder(seed):
    rng = random.Random(seed)
    width = rng.randrange(1, 9)
    rows = [None if rng.random() < 0.05 else [_random_value(rng) for _ in range(width)] for _ in range(500)]
    rows.append([b"z"] * width)  # the buffer's last bytes are a one-byte value
    array = pa.array([None if row is None else encode_tuple(row) for row in rows], pa.binary())
    start = rng.randrange(0, 5)  # a slice: the Arrow offsets do not start at 0
    rows, array = rows[start:], array.slice(start)

    located = split_tuples(pa.chunked_array([array.slice(0, 100), array.slice(100)]), width)

    for column in range(width):
        assert located.values(column).cast(pa.binary()).to_pylist() == _expected(rows, column)
    expected_unchanged = [None if row is None else [i for i, v in enumerate(row) if v is UNCHANGED_TOAST] or None
                          for row in rows]
    assert located.unchanged().to_pylist() == expected_unchanged
    assert located.has_unchanged == any(row is not None and UNCHANGED_TOAST in row for row in rows)
    key_columns = sorted(rng.sample(range(width), min(2, width)))
    expected_keys = [None if row is None or any(row[i] is None or row[i] is UNCHANGED_TOAST for i in key_columns)
                     else encode_tuple([row[i] for i in key_columns]) for row in rows]
    assert located.key(key_columns).to_pylist() == expected_keys


def test_an_empty_column_and_empty_values():
    assert split_tuples(pa.array([], pa.binary()), 3).values(0).to_pylist() == []
    located = split_tuples(pa.array([encode_tuple([b"", b""])]), 2)
    assert located.values(1).cast(pa.binary()).to_pylist() == [b""]


@pytest.mark.parametrize(("data", "columns", "message"), [
    (encode_tuple([b"a", b"b"]), 3, "row 1: the tuple has 2 columns, expected 3"),
    (b"\x00\x01x", 1, "row 1: unknown column kind b'x' (column 0)"),
    (b"\x00\x01t\x00\x00\x00\x05ab", 1, "row 1: truncated TupleData: its values need 12 bytes, it has 9"),
    (encode_tuple([b"a"]) + b"zz", 1, "row 1: 2 bytes follow the tuple's last value"),
    (b"\x00", 1, "row 1: the tuple has"),
])
def test_a_malformed_row_is_named_with_what_is_wrong(data, columns, message):
    good = encode_tuple([b"v"] * columns)

    with pytest.raises(MalformedTupleError) as raised:
        split_tuples(pa.array([good, data, good]), columns)

    assert str(raised.value).startswith(message)
    assert raised.value.row == 1


def test_the_set_up_compiles_every_loop_a_decode_runs():
    from siphon_core.wire import compiled, tuple_columns

    compiled.compile_all()
    for loop in (tuple_columns._check, tuple_columns._gather_values, tuple_columns._gather_keys,
                 tuple_columns._unchanged_positions):
        assert loop.signatures, f"{loop.__name__} was not compiled by the set-up"
