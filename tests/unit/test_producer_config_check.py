"""When the producer's loop reads siphon.yaml again: on its interval, at its first turn, and at the
turn after a SIGHUP, whatever the monotonic clock reads (it counts from the machine's boot)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from producer_service.service import ProducerService
from siphon_core.config import load_config

JUST_BOOTED = 5.0  # the monotonic clock of a machine up for 5 s
LONG_UP = 86_400.0


def _checked(service: ProducerService, now: float) -> None:
    """A check of the file at `now`; it is unchanged, so the source is not asked."""
    service._check_config(None, now)  # type: ignore[arg-type]


def _service(tmp_path: Path, check_seconds: float) -> ProducerService:
    path = tmp_path / "siphon.yaml"
    path.write_text(yaml.safe_dump({
        "application_identifier": "app.one", "source": {"dsn": "postgresql://u@127.0.0.1:5432/db"},
        "queue": {"url": "nats://127.0.0.1:4222"}, "producer": {"config_check_seconds": check_seconds},
        "tables": [{"name": "public.a"}],
    }))
    return ProducerService(load_config(path), config_path=str(path))


@pytest.mark.parametrize("boot", [JUST_BOOTED, LONG_UP])
def test_a_sighup_is_read_at_the_next_turn_however_long_the_machine_is_up(tmp_path: Path, boot: float) -> None:
    service = _service(tmp_path, check_seconds=3600)
    assert service.config_check_due(boot)  # the first turn
    _checked(service, boot)
    assert not service.config_check_due(boot + 1)
    service.request_config_check()
    assert service.config_check_due(boot + 1)
    _checked(service, boot + 1)
    assert not service.config_check_due(boot + 2)
    assert service.config_check_due(boot + 1 + 3600)


def test_with_no_interval_the_file_is_read_at_start_and_on_sighup_only(tmp_path: Path) -> None:
    service = _service(tmp_path, check_seconds=0)
    assert service.config_check_due(JUST_BOOTED)
    _checked(service, JUST_BOOTED)
    assert not service.config_check_due(LONG_UP)
    service.request_config_check()
    assert service.config_check_due(LONG_UP)


def test_without_a_file_nothing_is_read(tmp_path: Path) -> None:
    service = _service(tmp_path, check_seconds=5)
    service._watcher = None
    assert not service.config_check_due(LONG_UP)
