"""The Spark plan's decode stage and the driver's merge run as plain functions: however the
changes are cut into tasks and pieces, exactly the latest change of every key survives."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import encode_package
from siphon_core.wire.tuple_data import UNCHANGED_TOAST, encode_tuple
from siphon_dagster.streaming import spark_plan
from siphon_dagster.streaming.batch import describe
from siphon_dagster.streaming.decode import (
    DECODED_SCHEMA,
    INPUT_FILE_SCHEMA,
    INPUT_SCHEMA,
    AsSentRows,
    DecodeSpec,
    locate_changes,
)
from siphon_dagster.streaming.fold import latest_indices, merge_pieces, with_version
from tests.unit.test_streaming_packages import NOTES, delete, insert, package, truncate, update

SPEC = DecodeSpec(tuple(c.name for c in NOTES), ("id",))


def _random_packages(seed: int) -> tuple[list[pb.Package], dict[str, tuple[int, int, list]]]:
    """Packages of random changes to 30 keys, and each key's expected latest (op, version, values)."""
    rng = random.Random(seed)
    packages, latest = [], {}
    lsn = 100
    for _ in range(12):
        events = []
        for _ in range(rng.randrange(1, 40)):
            lsn += rng.randrange(1, 3)
            position = rng.randrange(1, 4)
            key = str(rng.randrange(30))
            values = [key, f"body {lsn}", str(position)]
            kind = rng.random()
            if kind < 0.4:
                events.append(insert(lsn, *values, position=position))
            elif kind < 0.8:
                events.append(update(lsn, *values, position=position))
            else:
                events.append(delete(lsn, key, None, None, position=position))  # pgoutput sends every column
                values = [key, None, None]
            op = events[-1].operation
            version = naming.row_version(lsn, position)
            if key not in latest or latest[key][1] < version:
                latest[key] = (op, version, values)
        packages.append(package(events))
    rng.shuffle(packages)  # stream order does not matter to the fold
    return packages, latest


def _run_stages(packages: list[pb.Package], tasks: int, directory: str | None = None,
                superseded_allowed: bool = False) -> pa.Table:
    """The decode stage over `tasks` slices of the packages, then the driver's merge. With a
    `directory`, the packages are read from a file there and the results are files there; else
    both go as values, as through Spark Connect."""
    received = [describe(p, (i + 1,), encode_package(p)) for i, p in enumerate(packages)]
    rows = spark_plan.package_rows(received, directory)
    assert rows.schema == (INPUT_SCHEMA if directory is None else INPUT_FILE_SCHEMA)
    pieces = []
    for task in range(tasks):
        mine = rows.take([i for i in range(len(packages)) if i % tasks == task])
        stage = spark_plan.DecodeStage(SPEC, None, directory=directory)
        pieces += [piece for batch in mine.to_batches() for out in stage(iter([batch]))
                   for piece in spark_plan._results(out)]
    return spark_plan.merge_folded(pieces, len(SPEC.columns), superseded_allowed=superseded_allowed)


@pytest.mark.parametrize("route", ["values", "files"])
@pytest.mark.parametrize("flush_bytes", [1, 1 << 30])
@pytest.mark.parametrize("tasks", [1, 3])
def test_any_cut_into_tasks_and_pieces_keeps_each_keys_latest_change(monkeypatch, tmp_path, flush_bytes, tasks, route):
    monkeypatch.setattr(spark_plan, "DECODED_BYTES_PER_FLUSH", flush_bytes)
    packages, latest = _random_packages(seed=tasks + flush_bytes % 7)

    rows = _run_stages(packages, tasks, str(tmp_path) if route == "files" else None)

    left = [path.name for path in tmp_path.iterdir()]
    assert left == ([spark_plan.PACKAGES_FILE] if route == "files" else []), \
        "the driver removes each result file it read; the packages file goes with the directory"

    got = {}
    for row in rows.to_pylist():
        key = row["c0"].decode()
        assert key not in got, f"key {key} survived twice"
        values = [None if row[f"c{i}"] is None else row[f"c{i}"].decode() for i in range(3)]
        got[key] = (row["_op"], int(row["_version"]), values)
    assert got == latest


