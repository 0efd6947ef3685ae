"""Insert, Update, Delete and Truncate, on captured bytes. Tuples stay raw; decode_tuple reads them here."""

from producer_service.pgoutput.decoders import decode_delete, decode_insert, decode_truncate, decode_update
from producer_service.pgoutput.messages import Delete, Insert, Truncate, Update
from siphon_core.wire.tuple_data import UNCHANGED_TOAST, decode_tuple, encode_tuple


def _oid(captures, scenario, table):
    return captures.facts(scenario)["relations"][table]["oid"]


def _values(tuple_bytes):
    values, end = decode_tuple(tuple_bytes)
    assert end == len(tuple_bytes)
    return values


def test_insert_keeps_the_new_row_as_raw_tuple_bytes(captures):
    insert = decode_insert(captures.message("insert", "insert").payload)

    assert type(insert) is Insert
    assert insert.relation_id == _oid(captures, "insert", "capture.items")
    assert insert.xid is None
    assert insert.new_tuple == encode_tuple([b"1", b"widget", b"12.50", b'{red,"light blue"}', None])


def test_insert_tells_null_from_empty_text_and_keeps_utf8_bytes(captures):
    insert = decode_insert(captures.message("insert", "insert_2").payload)

    assert _values(insert.new_tuple) == [b"2", b"", b"0.00", b"{}", "ünïcødé ✓".encode()]


def test_insert_in_binary_mode_carries_binary_values(captures):
    insert = decode_insert(captures.message("insert_binary", "insert").payload)
    values = _values(insert.new_tuple)

    assert insert.relation_id == _oid(captures, "insert_binary", "capture.items")
    assert insert.new_tuple[2:3] == b"b"  # kind byte of the first column
    assert values[0] == (5).to_bytes(4, "big")
    assert values[1] == b"binary"
    assert values[4] is None
    assert values[5] == (3).to_bytes(2, "big")


def test_update_without_key_change_has_no_old_tuple(captures):
    update = decode_update(captures.message("update", "update").payload)

    assert update == Update(
        relation_id=_oid(captures, "insert", "capture.items"),
        old_kind=None,
        old_tuple=None,
        new_tuple=encode_tuple([b"10", b"ten", b"13.75", b"{}", None]),
    )


def test_update_of_the_primary_key_sends_the_old_key(captures):
    update = decode_update(captures.message("update_primary_key", "update").payload)

    assert update.old_kind == "K"
    assert _values(update.old_tuple) == [b"11", None, None, None, None]  # only key columns are set
    assert _values(update.new_tuple) == [b"111", b"eleven", b"11.00", None, None]


def test_update_with_replica_identity_full_sends_the_old_row(captures):
    update = decode_update(captures.message("replica_identity_full", "update").payload)

    assert update == Update(
        relation_id=_oid(captures, "replica_identity_full", "capture.full_rows"),
        old_kind="O",
        old_tuple=encode_tuple([b"1", b"before"]),
        new_tuple=encode_tuple([b"1", b"after"]),
    )


def test_update_leaving_a_toasted_value_unchanged_marks_it(captures):
    update = decode_update(captures.message("toast_unchanged", "update").payload)

    assert update.relation_id == _oid(captures, "toast_unchanged", "capture.docs")
    assert update.old_kind is None
    assert _values(update.new_tuple) == [b"1", b"renamed", UNCHANGED_TOAST]


def test_delete_sends_the_old_key(captures):
    delete = decode_delete(captures.message("delete", "delete").payload)

    assert delete == Delete(
        relation_id=_oid(captures, "insert", "capture.items"),
        old_kind="K",
        old_tuple=encode_tuple([b"12", None, None, None, None]),
    )


def test_delete_with_replica_identity_full_sends_the_old_row(captures):
    delete = decode_delete(captures.message("replica_identity_full", "delete").payload)

    assert delete == Delete(
        relation_id=_oid(captures, "replica_identity_full", "capture.full_rows"),
        old_kind="O",
        old_tuple=encode_tuple([b"2", b"doomed"]),
    )


def test_truncate_lists_relations_with_cascade_and_restart_identity(captures):
    truncate = decode_truncate(captures.message("truncate_cascade", "truncate").payload)

    assert truncate == Truncate(
        options=3,
        relation_ids=(_oid(captures, "truncate_cascade", "capture.parents"),
                      _oid(captures, "truncate_cascade", "capture.children")),
    )
    assert truncate.cascade and truncate.restart_identity


def test_plain_truncate_has_no_options(captures):
    truncate = decode_truncate(captures.message("truncate", "truncate").payload)

    assert truncate == Truncate(options=0, relation_ids=(_oid(captures, "truncate", "capture.logs"),))
    assert not truncate.cascade and not truncate.restart_identity


def test_changes_of_a_multi_relation_transaction_name_their_relation(captures):
    items = _oid(captures, "multi_relation", "capture.items")
    moods = _oid(captures, "multi_relation", "capture.moods")

    first = decode_insert(captures.message("multi_relation", "insert").payload)
    second = decode_insert(captures.message("multi_relation", "insert_2").payload)
    update = decode_update(captures.message("multi_relation", "update").payload)

    assert (first.relation_id, second.relation_id, update.relation_id) == (items, moods, items)
    assert _values(second.new_tuple) == [b"2", b"ok", b"7"]
    assert _values(update.new_tuple) == [b"3", b"gadget", b"7.00", None, b"both"]
