"""decode_message: dispatch on the first byte, and clear errors for bytes that are not pgoutput."""

import struct

import pytest

from producer_service.pgoutput import decoders
from producer_service.pgoutput.decoders import PgoutputError, decode_message

DECODER_BY_NAME = {
    "begin": decoders.decode_begin, "commit": decoders.decode_commit, "origin": decoders.decode_origin,
    "relation": decoders.decode_relation, "type": decoders.decode_type, "insert": decoders.decode_insert,
    "update": decoders.decode_update, "delete": decoders.decode_delete, "truncate": decoders.decode_truncate,
    "message": decoders.decode_logical_message, "stream_start": decoders.decode_stream_start,
    "stream_stop": decoders.decode_stream_stop, "stream_commit": decoders.decode_stream_commit,
    "stream_abort": decoders.decode_stream_abort,
}


def test_every_captured_message_type_is_dispatched_to_its_decoder(captures):
    seen = set()
    for scenario in captures.scenarios():
        for name in captures.names(scenario):
            message = captures.message(scenario, name)
            kind = name.rstrip("_0123456789")
            expected = DECODER_BY_NAME[kind](message.payload, message.in_stream)
            assert decode_message(message.payload, message.in_stream) == expected
            assert decode_message(memoryview(message.payload), message.in_stream) == expected
            seen.add(kind)
    assert seen == set(DECODER_BY_NAME)


def test_unknown_message_type_names_the_byte_and_offset():
    with pytest.raises(PgoutputError, match=r"unknown pgoutput message type b'X' \(0x58\) at offset 0"):
        decode_message(b"X\x00\x00")


def test_empty_message_is_an_error():
    with pytest.raises(PgoutputError, match="empty"):
        decode_message(b"")


@pytest.mark.parametrize("scenario,name", [("insert", "begin"), ("insert", "relation"), ("update", "commit"),
                                           ("logical_message", "message"), ("truncate", "truncate")])
def test_truncated_message_is_an_error_naming_the_type(captures, scenario, name):
    payload = captures.message(scenario, name).payload

    with pytest.raises(PgoutputError, match=f"malformed pgoutput '{chr(payload[0])}' message"):
        decode_message(payload[: len(payload) // 2])


def test_update_with_a_bad_tuple_marker_names_the_offset():
    payload = b"U" + struct.pack(">I", 42) + b"Z"

    with pytest.raises(PgoutputError, match=r"expected 'N', 'K' or 'O' at offset 5, found b'Z'"):
        decode_message(payload)


def test_update_whose_old_tuple_is_not_followed_by_the_new_one_is_an_error():
    payload = b"U" + struct.pack(">I", 42) + b"K" + b"\x00\x01n" + b"X"

    with pytest.raises(PgoutputError, match=r"expected 'N' at offset 9, found b'X'"):
        decode_message(payload)