def _latest_by_version(rows: pa.Table) -> dict[str, tuple[int, int, list]]:
    """Each key's row of greatest version, as a target that keeps the greatest version stores it."""
    stored: dict[str, tuple[int, int, list]] = {}
    for row in rows.to_pylist():
        key = row["c0"].decode()
        values = [None if row[f"c{i}"] is None else row[f"c{i}"].decode() for i in range(3)]
        if key not in stored or stored[key][1] < int(row["_version"]):
            stored[key] = (row["_op"], int(row["_version"]), values)
    return stored


@pytest.mark.parametrize("tasks", [1, 3])
def test_where_superseded_rows_are_allowed_tasks_pieces_are_put_together_unmerged(monkeypatch, tasks):
    monkeypatch.setattr(spark_plan, "DECODED_BYTES_PER_FLUSH", 1)  # a piece per package: keys repeat across them
    packages, latest = _random_packages(seed=11 + tasks)

    merged = _run_stages(packages, tasks)
    together = _run_stages(packages, tasks, superseded_allowed=True)

    assert together.schema == merged.schema
    assert merged.num_rows == len(latest) < together.num_rows, "a key several pieces hold keeps each of its rows"
    assert _latest_by_version(together) == _latest_by_version(merged) == latest


def test_pieces_with_unchanged_values_are_merged_even_where_superseded_rows_are_allowed(monkeypatch):
    monkeypatch.setattr(spark_plan, "DECODED_BYTES_PER_FLUSH", 1)
    packages, _ = _random_packages(seed=7)
    packages = _with_unchanged_value(packages)

    together = _run_stages(packages, 1, superseded_allowed=True)

    keys = [row["c0"] for row in together.to_pylist()]
    assert len(keys) == len(set(keys)) == 30, "each row to fill is its key's newest change, filled once"


def test_a_result_file_that_cannot_be_written_goes_through_spark_as_a_blob(tmp_path):
    packages, latest = _random_packages(seed=3)
    payloads = pa.RecordBatch.from_arrays(
        [pa.array(range(1, len(packages) + 1), pa.int64()), pa.array([encode_package(p) for p in packages])],
        schema=INPUT_SCHEMA)

    [out] = spark_plan.DecodeStage(SPEC, None, directory=str(tmp_path / "gone"))(iter([payloads]))

    assert out.column("_path").null_count == 1 and out.column("_blob").null_count == 0
    assert spark_plan.merge_folded(spark_plan._results(out), len(SPEC.columns)).num_rows == len(latest)


def test_packages_that_cannot_be_written_to_a_file_go_as_values(tmp_path):
    packages, latest = _random_packages(seed=5)
    received = [describe(p, (i + 1,), encode_package(p)) for i, p in enumerate(packages)]

    rows = spark_plan.package_rows(received, str(tmp_path / "gone"))

    assert rows.schema == INPUT_SCHEMA
    [out] = spark_plan.DecodeStage(SPEC, None)(iter(rows.to_batches()))
    assert spark_plan.merge_folded(spark_plan._results(out), len(SPEC.columns)).num_rows == len(latest)


def test_a_packages_file_shorter_than_its_rows_say_is_named(tmp_path):
    packages, _ = _random_packages(seed=6)
    received = [describe(p, (i + 1,), encode_package(p)) for i, p in enumerate(packages)]
    rows = spark_plan.package_rows(received, str(tmp_path))
    path = tmp_path / spark_plan.PACKAGES_FILE
    path.write_bytes(path.read_bytes()[:-1])

    with pytest.raises(ValueError, match=rf"stream sequence \d+: .*{spark_plan.PACKAGES_FILE} ends before"):
        list(spark_plan.DecodeStage(SPEC, None, directory=str(tmp_path))(iter(rows.to_batches())))


