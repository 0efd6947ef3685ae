"""Protocol version 2's streamed transactions, on captured bytes."""

from producer_service.pgoutput.decoders import (
    MessageDecoder,
    decode_delete,
    decode_insert,
    decode_logical_message,
    decode_stream_abort,
    decode_stream_commit,
    decode_stream_start,
    decode_stream_stop,
    decode_update,
)
from producer_service.pgoutput.messages import (
    Commit,
    Insert,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
)
from siphon_core.naming import parse_lsn
from siphon_core.wire.tuple_data import encode_tuple


def test_stream_start_says_whether_it_is_the_first_segment(captures):
    xid = captures.facts("stream_commit")["xid"]

    assert decode_stream_start(captures.message("stream_commit", "stream_start").payload) == StreamStart(xid, True)
    assert decode_stream_start(captures.message("stream_commit", "stream_start_2").payload) == StreamStart(xid, False)


def test_stream_stop_has_no_fields(captures):
    assert decode_stream_stop(captures.message("stream_commit", "stream_stop").payload) == StreamStop()


def test_stream_commit_carries_xid_lsns_and_commit_time(captures):
    facts = captures.facts("stream_commit")
    message = captures.message("stream_commit", "stream_commit")
    commit = decode_stream_commit(message.payload)

    assert type(commit) is StreamCommit
    assert (commit.xid, commit.flags) == (facts["xid"], 0)
    assert commit.end_lsn == message.data_start
    assert parse_lsn(facts["lsn_before"]) < commit.commit_lsn < commit.end_lsn <= parse_lsn(facts["lsn_after"])
    assert facts["time_before_us"] <= commit.commit_time <= facts["time_after_us"]


def test_stream_abort_of_a_whole_transaction_names_it_twice(captures):
    xid = captures.facts("stream_abort")["xid"]

    assert decode_stream_abort(captures.message("stream_abort", "stream_abort").payload) == StreamAbort(xid, xid)


def test_stream_abort_of_a_subtransaction_names_the_subtransaction(captures):
    facts = captures.facts("stream_abort_subtransaction")
    abort = decode_stream_abort(captures.message("stream_abort_subtransaction", "stream_abort").payload)

    assert abort == StreamAbort(facts["xid"], facts["subxid"])


def test_streamed_changes_carry_the_xid_of_their_subtransaction(captures):
    facts = captures.facts("stream_commit")
    bulk = facts["relations"]["capture.bulk"]["oid"]
    xid = facts["xid"]

    insert = decode_insert(captures.message("stream_commit", "insert").payload, in_stream=True)
    update = decode_update(captures.message("stream_commit", "update").payload, in_stream=True)
    delete = decode_delete(captures.message("stream_commit", "delete").payload, in_stream=True)
    message = decode_logical_message(captures.message("stream_commit", "message").payload, in_stream=True)
    in_subtransaction = decode_insert(captures.message("stream_abort_subtransaction", "insert").payload,
                                      in_stream=True)

    assert (insert.relation_id, insert.xid) == (bulk, xid)
    assert update.xid == delete.xid == message.xid == xid
    assert update.new_tuple == encode_tuple([b"1", b"updated"])
    assert (delete.old_kind, delete.old_tuple) == ("K", encode_tuple([b"3", None]))
    assert (message.transactional, message.prefix, message.content) == (True, "siphon.test", b"in stream")
    assert message.lsn == parse_lsn(facts["message_lsn"])
    assert in_subtransaction.xid == captures.facts("stream_abort_subtransaction")["subxid"]
    assert in_subtransaction.new_tuple == encode_tuple([b"30000", b"sub"])


def test_message_decoder_follows_stream_blocks(captures):
    decoder = MessageDecoder()
    decoded = [decoder.decode(message.payload) for message in captures.all("stream_commit")]
    xid = captures.facts("stream_commit")["xid"]

    # Stream control and every change, relation and message inside the blocks name the transaction.
    assert {message.xid for message in decoded if not isinstance(message, StreamStop)} == {xid}
    assert sum(isinstance(message, Insert) for message in decoded) == 3
    assert isinstance(decoded[-1], StreamCommit)
    assert not decoder.in_stream


def test_message_decoder_leaves_ordinary_transactions_alone(captures):
    decoder = MessageDecoder()
    decoded = [decoder.decode(message.payload) for message in captures.all("insert")]

    assert [type(message).__name__ for message in decoded] == ["Begin", "Relation", "Insert", "Insert", "Commit"]
    assert isinstance(decoded[-1], Commit)
    assert decoded[2].xid is None
