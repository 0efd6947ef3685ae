import pickle
import struct

import pytest

from siphon_core.wire.tuple_data import (
    UNCHANGED_TOAST,
    TupleDataError,
    decode_tuple,
    encode_tuple,
    project_tuple,
    tuple_end,
)

# Int16 count; 'n'; 'u'; 't' empty; 't' "ab"; 'b' two bytes.
LAYOUT = b"\x00\x05" b"n" b"u" b"t\x00\x00\x00\x00" b"t\x00\x00\x00\x02ab" b"b\x00\x00\x00\x02\x00\xff"


def test_decode_reads_each_kind_of_column():
    values, end = decode_tuple(LAYOUT)

    assert values == [None, UNCHANGED_TOAST, b"", b"ab", b"\x00\xff"]
    assert end == len(LAYOUT)


def test_null_unchanged_empty_and_value_stay_distinct_through_a_round_trip():
    values = [None, UNCHANGED_TOAST, b"", b"value", "tëxt", b"\x80 not utf-8 \xff"]

    decoded, _ = decode_tuple(encode_tuple(values))

    assert decoded == [None, UNCHANGED_TOAST, b"", b"value", "tëxt".encode(), b"\x80 not utf-8 \xff"]
    assert decoded[1] is UNCHANGED_TOAST


def test_encode_writes_the_pgoutput_layout():
    assert encode_tuple([None, UNCHANGED_TOAST, b"", b"ab"]) == (
        b"\x00\x04" b"n" b"u" b"t\x00\x00\x00\x00" b"t\x00\x00\x00\x02ab")


def test_decode_starts_at_an_offset_and_accepts_memoryview():
    buffer = b"prefix" + LAYOUT + b"rest"

    values, end = decode_tuple(memoryview(buffer), 6)

    assert values == [None, UNCHANGED_TOAST, b"", b"ab", b"\x00\xff"]
    assert all(type(value) is bytes for value in values[2:])
    assert buffer[end:] == b"rest"


def test_empty_tuple():
    assert decode_tuple(encode_tuple([])) == ([], 2)


def test_tuple_end_finds_where_the_next_part_of_a_message_starts():
    buffer = b"K" + LAYOUT + b"N" + encode_tuple([b"x"])

    end = tuple_end(buffer, 1)

    assert end == 1 + len(LAYOUT)
    assert buffer[end:end + 1] == b"N"
    assert tuple_end(memoryview(buffer), end + 1) == len(buffer)


def test_project_keeps_the_listed_columns_in_order():
    data = encode_tuple([b"0", None, b"2", UNCHANGED_TOAST, b"4", b"5"])

    assert project_tuple(data, [0, 2, 3, 4]) == encode_tuple([b"0", b"2", UNCHANGED_TOAST, b"4"])
    assert project_tuple(data, [5, 0]) == encode_tuple([b"5", b"0"])
    assert project_tuple(data, list(range(6))) == data
    assert project_tuple(data, []) == encode_tuple([])
    assert project_tuple(memoryview(data), [1, 2]) == encode_tuple([None, b"2"])


def test_project_rejects_an_index_out_of_range():
    with pytest.raises(TupleDataError, match="column index 3 is out of range for a tuple of 3 columns"):
        project_tuple(encode_tuple([b"a", b"b", b"c"]), [0, 3])


@pytest.mark.parametrize("function", [lambda data: decode_tuple(data), tuple_end, lambda data: project_tuple(data, [0])])
def test_unknown_kind_names_the_byte_offset_and_column(function):
    data = b"\x00\x02" b"n" b"x\x00\x00\x00\x00"

    with pytest.raises(TupleDataError, match=r"unknown column kind b'x' at offset 3 \(column 1\)"):
        function(data)


@pytest.mark.parametrize("data", [
    b"",  # no count
    b"\x00",  # half a count
    b"\x00\x02n",  # fewer columns than counted
    b"\x00\x01t\x00\x00",  # half a length
    b"\x00\x01t\x00\x00\x00\x05abc",  # value shorter than its length
    b"\x00\x01t" + struct.pack(">i", -1) + b"abc",  # a negative length read as huge
])
@pytest.mark.parametrize("function", [lambda data: decode_tuple(data), tuple_end, lambda data: project_tuple(data, [])])
def test_truncated_input_is_a_clear_error(function, data):
    with pytest.raises(TupleDataError, match="truncated TupleData: the tuple starting at offset 0 runs past the end"):
        function(data)


def test_unchanged_toast_survives_pickling_as_the_same_object():
    assert pickle.loads(pickle.dumps(UNCHANGED_TOAST)) is UNCHANGED_TOAST
    assert repr(UNCHANGED_TOAST) == "UNCHANGED_TOAST"
