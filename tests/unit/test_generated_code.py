from siphon_core.wire import generate


def test_generated_protobuf_code_matches_the_proto_file():
    assert generate.stale_files() == [], "run `python -m siphon_core.wire.generate` and commit the result"


def test_field_tags_are_the_ones_the_generated_code_writes() -> None:
    from siphon_core.wire import fields
    from siphon_core.wire import siphon_pb2 as pb

    def first_tag(message) -> bytes:
        return message.SerializeToString()[:1]

    assert first_tag(pb.Event(operation=pb.UPDATE)) == fields.EVENT_OPERATION_TAG
    assert first_tag(pb.Event(xid=7)) == fields.EVENT_XID_TAG
    assert first_tag(pb.Event(commit_lsn=7)) == fields.EVENT_COMMIT_LSN_TAG
    assert first_tag(pb.Event(position=7)) == fields.EVENT_POSITION_TAG
    assert first_tag(pb.Event(commit_time_us=7)) == fields.EVENT_COMMIT_TIME_TAG
    assert first_tag(pb.Event(new_row=pb.Row(tuple=b"x"))) == fields.EVENT_NEW_ROW_TAG
    assert first_tag(pb.Event(old_row=pb.Row(tuple=b"x"))) == fields.EVENT_OLD_ROW_TAG
    assert first_tag(pb.Event(old_row_is_full=True)) == fields.EVENT_OLD_IS_FULL_TAG
    assert first_tag(pb.Event(old_row_is_key=True)) == fields.EVENT_OLD_IS_KEY_TAG
    assert first_tag(pb.Row(tuple=b"x")) == fields.ROW_TUPLE_TAG
    assert first_tag(pb.Package(events=[pb.Event(xid=1)])) == fields.PACKAGE_EVENTS_TAG
    assert fields.EVENT_FIELD_RANGE == (1, 9)
