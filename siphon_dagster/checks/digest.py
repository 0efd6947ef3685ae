"""The row digest every database computes the same way, and the pure logic around it.

A row's text is each replicated column as PostgreSQL's text output, `'1' || value` or `'0'` for
NULL (so NULL and the text `\\N` differ), joined by the unit separator (chr(31)); its hash is
md5 of that text in lower-case hex. A key's text is its columns' text joined the same way; a row's
bucket is the first `digits` hex digits of md5(key text). A bucket's digest is md5 of its row
hashes sorted and concatenated: order-free, so PostgreSQL, ClickHouse and Snowflake agree without
sorting the rows alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from siphon_dagster.partitions import BlockRange
from siphon_dagster.targets.base import BucketDigest, TargetRow

SEPARATOR_CODE = 31
MIN_ROWS_PER_BUCKET = 100
MAX_DIGITS = 5

# The kinds of a divergent key.
MISSING = "missing at target"
EXTRA = "extra at target"
DIFFERS = "values differ"


@dataclass(frozen=True)
class SourceRow:
    hash: str
    block: int  # of the row's ctid, which names its snapshot partition


@dataclass(frozen=True)
class DivergentKey:
    key: tuple[str | None, ...]
    kind: str
    partition: str | None = None  # the block range holding the source row; None for an extra key


@dataclass
class ParityReport:
    """What row parity found: keys that differ although the stream applied past the source's read."""

    source_rows: int = 0
    target_rows: int = 0
    digits: int = 1
    buckets: int = 0
    mismatched_buckets: int = 0
    divergent: list[DivergentKey] = field(default_factory=list)
    in_flight: list[tuple[str | None, ...]] = field(default_factory=list)  # still moving after every round
    rounds: int = 0

    @property
    def partitions(self) -> list[str]:
        return sorted({k.partition for k in self.divergent if k.partition is not None})


def bucket_digits(rows: int) -> int:
    """Hex digits of the bucket prefix (1 to 5): the most that keep MIN_ROWS_PER_BUCKET rows in a
    bucket, so a mismatch reads 100-1600 rows (10 million rows: 4 digits, 153 rows a bucket)."""
    digits = 1
    while digits < MAX_DIGITS and rows / 16 ** (digits + 1) >= MIN_ROWS_PER_BUCKET:
        digits += 1
    return digits


def mismatched_buckets(source: Mapping[str, BucketDigest], target: Mapping[str, BucketDigest]) -> list[str]:
    return sorted(b for b in source.keys() | target.keys() if source.get(b) != target.get(b))


def classify(keys: Iterable[tuple[str | None, ...]], source: Mapping[tuple, SourceRow],
             target: Mapping[tuple, TargetRow], version: int,
             blocks_per_partition: int) -> tuple[list[DivergentKey], list[tuple]]:
    """Divergent keys, and keys in flight (changed at the target after the source's read `version`)."""
    divergent, in_flight = [], []
    for key in sorted(set(keys), key=_sortable):
        row, stored = source.get(key), target.get(key)
        current = stored is not None and not stored.deleted
        if row is not None and current and row.hash == stored.hash:
            continue
        if row is None and not current:
            continue
        if stored is not None and stored.version > version:
            in_flight.append(key)
            continue
        kind = MISSING if not current else EXTRA if row is None else DIFFERS
        partition = partition_key(row.block, blocks_per_partition) if row is not None else None
        divergent.append(DivergentKey(key, kind, partition))
    return divergent, in_flight


@dataclass(frozen=True)
class KeyRead:
    """Some keys read again at both ends, once the stream applied past the source's new read."""

    source: Mapping[tuple, SourceRow]
    target: Mapping[tuple, TargetRow]
    version: int  # the new read's version_before


@dataclass
class Settled:
    divergent: list[DivergentKey]
    in_flight: list[tuple]  # still changing after every round allowed
    rounds: int


def settle(divergent: list[DivergentKey], in_flight: list[tuple], reread: Callable[[list[tuple]], KeyRead | None],
           attempts: int, blocks_per_partition: int) -> Settled:
    """Reads the keys of a first `classify` again until each is equal, divergent, or out of rounds.

    A key is divergent only once two reads find it so. PostgreSQL writes a commit's WAL record
    before the commit shows in new snapshots, so a read can miss a commit whose LSN is below the
    position noted before it, while the target already holds that commit's row: one read alone
    would call the key extra or different. Keys in flight get `attempts` rounds; a key found
    divergent gets its second read even past them. `reread` returns None when the stream did not
    apply a new read in time: the keys found divergent once are then reported as they are.
    """
    confirmed: list[DivergentKey] = []
    suspects = divergent
    rounds = 0
    while True:
        moving = in_flight if rounds < attempts else []
        if not moving and not suspects:
            break
        rounds += 1
        read = reread(moving + [k.key for k in suspects])
        if read is None:
            confirmed += suspects
            break
        suspected = {k.key for k in suspects}
        found, changing = classify(moving + list(suspected), read.source, read.target, read.version,
                                   blocks_per_partition)
        confirmed += [k for k in found if k.key in suspected]
        suspects = [k for k in found if k.key not in suspected]
        in_flight = changing if moving else in_flight + changing
    return Settled(sorted(confirmed, key=lambda k: _sortable(k.key)), in_flight, rounds)


def partition_key(block: int, blocks_per_partition: int) -> str:
    first = block // blocks_per_partition * blocks_per_partition
    return BlockRange(first, first + blocks_per_partition - 1).key


@dataclass(frozen=True)
class CountBand:
    """Row count of the source at one read against the target's rows around that read's version."""

    source: int
    at_or_below: int  # C1: current target rows with version <= V
    above: int  # C2: current target rows with version > V
    tombstones_above: int  # T2: keys whose latest version is a tombstone > V

    @property
    def drift(self) -> bool:
        """Outside C1 <= S <= C1 + C2 + T2: no ordering of in-flight changes explains the counts."""
        return not self.at_or_below <= self.source <= self.at_or_below + self.above + self.tombstones_above

    @property
    def settled(self) -> bool:
        return self.source == self.at_or_below + self.above

    def describe(self) -> str:
        return (f"source {self.source} rows; target {self.at_or_below} rows at or before the source's read, "
                f"{self.above} rows and {self.tombstones_above} deletions after it")


@dataclass(frozen=True)
class ExactCount:
    """The source's rows at one read against the target's once the stream applied past it, key by key.

    A key the target holds with no version above the read's V changed in nothing the read missed or
    the stream has not applied, so the read holds it exactly when the target's current rows do; a
    key with a newer version (or a tombstone) is looked up in the read itself. So without drift
    `source` = `unchanged` + `changed_at_source`, however busy the table."""

    source: int  # S: rows the read counted
    unchanged: int  # C1: current target rows with no version above V
    changed_keys: int  # keys with a version above V at the target (current or deleted)
    changed_at_source: int  # of those, keys the read holds

    @property
    def difference(self) -> int:
        """Target rows minus source rows among the keys unchanged since the read: drift when not 0."""
        return self.unchanged - (self.source - self.changed_at_source)

    def describe(self) -> str:
        return (f"source {self.source} rows, of which {self.source - self.changed_at_source} unchanged since the "
                f"read; target {self.unchanged} such rows ({self.changed_keys} keys changed since, "
                f"{self.changed_at_source} of them in the read)")


def _sortable(key: tuple[str | None, ...]) -> tuple:
    return tuple((v is None, v or "") for v in key)
