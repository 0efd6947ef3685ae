"""Which table settings a ClickHouse error refuses: only an error about a setting names any."""

from __future__ import annotations

from siphon_dagster.targets.base import TargetError
from siphon_dagster.targets.clickhouse import _refused_settings

SETTINGS = ("min_bytes_for_full_part_storage", "min_parts_to_merge_at_once")


def test_an_unknown_setting_is_refused() -> None:
    error = TargetError("public.notes: creating the table failed: Code: 115. DB::Exception: Unknown setting "
                        "'min_parts_to_merge_at_once': for storage ReplacingMergeTree. (UNKNOWN_SETTING)")
    assert _refused_settings(error, SETTINGS) == ["min_parts_to_merge_at_once"]


def test_a_setting_the_profile_does_not_allow_is_refused() -> None:
    error = TargetError("Code: 452. DB::Exception: Setting min_bytes_for_full_part_storage should not be changed. "
                        "(SETTING_CONSTRAINT_VIOLATION)")
    assert _refused_settings(error, SETTINGS) == ["min_bytes_for_full_part_storage"]


def test_another_error_quoting_the_statement_refuses_nothing() -> None:
    error = TargetError("Code: 62. DB::Exception: Syntax error: failed at position 90 ('=') (line 1, col 90): "
                        "= 16777216, min_parts_to_merge_at_once = 20. Expected one of: ... (SYNTAX_ERROR)")
    assert _refused_settings(error, SETTINGS) == []
