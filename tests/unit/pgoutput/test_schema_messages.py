"""Relation and Type, on captured bytes; expected columns come from the catalog at capture time."""

from producer_service.pgoutput.decoders import decode_relation, decode_type
from producer_service.pgoutput.messages import Relation, RelationColumn, Type


def _catalog_relation(captures, scenario, table, full_identity=False, xid=None):
    facts = captures.facts(scenario)["relations"][table]
    namespace, name = table.split(".")
    columns = tuple(
        # With REPLICA IDENTITY FULL every column is part of the identity.
        RelationColumn(1 if (is_key or full_identity) else 0, column, type_oid, type_modifier)
        for column, type_oid, type_modifier, is_key in facts["columns"]
    )
    return Relation(facts["oid"], namespace, name, facts["replica_identity"], columns, xid)


def test_relation_lists_columns_with_key_flag_type_and_modifier(captures):
    relation = decode_relation(captures.message("insert", "relation").payload)

    assert relation == _catalog_relation(captures, "insert", "capture.items")
    assert relation.replica_identity == "d"
    assert [column.is_key for column in relation.columns] == [True, False, False, False, False]
    assert relation.columns[2] == RelationColumn(0, "price", 1700, (10 << 16 | 2) + 4)  # numeric(10,2)


def test_relation_with_replica_identity_full_flags_every_column(captures):
    relation = decode_relation(captures.message("replica_identity_full", "relation").payload)

    assert relation == _catalog_relation(captures, "replica_identity_full", "capture.full_rows", full_identity=True)
    assert relation.replica_identity == "f"


def test_relation_is_sent_again_with_a_new_column(captures):
    relation = decode_relation(captures.message("relation_after_add_column", "relation").payload)

    assert relation == _catalog_relation(captures, "relation_after_add_column", "capture.items")
    assert relation.columns[-1] == RelationColumn(0, "qty", 21, -1)


def test_relation_in_a_streamed_block_carries_the_xid(captures):
    message = captures.message("stream_commit", "relation")
    relation = decode_relation(message.payload, in_stream=message.in_stream)

    assert message.in_stream
    assert relation == _catalog_relation(captures, "stream_commit", "capture.bulk",
                                         xid=captures.facts("stream_commit")["xid"])


def test_type_describes_an_enum(captures):
    type_oids = captures.facts("enum_and_domain")["types"]

    assert decode_type(captures.message("enum_and_domain", "type").payload) == Type(
        type_oids["mood"], "capture", "mood")


def test_type_of_a_domain_names_its_base_type(captures):
    # pgoutput sends the domain's OID with the base type's name; pg_catalog is sent as "".
    type_oids = captures.facts("enum_and_domain")["types"]

    assert decode_type(captures.message("enum_and_domain", "type_2").payload) == Type(
        type_oids["positive"], "", "int4")
