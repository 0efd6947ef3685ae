"""Block-range partitions of a source table: key `00000000-00008191` is blocks 0..8191, inclusive.

Keys are dynamic partitions, one set per table, kept current as the table grows (a sensor adds
the ranges of new blocks; `siphon-dagster partitions refresh` does the same once from the CLI).
The last range of a table is a full-width key even while the table only partly fills it, so a
growing table never changes an existing key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import dagster as dg

KEY_DIGITS = 8
_KEY = re.compile(r"^(\d{8,})-(\d{8,})$")


@dataclass(frozen=True, order=True)
class BlockRange:
    first_block: int
    last_block: int

    @property
    def key(self) -> str:
        return f"{self.first_block:0{KEY_DIGITS}d}-{self.last_block:0{KEY_DIGITS}d}"

    @property
    def ctid_bounds(self) -> tuple[str, str]:
        """Inclusive TID bounds for a TID range scan (PostgreSQL 14+)."""
        return f"({self.first_block},0)", f"({self.last_block},65535)"


def parse_key(key: str, blocks_per_partition: int | None = None) -> BlockRange:
    match = _KEY.match(key)
    if not match:
        raise ValueError(f"partition key {key!r} is not a block range like 00000000-00008191")
    block_range = BlockRange(int(match.group(1)), int(match.group(2)))
    if block_range.last_block < block_range.first_block:
        raise ValueError(f"partition key {key!r}: the last block precedes the first")
    if blocks_per_partition is not None and (
        block_range.first_block % blocks_per_partition
        or block_range.last_block - block_range.first_block + 1 != blocks_per_partition
    ):
        raise ValueError(f"partition key {key!r} does not match blocks_per_partition={blocks_per_partition}")
    return block_range


def range_count(blocks: int, blocks_per_partition: int) -> int:
    """How many ranges cover `blocks` blocks (at least one, so an empty table has a partition)."""
    return max(1, -(-blocks // blocks_per_partition))


def ranges_for(blocks: int, blocks_per_partition: int) -> list[BlockRange]:
    """Ranges covering `blocks` blocks (at least one range, so an empty table has a partition)."""
    return [BlockRange(i * blocks_per_partition, (i + 1) * blocks_per_partition - 1)
            for i in range(range_count(blocks, blocks_per_partition))]


def partitions_def_name(application_identifier: str, schema: str, table: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_]", "_", f"{application_identifier}__{schema}__{table}")
    return f"blocks__{safe}"


def block_partitions(application_identifier: str, schema: str, table: str) -> dg.DynamicPartitionsDefinition:
    return dg.DynamicPartitionsDefinition(name=partitions_def_name(application_identifier, schema, table))


def missing_keys(existing: list[str], blocks: int, blocks_per_partition: int) -> list[str]:
    have = set(existing)
    return [r.key for r in ranges_for(blocks, blocks_per_partition) if r.key not in have]
