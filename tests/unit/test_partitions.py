import pytest

from siphon_dagster.partitions import BlockRange, missing_keys, parse_key, ranges_for


def test_keys_are_zero_padded_inclusive_block_ranges():
    assert [r.key for r in ranges_for(blocks=20000, blocks_per_partition=8192)] == [
        "00000000-00008191", "00008192-00016383", "00016384-00024575"]


def test_an_empty_table_still_has_one_partition():
    assert [r.key for r in ranges_for(0, 8192)] == ["00000000-00008191"]


def test_growth_only_adds_keys():
    existing = [r.key for r in ranges_for(100, 64)]
    assert missing_keys(existing, 100, 64) == []
    assert missing_keys(existing, 129, 64) == ["00000128-00000191"]


def test_parse_key_round_trips_and_checks_width():
    assert parse_key("00008192-00016383", 8192) == BlockRange(8192, 16383)
    assert parse_key("00008192-00016383").ctid_bounds == ("(8192,0)", "(16383,65535)")
    with pytest.raises(ValueError, match="does not match blocks_per_partition=64"):
        parse_key("00000000-00008191", 64)
    with pytest.raises(ValueError, match="is not a block range"):
        parse_key("0-8191")
    with pytest.raises(ValueError, match="precedes"):
        parse_key("00000010-00000001")
