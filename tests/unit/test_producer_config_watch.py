"""What the producer takes from a siphon.yaml edited while it streams: the table list only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from producer_service.config_watch import ConfigWatcher
from siphon_core.config import load_config


def _write(path: Path, tables: list[dict], **producer: object) -> None:
    path.write_text(yaml.safe_dump({
        "application_identifier": "app.one", "source": {"dsn": "postgresql://u@127.0.0.1:5432/db"},
        "queue": {"url": "nats://127.0.0.1:4222"}, "producer": producer, "tables": tables,
    }))
    stat = path.stat()  # a later write in the same clock tick still looks changed
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "siphon.yaml"
    _write(path, [{"name": "public.a", "exclude_columns": ["secret"]}, {"name": "public.b"}])
    return path


def test_an_unchanged_file_is_no_change(config_file: Path) -> None:
    watcher = ConfigWatcher(config_file, load_config(config_file))
    assert watcher.poll() is None
    assert watcher.poll() is None


def test_added_and_removed_tables_are_reported_once(config_file: Path) -> None:
    watcher = ConfigWatcher(config_file, load_config(config_file))
    assert watcher.poll() is None
    _write(config_file, [{"name": "public.a", "exclude_columns": ["secret"]}, {"name": "public.c"}])

    change = watcher.poll()

    assert change is not None and (change.added, change.removed) == (["public.c"], ["public.b"])
    assert [t.name for t in change.config.tables] == ["public.a", "public.c"]
    watcher.accept(change)
    assert watcher.poll() is None


def test_a_table_already_streaming_keeps_the_exclusions_it_started_with(config_file: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    watcher = ConfigWatcher(config_file, load_config(config_file))
    _write(config_file, [{"name": "public.a"}, {"name": "public.b"}, {"name": "public.c"}])

    with caplog.at_level("WARNING"):
        change = watcher.poll()

    assert change is not None and change.added == ["public.c"]
    assert change.config.tables[0].exclude_columns == ["secret"]
    assert "exclude_columns changed" in caplog.text and "public.a" in caplog.text


def test_other_sections_are_reported_as_needing_a_restart_and_not_taken(config_file: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(config_file)
    watcher = ConfigWatcher(config_file, config)
    _write(config_file, [{"name": "public.a", "exclude_columns": ["secret"]}, {"name": "public.b"},
                         {"name": "public.c"}], max_package_events=5)

    with caplog.at_level("WARNING"):
        change = watcher.poll()

    assert change is not None
    assert change.config.producer.max_package_events == config.producer.max_package_events
    assert "restart it to apply them" in caplog.text and "producer" in caplog.text


def test_a_file_that_does_not_load_is_reported_and_changes_nothing(config_file: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    watcher = ConfigWatcher(config_file, load_config(config_file))
    config_file.write_text("tables:\n  - name: no_schema\n")
    with caplog.at_level("ERROR"):
        assert watcher.poll() is None
    assert "does not load" in caplog.text and "no_schema" in caplog.text


def test_a_change_to_retry_is_read_again(config_file: Path) -> None:
    watcher = ConfigWatcher(config_file, load_config(config_file))
    _write(config_file, [{"name": "public.a", "exclude_columns": ["secret"]}, {"name": "public.b"},
                         {"name": "public.c"}])
    assert watcher.poll() is not None
    watcher.retry_later()
    change = watcher.poll()
    assert change is not None and change.added == ["public.c"]
