"""Begin, Commit, Origin and logical decoding Message, on captured bytes."""

from producer_service.pgoutput.decoders import (
    decode_begin,
    decode_commit,
    decode_logical_message,
    decode_origin,
)
from producer_service.pgoutput.messages import Begin, Commit, LogicalMessage, Origin
from siphon_core.naming import parse_lsn


def _window(captures, scenario):
    facts = captures.facts(scenario)
    return parse_lsn(facts["lsn_before"]), parse_lsn(facts["lsn_after"]), facts["time_before_us"], facts["time_after_us"]


def test_begin_carries_the_final_lsn_commit_time_and_xid(captures):
    lsn_before, lsn_after, time_before, time_after = _window(captures, "insert")
    begin = decode_begin(captures.message("insert", "begin").payload)
    commit = decode_commit(captures.message("insert", "commit").payload)

    assert type(begin) is Begin
    assert begin.xid == captures.facts("insert")["xid"]
    assert begin.final_lsn == commit.commit_lsn
    assert lsn_before < begin.final_lsn < lsn_after
    assert time_before <= begin.commit_time <= time_after  # Unix epoch microseconds


def test_commit_carries_flags_commit_and_end_lsn_and_commit_time(captures):
    lsn_before, lsn_after, time_before, time_after = _window(captures, "update")
    message = captures.message("update", "commit")
    commit = decode_commit(message.payload)
    begin = decode_begin(captures.message("update", "begin").payload)

    assert type(commit) is Commit
    assert commit.flags == 0
    assert commit.commit_lsn == begin.final_lsn
    assert commit.end_lsn == message.data_start  # the walsender reports the commit at its end
    assert lsn_before < commit.commit_lsn < commit.end_lsn <= lsn_after
    assert commit.commit_time == begin.commit_time
    assert time_before <= commit.commit_time <= time_after


def test_origin_carries_the_origin_lsn_and_name_and_begin_the_origin_commit_time(captures):
    facts = captures.facts("origin")
    origin = decode_origin(captures.message("origin", "origin").payload)
    begin = decode_begin(captures.message("origin", "begin").payload)

    assert origin == Origin(commit_lsn=parse_lsn(facts["origin_lsn"]), name=facts["origin_name"])
    # Decoding reports the origin's commit timestamp (2024-01-02 03:04:05.678901 UTC) for such a transaction.
    assert begin.commit_time == facts["origin_time_us"] == 1_704_164_645_678_901
    assert begin.xid == facts["xid"]


def test_transactional_message_keeps_prefix_content_bytes_and_lsn(captures):
    facts = captures.facts("logical_message")
    message = decode_logical_message(captures.message("logical_message", "message").payload)

    assert message == LogicalMessage(
        transactional=True,
        lsn=parse_lsn(facts["message_lsn"]),
        prefix="siphon.test",
        content=b"\x00\xffhi\n",
        xid=None,
    )


def test_standalone_message_is_not_transactional_and_may_be_empty(captures):
    facts = captures.facts("logical_message")
    message = decode_logical_message(captures.message("logical_message", "message_2").payload)

    assert message == LogicalMessage(
        transactional=False,
        lsn=parse_lsn(facts["standalone_message_lsn"]),
        prefix="siphon.heartbeat",
        content=b"",
    )