@pytest.mark.parametrize(("sizes", "slices"), [([5, 1, 9, 3, 7, 2, 8], 2), ([4] * 5, 3), ([1, 2], 4), ([], 2)])
def test_packages_are_ordered_so_that_equal_slices_hold_about_equal_bytes(sizes, slices):
    order = spark_plan._balanced_order(sizes, slices)

    assert sorted(order) == list(range(len(sizes)))
    count = min(slices, len(sizes)) or 1
    bounds = [i * len(sizes) // count for i in range(count + 1)]
    totals = [sum(sizes[j] for j in order[bounds[i]:bounds[i + 1]]) for i in range(count)]
    assert max(totals, default=0) - min(totals, default=0) <= max(sizes, default=0)


def test_changes_up_to_the_last_truncate_are_dropped():
    changes = locate_changes(list(spark_plan.PackageDecoder(SPEC).decode(1, encode_package(package([
        insert(10, "1", "a", "1"), truncate(11), insert(12, "2", "b", "2"), update(13, "1", "c", "3"),
    ])))), SPEC).changes

    folded = changes.take(latest_indices(changes, naming.row_version(11, 1)))

    assert sorted(folded.column("_lsn").to_pylist()) == [12, 13]


def test_the_version_column_is_the_row_version_of_every_lsn_and_position():
    # LSNs travel as int64 (the upper half of the range as negative numbers); positions below 2^32.
    pairs = [(0, 0), (1, 0), (0, 1), (0x16B3748, 7), (2**32 - 1, 2**32 - 1), (2**32, 5), (2**63 - 1, 2**32 - 1),
             (2**63, 3), (2**64 - 1, 2**32 - 1)]
    as_int64 = [lsn - 2**64 if lsn >= 2**63 else lsn for lsn, _ in pairs]
    rows = pa.table({"_lsn": pa.chunked_array([as_int64[:4], as_int64[4:]], pa.int64()),
                     "_pos": pa.array([position for _, position in pairs], pa.int64())})

    versions = with_version(rows).column("_version").to_pylist()

    assert [int(v) for v in versions] == [naming.row_version(lsn, position) for lsn, position in pairs]


@pytest.mark.parametrize("overlap", ["none", "some", "all"])
def test_merging_folded_pieces_keeps_the_newest_copy_of_each_key(overlap):
    rng = random.Random(len(overlap))
    pieces, newest = [], {}
    for piece_number in range(3):
        if overlap == "none":
            keys = [f"{piece_number}-{k}" for k in range(50)]
        elif overlap == "all":
            keys = [str(k) for k in range(50)]
        else:
            keys = [str(k) for k in rng.sample(range(100), 50)]
        rows = {"_key": [], "_lsn": [], "_pos": [], "c0": []}
        for key in keys:
            # Equal LSNs across pieces, told apart by position: a key's versions never tie.
            lsn, position = rng.randrange(1, 5), piece_number * 3 + rng.randrange(1, 3)
            rows["_key"].append(key.encode())
            rows["_lsn"].append(lsn)
            rows["_pos"].append(position)
            rows["c0"].append(f"{piece_number}".encode())
            if key not in newest or (lsn, position) > newest[key][0]:
                newest[key] = ((lsn, position), str(piece_number))
        pieces.append(pa.table({"_key": pa.array(rows["_key"], pa.binary()), "_lsn": pa.array(rows["_lsn"], pa.int64()),
                                "_pos": pa.array(rows["_pos"], pa.int64()), "c0": pa.array(rows["c0"], pa.binary())}))
    pieces.insert(1, pieces[0].schema.empty_table())

    merged = merge_pieces(pieces)

    got = {}
    for row in merged.to_pylist():
        assert row["_key"].decode() not in got, "a key survived twice"
        got[row["_key"].decode()] = ((row["_lsn"], row["_pos"]), row["c0"].decode())
    assert got == newest


def _history_rows(table: pa.Table) -> list[tuple]:
    return sorted((row["_key"], row["_version"], tuple(row["_unchanged"] or ()), row["c1"])
                  for row in table.to_pylist())


def _with_unchanged_value(packages: list[pb.Package]) -> list[pb.Package]:
    """`packages` and, last, an UPDATE of key 4 that leaves its body unchanged (a TOASTed value)."""
    return [*packages, package([update(10_000, "4", UNCHANGED_TOAST, "9")])]


def test_the_toast_fill_reads_a_keys_history_from_the_kept_decode_as_from_a_new_one(monkeypatch):
    packages, _ = _random_packages(seed=7)
    packages = _with_unchanged_value(packages)
    received = [describe(p, (i + 1,), encode_package(p)) for i, p in enumerate(packages)]
    keys = [encode_tuple([str(k).encode()]) for k in (1, 4, 9, 29)]

    monkeypatch.setattr(spark_plan, "DECODED_BYTES_PER_FLUSH", 1)  # a flush per package: many kept pieces
    pieces, located = spark_plan.folded_pieces_in_driver(received, SPEC, None)
    assert located is not None and len(located) == len(received)
    kept = spark_plan.key_history_in_driver(received, SPEC, keys, [1], located)
    decoded_again = spark_plan.key_history_in_driver(received, SPEC, keys, [1])

    assert kept.schema == decoded_again.schema
    assert _history_rows(kept) == _history_rows(decoded_again)
    assert {row["_key"] for row in kept.to_pylist()} == set(keys)  # every change of those keys, nothing else
    assert spark_plan.merge_folded(pieces, len(SPEC.columns)).num_rows == 30


def test_a_batch_without_unchanged_values_keeps_nothing():
    packages, _ = _random_packages(seed=9)
    received = [describe(p, (i + 1,), encode_package(p)) for i, p in enumerate(packages)]

    _, located = spark_plan.folded_pieces_in_driver(received, SPEC, None)

    assert located is None  # nothing will ask for a key's history


def test_a_batch_decoding_to_more_than_the_kept_size_keeps_nothing(monkeypatch):
    packages, _ = _random_packages(seed=8)
    packages = _with_unchanged_value(packages)
    received = [describe(p, (i + 1,), encode_package(p)) for i, p in enumerate(packages)]
    monkeypatch.setattr(spark_plan, "DECODED_BYTES_PER_FLUSH", 1)
    monkeypatch.setattr(spark_plan, "HISTORY_KEPT_BYTES", 200)  # a few packages' worth

    _, located = spark_plan.folded_pieces_in_driver(received, SPEC, None)

    assert located is None


def test_the_as_sent_rows_of_many_packages_make_one_part_with_the_rows_of_each():
    packages, _ = _random_packages(seed=7)
    payloads = [(i + 1, encode_package(p)) for i, p in enumerate(packages)]
    decoder = spark_plan.PackageDecoder(SPEC)
    one_by_one = [part for seq, payload in payloads for part in decoder.decode(seq, payload)]
    as_sent = AsSentRows()
    others = [part for seq, payload in payloads for part in decoder.decode(seq, payload, as_sent)]
    gathered = as_sent.batch()

    assert gathered is not None and as_sent.count == 0 and as_sent.batch() is None  # it starts over
    assert gathered.num_rows == sum(p.num_rows for p in one_by_one) - sum(p.num_rows for p in others)

    def rows(parts):
        table = pa.Table.from_batches(parts, DECODED_SCHEMA)
        return sorted(zip(*(table.column(name).to_pylist() for name in DECODED_SCHEMA.names), strict=True),
                      key=repr)

    # The same rows, each with its own package's sequence, and the same changes located from them.
    assert rows([gathered, *others]) == rows(one_by_one)
    assert locate_changes([gathered, *others], SPEC).changes.num_rows == locate_changes(one_by_one, SPEC).changes.num_rows


def test_of_two_copies_of_a_key_with_one_version_the_later_piece_wins():
    def piece(keys, lsn, value):
        return pa.table({"_key": pa.array([k.encode() for k in keys], pa.binary()),
                         "_lsn": pa.array([lsn] * len(keys), pa.int64()), "_pos": pa.array([1] * len(keys), pa.int64()),
                         "c0": pa.array([value.encode()] * len(keys), pa.binary())})

    merged = merge_pieces([piece(["a", "b"], 7, "first"), piece(["b", "c"], 7, "second"), piece(["c"], 6, "third")])

    assert sorted((row["_key"], row["c0"]) for row in merged.to_pylist()) == [
        (b"a", b"first"), (b"b", b"second"), (b"c", b"second")]
