"""Messages no producer writes, on a table's subject: each is refused as a bad message (PackageError,
which the table's `on_error` dead-letters or stops on), never taken for a schema change, never a
crash or a hang, and never expanded past the limit."""

from __future__ import annotations

import random

import pytest
import zstandard

from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import PackageError, encode_package
from siphon_dagster.streaming.batch import PackageAssembler, ReceivedPackage
from tests.unit.test_streaming_packages import NOTES, delete, insert, truncate

LIMIT = 4 << 20


def assembler() -> PackageAssembler:
    return PackageAssembler("public", "notes", max_package_bytes=LIMIT)


def package(*events: pb.Event, schema: str = "public", table: str = "notes",
            columns: tuple[pb.Column, ...] = NOTES) -> pb.Package:
    return pb.Package(application_identifier="app", schema=schema, table=table, columns=columns,
                      events=list(events), value_encoding=pb.PGOUTPUT_TUPLE)


VALID = package(insert(10, "1", "a", "3"), insert(11, "2", None, "4"), delete(12, "1"), truncate(13))


def test_a_valid_package_is_accepted() -> None:
    received = assembler().accept(1, encode_package(VALID))
    assert isinstance(received, ReceivedPackage)
    assert received.operations == {"insert": 2, "delete": 1, "truncate": 1}


@pytest.mark.parametrize(("payload", "reason"), [
    (zstandard.ZstdCompressor().compress(b""), "an empty package"),  # the 9-byte message
    (b"", "not a zstd"),
    (b"\x28\xb5\x2f\xfd", "not a zstd"),
    (encode_package(package()), "without events"),
    (encode_package(package(insert(10, "1", "a", "3"), table="other")), "on the subject of public.notes"),
    (encode_package(package(insert(10, "1", "a", "3"), columns=())), "without columns"),
    (encode_package(package(insert(10, "1", "a", "3"), columns=tuple(
        pb.Column(name=c.name, type_oid=c.type_oid, type_name=c.type_name) for c in NOTES))), "no primary key"),
    (encode_package(package(insert(10, "1", "a", "3"), columns=NOTES + NOTES[:1])), "repeat a name"),
    (encode_package(package(pb.Event(operation=9, commit_lsn=5, position=1))), "unknown operations"),
    (encode_package(package(pb.Event(commit_lsn=5, position=1))), "unknown operations"),
    (encode_package(pb.Package(schema="public", table="notes", columns=NOTES, chunk=pb.Chunk(index=3, count=2),
                               event_chunk=b"x")), "event slice 3 of 2"),
])
def test_messages_no_producer_writes_are_bad_messages(payload: bytes, reason: str) -> None:
    with pytest.raises(PackageError, match=reason):
        assembler().accept(7, payload)


def test_a_decompression_bomb_is_refused_without_expanding_it() -> None:
    declared = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    undeclared = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20))
    assert len(declared) < 8192 and len(undeclared) < 8192
    for bomb in (declared, undeclared):
        with pytest.raises(PackageError, match="4,194,304 bytes"):
            assembler().accept(7, bomb)


def mutations(rnd: random.Random, serialized: bytes) -> bytes:
    data = bytearray(serialized)
    kind = rnd.randrange(5)
    if kind == 0 and data:  # flip bits
        for _ in range(rnd.randint(1, 8)):
            data[rnd.randrange(len(data))] ^= 1 << rnd.randrange(8)
    elif kind == 1:  # truncate
        del data[rnd.randrange(len(data) + 1):]
    elif kind == 2:  # random bytes inserted
        at = rnd.randrange(len(data) + 1)
        data[at:at] = rnd.randbytes(rnd.randint(1, 16))
    elif kind == 3:  # a slice repeated
        at = rnd.randrange(len(data) + 1)
        data[at:at] = data[at:at + rnd.randint(1, 32)]
    else:  # random bytes
        data = bytearray(rnd.randbytes(rnd.randint(0, 256)))
    return bytes(data)


def test_thousands_of_random_and_mutated_packages_end_accepted_or_refused_never_crashing() -> None:
    rnd = random.Random(20261125)
    serialized = VALID.SerializeToString()
    outcomes = {"accepted": 0, "refused": 0}
    for index in range(4000):
        mutated = mutations(rnd, serialized)
        # Half are mutated before compression (valid zstd, damaged protobuf), half after.
        payload = zstandard.ZstdCompressor().compress(mutated) if index % 2 else mutations(rnd, encode_package(VALID))
        try:
            received = assembler().accept(index, payload)
        except PackageError as error:
            assert str(error).startswith(f"stream sequence {index}: ")
            outcomes["refused"] += 1
            continue
        if received is not None:  # what passes is a whole package of this table with a key
            assert received.columns and any(c.primary_key for c in received.columns)
            outcomes["accepted"] += 1
    assert outcomes["refused"] > 1000 and outcomes["accepted"] > 10, outcomes
